"""The ``zero_optimization`` keys that shape stage communication across ranks: ZeRO++ (qwZ,
hpZ, qgZ) and many nodes (MiCS's ``mics_shard_size`` and ``mics_hierarchical_params_gather``,
``node_aware_collectives``), with the combinations refused and why. *s* is parser.py's
``_Section`` of ``zero_optimization``; config/parser.py calls them.
"""
from __future__ import annotations

from zero_core.config.checks import _as_bool, _as_int, _fail, _require_divisor

NORMALLY_A_NODE = "; normally the ranks per node"

_ZEROPP_NAMES = {
    "zero_quantized_weights": "qwZ (quantized weight all-gathers)",
    "zero_quantized_nontrainable_weights": "qwZ for frozen weights",
    "zero_hpz_partition_size": "hpZ (secondary partitions inside the node)",
    "zero_quantized_gradients": "qgZ (quantized gradient all-to-all)",
}


def parse_zeropp(s, stage: int, world_size: int) -> dict:
    """The ZeRO++ keys; switched on below stage 3 they are an error (ZeRO++ changes how
    stage 3 gathers its partitioned parameters, which stages 0-2 do not have)."""
    values = {
        "zero_quantized_weights": s.get("zero_quantized_weights", False, _as_bool),
        "zero_quantized_nontrainable_weights": s.get("zero_quantized_nontrainable_weights",
                                                     False, _as_bool),
        "zero_hpz_partition_size": s.get("zero_hpz_partition_size", 1, _as_int, 1),
        "zero_quantized_gradients": s.get("zero_quantized_gradients", False, _as_bool),
    }
    off = {"zero_hpz_partition_size": 1}
    for key, value in values.items():
        if stage < 3 and value != off.get(key, False):
            raise _fail(f"zero_optimization.{key}", value,
                        f"ZeRO++ {_ZEROPP_NAMES[key]} works on stage 3's partitioned parameters; "
                        f"set zero_optimization.stage to 3 to use it — at stage {stage} only "
                        f"{str(off.get(key, False)).lower()} (the feature off) is accepted")
    _require_divisor("zero_optimization.zero_hpz_partition_size",
                     values["zero_hpz_partition_size"], world_size, NORMALLY_A_NODE)
    return values


def parse_many_nodes(s, stage: int, world_size: int, zeropp: dict) -> dict:
    """MiCS (``mics_shard_size``, ``mics_hierarchical_params_gather``) and
    ``node_aware_collectives``; which shard sizes fit the nodes is checked where the
    topology is known (zero_core/runtime/partition_comm.py)."""
    shard = s.get("mics_shard_size", -1, _as_int)
    hierarchical = s.get("mics_hierarchical_params_gather", False, _as_bool)
    values = {"mics_shard_size": shard, "mics_hierarchical_params_gather": hierarchical,
              "node_aware_collectives": s.get("node_aware_collectives", True, _as_bool)}
    path = "zero_optimization.mics_shard_size"
    if shard == -1:
        if hierarchical:
            raise _fail("zero_optimization.mics_hierarchical_params_gather", True,
                        "it shapes MiCS's gathers, and MiCS is off; set "
                        "zero_optimization.mics_shard_size too, or remove this key")
        return values
    if shard < 1:
        raise _fail(path, shard, "expected -1 (MiCS off) or the number of ranks each copy of "
                                 "the model states is spread over (>= 1; normally the ranks "
                                 "per node)")
    if stage < 1:
        raise _fail(path, shard, "MiCS shards the partitioned model states, and stage 0 "
                                 "partitions nothing; set zero_optimization.stage to 1, 2 or 3")
    _require_divisor(path, shard, world_size, NORMALLY_A_NODE)
    if zeropp["zero_quantized_gradients"]:
        raise _fail(path, shard, "ZeRO++ qgZ (zero_quantized_gradients) reduces over every "
                                 "rank in two hops (inside the node, then across nodes), while "
                                 "MiCS reduce-scatters inside its shard group and all-reduces "
                                 "across the copies; combine MiCS with qwZ only, or switch "
                                 "MiCS off to use qgZ")
    if zeropp["zero_hpz_partition_size"] > 1:
        raise _fail(path, shard, "ZeRO++ hpZ (zero_hpz_partition_size) keeps a second "
                                 "partition so that backward gathers stay in the node; MiCS's "
                                 "shard group already keeps every gather in the group. Use one "
                                 "of them: mics_shard_size = ranks per node gathers inside the "
                                 "node in forward too")
    return values
