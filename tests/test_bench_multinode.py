"""The multi-node benchmark worker (ci/bench/workers/multinode_engine.py) without a cluster:
its command line, the configs each variant trains with (zero-core's parse), the FSDP2 mesh
shape; and the driver's side (ci/bench/cluster.py): a variant reported as unable to run is
a "did not run" row, not a failure, peak RSS is a column, and --plot refuses a JSON path."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BENCH = os.path.join(ROOT, "ci", "bench")
WORKERS = os.path.join(BENCH, "workers")


def _load(name: str, path: str):
    saved = list(sys.path)
    sys.path.insert(0, os.path.dirname(path))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path[:] = saved


@pytest.fixture(scope="module")
def worker():
    return _load("multinode_engine", os.path.join(WORKERS, "multinode_engine.py"))


@pytest.fixture(scope="module")
def driver():
    return _load("bench_cluster", os.path.join(BENCH, "cluster.py"))


def test_arguments_defaults_and_the_driver_protocol(worker):
    a = worker.parse_args(["--variant", "mics", "--steps", "4", "--warmup", "2"])
    assert (a.variant, a.steps, a.warmup, a.model, a.micro) == ("mics", 4, 2, "bench", 2)
    assert (a.max_reuse, a.persistence, a.mics_hierarchical, a.fsdp_reduce_dtype) == \
        (0, 100_000, False, "bf16")
    assert set(worker.VARIANTS) == {"zero3", "zero3-nodeaware", "mics", "mics-zeropp", "zeropp",
                                    "fsdp2-hsdp", "deepspeed-3", "deepspeed-mics"}
    with pytest.raises(SystemExit):
        worker.parse_args(["--variant", "stage3"])
    with pytest.raises(SystemExit):
        worker.parse_args([])


def test_ranks_per_node_from_the_cluster_environment(worker):
    assert worker.ranks_per_node_from_env({"ZERO_CORE_RANKS_PER_NODE": "2",
                                           "LOCAL_WORLD_SIZE": "4"}) == 2
    assert worker.ranks_per_node_from_env({"LOCAL_WORLD_SIZE": "3"}) == 3
    assert worker.ranks_per_node_from_env({}) == 1


def _zero(worker, variant, *args, rpn=2):
    a = worker.parse_args(["--variant", variant, *args])
    return worker.zero_core_config(variant, a, rpn)


def test_zero_core_variants_differ_only_in_their_keys(worker):
    base = _zero(worker, "zero3")
    assert base["bf16"] == {"enabled": True}
    assert base["optimizer"]["type"] == "AdamW"
    assert base["zero_optimization"]["stage"] == 3
    assert base["zero_optimization"]["node_aware_collectives"] is False
    expected = {
        "zero3-nodeaware": {"node_aware_collectives": True},
        "mics": {"mics_shard_size": 2, "mics_hierarchical_params_gather": False},
        "mics-zeropp": {"mics_shard_size": 2, "mics_hierarchical_params_gather": False,
                        "zero_quantized_weights": True},
        "zeropp": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                   "zero_quantized_gradients": True},
    }
    common = {k: v for k, v in base["zero_optimization"].items() if k != "node_aware_collectives"}
    for variant, keys in expected.items():
        config = _zero(worker, variant)
        assert {k: v for k, v in config.items() if k != "zero_optimization"} == \
            {k: v for k, v in base.items() if k != "zero_optimization"}, variant
        assert config["zero_optimization"] == {**common, **keys}, variant
    assert _zero(worker, "mics", "--mics-hierarchical", rpn=4)["zero_optimization"][
        "mics_shard_size"] == 4
    assert _zero(worker, "mics", "--mics-hierarchical")["zero_optimization"][
        "mics_hierarchical_params_gather"] is True
    with pytest.raises(ValueError):
        worker.zero_core_config("fsdp2-hsdp", worker.parse_args(["--variant", "fsdp2-hsdp"]), 2)


@pytest.mark.parametrize("variant", ["zero3", "zero3-nodeaware", "mics", "mics-zeropp",
                                     "zeropp"])
def test_zero_core_parses_every_variants_config(worker, variant):
    from zero_core.config import parse_config
    parse_config(_zero(worker, variant), 4)


def test_deepspeed_configs_share_the_stage3_settings(worker):
    a = worker.parse_args(["--variant", "deepspeed-mics", "--max-live", "123"])
    ds3 = worker.deepspeed_config("deepspeed-3", a, 2)
    mics = worker.deepspeed_config("deepspeed-mics", a, 2)
    zero = _zero(worker, "zero3", "--max-live", "123")["zero_optimization"]
    for key in ("stage", "stage3_max_reuse_distance", "stage3_param_persistence_threshold",
                "stage3_max_live_parameters"):
        assert ds3["zero_optimization"][key] == zero[key] == mics["zero_optimization"][key]
    assert "mics_shard_size" not in ds3["zero_optimization"]
    assert mics["zero_optimization"]["mics_shard_size"] == 2
    assert ds3["bf16"] == {"enabled": True} and ds3["zero_allow_untested_optimizer"]
    assert ds3["gradient_clipping"] == 0.0


def test_fsdp_mesh_is_nodes_by_ranks_per_node(worker):
    assert worker.fsdp_mesh_shape(4, 2) == (2, 2)
    assert worker.fsdp_mesh_shape(8, 4) == (2, 4)
    with pytest.raises(ValueError):
        worker.fsdp_mesh_shape(6, 4)


def _report(times, rss):
    return {"step_times_s": times, "ledger": None, "link_tx_bytes": None, "peak_rss_mb": rss}


def test_driver_rows_did_not_run_and_peak_rss(driver):
    reason = driver.did_not_run([{"error": "no MiCS_Init |\nhere"}, None])
    assert reason == "no MiCS_Init / here"
    assert driver.did_not_run([_report([0.1], 10.0)]) is None
    row = driver.summarize([_report([0.1, 0.3], 100.0), _report([0.2, 0.1], 250.7)], 10**9)
    assert row["peak_rss_mb_max"] == 250.7 and row["step_s_median"] == pytest.approx(0.25)
    row.update(rate="1gbit", variant="zero3")
    skipped = {"rate": "1gbit", "variant": "deepspeed-mics", "error": reason,
               "did_not_run": True}
    failed = {"rate": "1gbit", "variant": "mics", "error": "MultiRankError: boom"}
    table = driver.markdown([row, skipped, failed])
    lines = table.splitlines()
    assert len({line.count("|") for line in lines}) == 1, table
    assert "| 251 |" in lines[2]
    assert "did not run: no MiCS_Init / here" in lines[3]
    assert "failed: MultiRankError: boom" in lines[4]


def test_driver_refuses_a_json_path_for_the_chart(driver, capsys):
    with pytest.raises(SystemExit):
        driver.main(["--plot", "docs/images/multinode.json", "--rates", "1gbit"])
    assert "--json docs/images/multinode.json" in capsys.readouterr().err
