"""Every accepted config key has an effect (issue 32's audit).

Two links are checked, so that an accepted key that does nothing fails here:

1. key -> Config: for every key in ``SUPPORTED_KEYS`` a probe sets it to a value other than
   its default (with whatever context the value needs) and the outcome of parsing must differ
   from the one without it: another :class:`Config`, or a ConfigError where the key's effect
   is to refuse (``elasticity.min_gpus`` above the world size, ``data_types.param_dtype``
   against the enabled mode). A key the parser accepts and drops fails; a new key without a
   probe fails (add one to ``PROBES``).
2. Config -> code: every field of the Config dataclasses is read somewhere in ``zero_core/``
   outside the config package (an attribute access of that name in the code that trains,
   saves, logs or launches). A field only the parser writes fails.

Keys that are accepted on purpose without effect are not here: they are ``NO_EFFECT_KEYS``,
each with the reason DeepSpeed gives it no effect on the result (tests/test_config.py checks
those are documented).
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import pathlib
import warnings

import pytest

from zero_core.config import SUPPORTED_KEYS, Config, parse_config
from zero_core.config import schema
from zero_core.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORLD = 4  # room for hpZ / MiCS / elasticity probes


def _adam(**params):
    return {"optimizer": {"type": "Adam", "params": params}}


def _sched(kind, **params):
    return {"scheduler": {"type": kind, "params": params}}


def _zero(**keys):
    return {"zero_optimization": dict(keys)}


def _z3(**keys):
    return {"zero_optimization": {"stage": 3, **keys}}


_MON = {"tensorboard": "output_path", "csv_monitor": "output_path"}
_ELASTIC = {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4],
            "min_gpus": 1, "max_gpus": 8}

# dotted key (a ":Type" table's key under that type) -> (context, another value). The probe
# config is the context with the key set to that value; the base is the context as it is
# (without the key, or, for a required key, with a different value).
PROBES: dict[str, tuple[dict, object]] = {
    "train_batch_size": ({"train_micro_batch_size_per_gpu": 1}, 8),
    "train_micro_batch_size_per_gpu": ({"gradient_accumulation_steps": 1}, 2),
    "gradient_accumulation_steps": ({"train_micro_batch_size_per_gpu": 1}, 2),
    "gradient_clipping": ({}, 0.0),  # off; absent is DeepSpeed's 1.0
    "steps_per_print": ({}, 3),
    "wall_clock_breakdown": ({}, True),
    "bfloat16.enabled": ({}, True),
    "communication_data_type": ({"bf16": {"enabled": True}}, "fp32"),
    "prescale_gradients": ({}, True),
    "gradient_predivide_factor": ({}, 2.0),
    "accelerator": ({}, "cpu"),
    "comm_backend": ({}, "gloo"),
    "comm_timeout": ({}, 30.0),
    "fp16.enabled": ({}, True),
    "fp16.loss_scale": ({"fp16": {"enabled": True}}, 128.0),
    "fp16.initial_scale_power": ({"fp16": {"enabled": True}}, 8),
    "fp16.loss_scale_window": ({"fp16": {"enabled": True}}, 10),
    "fp16.hysteresis": ({"fp16": {"enabled": True}}, 4),
    "fp16.consecutive_hysteresis": ({"fp16": {"enabled": True}}, True),
    "fp16.min_loss_scale": ({"fp16": {"enabled": True}}, 4.0),
    "fp16.auto_cast": ({"fp16": {"enabled": True}}, True),
    "bf16.enabled": ({}, True),
    "bf16.bf16_master_weights_and_grads": ({"bf16": {"enabled": True}}, True),
    "bf16.bf16_optimizer_states": (
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, True),
    "bf16.check_grad_overflow": ({"bf16": {"enabled": True}}, False),
    "optimizer.type": ({}, "SGD"),
    "scheduler.type": ({}, "WarmupLR"),
    "data_types.grad_accum_dtype": ({"bf16": {"enabled": True}}, "fp32"),
    "data_types.param_dtype": ({"bf16": {"enabled": True}}, "fp16"),  # refused: not the mode
    "torch_autocast.enabled": ({}, True),
    "torch_autocast.dtype": ({"torch_autocast": {"enabled": True}}, "bf16"),
    "torch_autocast.lower_precision_safe_modules": (
        {"torch_autocast": {"enabled": True}}, ["torch.nn.Linear"]),
    "checkpoint.tag_validation": ({}, "Fail"),
    "checkpoint.save_dir": ({}, "/tmp/zc-probe"),
    "checkpoint.save_interval_steps": ({"checkpoint": {"save_dir": "/tmp/zc-probe"}}, 5),
    "checkpoint.save_interval_minutes": ({"checkpoint": {"save_dir": "/tmp/zc-probe"}}, 5.0),
    "checkpoint.async_save": ({}, True),
    "checkpoint.keep_last": ({"checkpoint": {"save_dir": "/tmp/zc-probe"}}, 2),
    "checkpoint.resume": ({"checkpoint": {"save_dir": "/tmp/zc-probe"}}, "never"),
    "checkpoint.resume_batch": ({"checkpoint": {"save_dir": "/tmp/zc-probe"}}, "keep_micro"),
    "wandb.group": ({"wandb": {"enabled": True}}, "g"),
    "wandb.team": ({"wandb": {"enabled": True}}, "t"),
    "wandb.project": ({"wandb": {"enabled": True}}, "p"),
    "wandb.enabled": ({}, True),
    "comet.enabled": ({}, True),
    "comet.samples_log_interval": ({"comet": {"enabled": True}}, 7),
    "comet.project": ({"comet": {"enabled": True}}, "p"),
    "comet.workspace": ({"comet": {"enabled": True}}, "w"),
    "comet.api_key": ({"comet": {"enabled": True}}, "k"),
    "comet.experiment_name": ({"comet": {"enabled": True}}, "n"),
    "comet.experiment_key": ({"comet": {"enabled": True}}, "0123456789abcdef0123456789abcdef"),
    "comet.online": ({"comet": {"enabled": True}}, False),
    "comet.mode": ({"comet": {"enabled": True}}, "create"),
    "topology.ranks_per_node": ({}, 2),
    "elasticity.enabled": ({"elasticity": {**_ELASTIC, "enabled": False}}, True),
    "elasticity.max_train_batch_size": ({"elasticity": _ELASTIC}, 32),
    "elasticity.micro_batch_sizes": ({"elasticity": _ELASTIC}, [2]),
    "elasticity.min_gpus": ({"elasticity": _ELASTIC}, WORLD + 1),  # refused: world too small
    "elasticity.max_gpus": ({"elasticity": _ELASTIC}, WORLD - 1),
    "elasticity.prefer_larger_batch": ({"elasticity": {**_ELASTIC, "max_train_batch_size": 100,
                                                       "micro_batch_sizes": [1, 3]}}, False),
    "elasticity.ignore_non_elastic_batch_info": (
        {"elasticity": _ELASTIC, "train_micro_batch_size_per_gpu": 1}, True),
    "elasticity.version": ({"elasticity": {**_ELASTIC, "num_gpus_per_node": 4}}, 0.1),
    "elasticity.num_gpus_per_node": ({"elasticity": {**_ELASTIC, "version": 0.2}}, 4),
    "elasticity.model_parallel_size": ({"elasticity": _ELASTIC}, 2),  # refused
    "generation.max_live_parameters": ({}, 12345),
    "hybrid_engine.enabled": ({}, True),
    "hybrid_engine.max_out_tokens": ({"hybrid_engine": {"enabled": True}}, 77),
    "hybrid_engine.inference_tp_size": ({"hybrid_engine": {"enabled": True}}, 2),  # refused
    "hybrid_engine.release_inference_cache": ({"hybrid_engine": {"enabled": True}}, True),
    "hybrid_engine.pin_parameters": ({"hybrid_engine": {"enabled": True}}, False),
    "flops_profiler.enabled": ({}, True),
    **{f"flops_profiler.{_k}": ({"flops_profiler": {"enabled": True}}, _v) for _k, _v in (
        ("recompute_fwd_factor", 1.0), ("profile_step", 3), ("module_depth", 2),
        ("top_modules", 3), ("detailed", False), ("output_file", "f.txt"),
        ("peak_tflops", 100.0))},
    "safety.nonfinite_gradients": ({}, "raise"),
    "safety.max_consecutive_skips": ({}, 3),
    "safety.check_ranks_agree": ({}, False),
    "safety.check_batch_sizes": ({}, False),
    "safety.launcher_notice": ({}, False),
    "activation_checkpointing.partition_activations": ({}, True),
    "activation_checkpointing.cpu_checkpointing": ({}, True),
    "activation_checkpointing.contiguous_memory_optimization": ({}, True),
    "activation_checkpointing.number_checkpoints": ({}, 4),
    "activation_checkpointing.synchronize_checkpoint_boundary": ({}, True),
    "activation_checkpointing.profile": ({}, True),
    # zero_optimization
    "zero_optimization.stage": ({}, 2),
    "zero_optimization.reduce_bucket_size": ({}, 1000),
    "zero_optimization.overlap_comm": ({}, False),
    "zero_optimization.reduce_scatter": ({}, False),
    "zero_optimization.sub_group_size": ({}, 1000),
    "zero_optimization.zero_quantized_weights": (_z3(), True),
    "zero_optimization.zero_quantized_nontrainable_weights": (_z3(), True),
    "zero_optimization.zero_hpz_partition_size": (_z3(), 2),
    "zero_optimization.zero_quantized_gradients": (_z3(), True),
    "zero_optimization.mics_shard_size": (_z3(), 2),
    "zero_optimization.mics_hierarchical_params_gather": (_z3(mics_shard_size=2), True),
    "zero_optimization.node_aware_collectives": ({}, False),
    "zero_optimization.offload_optimizer.device": (_zero(stage=2), "cpu"),
    "zero_optimization.offload_param.device": (
        _z3(offload_optimizer={"device": "cpu"}), "cpu"),
}
# the stage-3 keys and their unprefixed spellings: one probe each
for _name, _value in (("prefetch_bucket_size", 1234), ("param_persistence_threshold", 7),
                      ("max_live_parameters", 4321), ("max_reuse_distance", 99),
                      ("gather_16bit_weights_on_model_save", True)):
    PROBES[f"zero_optimization.stage3_{_name}"] = (_z3(), _value)
    PROBES[f"zero_optimization.{_name}"] = (_z3(), _value)
PROBES["zero_optimization.stage3_gather_fp16_weights_on_model_save"] = (_z3(), True)
for _name, _value in (("pin_memory", True), ("buffer_count", 6)):
    PROBES[f"zero_optimization.offload_optimizer.{_name}"] = (
        _zero(stage=2, offload_optimizer={"device": "cpu"}), _value)
PROBES["zero_optimization.offload_optimizer.nvme_path"] = (
    _zero(stage=2, offload_optimizer={"device": "nvme", "nvme_path": "/tmp/a"}), "/tmp/b")
for _name, _value in (("pin_memory", True), ("buffer_count", 7), ("buffer_size", 1000),
                      ("max_in_cpu", 1000)):
    PROBES[f"zero_optimization.offload_param.{_name}"] = (
        _z3(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}), _value)
PROBES["zero_optimization.offload_param.nvme_path"] = (
    _z3(offload_optimizer={"device": "cpu"},
        offload_param={"device": "nvme", "nvme_path": "/tmp/a"}), "/tmp/b")
for _section, _path_key in _MON.items():
    PROBES[f"{_section}.enabled"] = ({}, True)
    PROBES[f"{_section}.output_path"] = ({_section: {"enabled": True}}, "/tmp/zc-probe-mon")
    PROBES[f"{_section}.job_name"] = ({_section: {"enabled": True}}, "probe")
for _kind in ("Adam", "AdamW"):
    for _name, _value in (("lr", 0.5), ("betas", [0.5, 0.6]), ("eps", 1e-3),
                          ("weight_decay", 0.5), ("adam_w_mode", False),
                          ("bias_correction", False)):
        PROBES[f"optimizer.params:{_kind}.{_name}"] = ({"optimizer": {"type": _kind}}, _value)
for _name, _value in (("lr", 0.5), ("momentum", 0.5), ("dampening", 0.5), ("weight_decay", 0.5),
                      ("nesterov", True)):
    PROBES[f"optimizer.params:SGD.{_name}"] = (
        {"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}}, _value)
for _name, _value in (("lr", 0.5), ("betas", [0.5, 0.6]), ("eps", 1e-3), ("weight_decay", 0.5),
                      ("bias_correction", False), ("max_coeff", 5.0), ("min_coeff", 0.05)):
    PROBES[f"optimizer.params:Lamb.{_name}"] = ({"optimizer": {"type": "Lamb"}}, _value)
_WARM = {"warmup_min_lr": 0.1, "warmup_max_lr": 0.7, "warmup_num_steps": 9,
         "warmup_type": "linear", "last_batch_iteration": 3}
for _kind in ("WarmupLR", "WarmupDecayLR"):
    for _name, _value in _WARM.items():
        PROBES[f"scheduler.params:{_kind}.{_name}"] = (
            {"scheduler": {"type": _kind, "params": {"total_num_steps": 100}
                           if _kind == "WarmupDecayLR" else {}}}, _value)
PROBES["scheduler.params:WarmupDecayLR.total_num_steps"] = (
    {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}}, 77)
for _name, _value in (("total_num_steps", 77), ("warmup_min_ratio", 0.3), ("warmup_num_steps", 9),
                      ("cos_min_ratio", 0.3), ("warmup_type", "linear"),
                      ("last_batch_iteration", 3)):
    PROBES[f"scheduler.params:WarmupCosineLR.{_name}"] = (
        {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}}, _value)

for _kind, _extra in (
        ("OneBitAdam", {"freeze_step": 5}),
        ("ZeroOneAdam", {"var_freeze_step": 5, "var_update_scaler": 2, "local_step_scaler": 3,
                         "local_step_clipper": 4}),
        ("OneBitLamb", {"freeze_step": 5, "max_coeff": 5.0, "min_coeff": 0.1, "coeff_beta": 0.8,
                        "factor_max": 3.0, "factor_min": 0.4, "factor_threshold": 0.2})):
    for _name, _value in {"lr": 0.5, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1,
                          "comm_backend_name": "mpi", "cuda_aware": True, **_extra}.items():
        PROBES[f"optimizer.params:{_kind}.{_name}"] = ({"optimizer": {"type": _kind}}, _value)

_ZENFLOW = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                  "zenflow": {"update_interval": 4}}}
for _name, _value in (("topk_ratio", 0.3), ("select_strategy", "step"), ("select_interval", 8),
                      ("update_interval", 6), ("overlap_step", True), ("offload", True),
                      ("full_warm_up_rounds", 3),
                      ("pt_reserved_cores_perc", 0.25)):
    PROBES[f"zero_optimization.zenflow.{_name}"] = (_ZENFLOW, _value)
PROBES["zero_optimization.zenflow.auto_ratio"] = (   # acts with update_interval "auto"
    {"zero_optimization": {**_ZENFLOW["zero_optimization"], "zenflow": {}}}, 0.5)

_OFFLOAD3 = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
PROBES["zero_optimization.offload_optimizer.ratio"] = (_OFFLOAD3, 0.5)
PROBES["zero_optimization.offload_optimizer.super_offload"] = (_OFFLOAD3, True)
PROBES["zero_optimization.offload_optimizer.cpuadam_cores_perc"] = (
    {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                              "super_offload": True}}}, 0.5)


def _supported_leaf_keys() -> list[str]:
    """Every supported key by its probe name; a key that is itself a section is covered by
    its own keys ("fp16" by "fp16.enabled", ...)."""
    sections = {t.split(":")[0] for t in SUPPORTED_KEYS}
    out = []
    for table, keys in SUPPORTED_KEYS.items():
        for key in keys:
            dotted = f"{table}.{key}" if table else key
            if dotted in sections or dotted in {"bfloat16"}:
                if dotted == "bfloat16":
                    out.append("bfloat16.enabled")
                continue
            out.append(dotted)  # "optimizer.params" too: the section as such
    return out


def _with_key(context: dict, dotted: str, value) -> dict:
    """*context* with the key at *dotted* set ("optimizer.params:Adam.lr" puts lr under
    optimizer.params)."""
    cfg = copy.deepcopy(context)
    table, _, key = dotted.rpartition(".")
    path = table.split(":")[0].split(".") if table else []
    node = cfg
    for part in path:
        node = node.setdefault(part, {})
    node[key] = value
    return cfg


def _outcome(cfg: dict) -> Config | str:
    """The parsed Config, or the ConfigError's message."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return parse_config(cfg, world_size=WORLD)
        except ConfigError as exc:
            return f"ConfigError: {exc}"


@pytest.mark.parametrize("dotted", _supported_leaf_keys())
def test_every_accepted_key_changes_the_parsed_config(dotted):
    assert dotted in PROBES, (
        f"{dotted} is accepted but has no probe here: add one to PROBES (a non-default value "
        f"and the context it needs), and make sure the key changes what the engine does")
    context, value = PROBES[dotted]
    base, probed = _outcome(context), _outcome(_with_key(context, dotted, value))
    assert isinstance(base, Config) or isinstance(probed, Config), (
        f"the probe for {dotted} is refused with and without the key: {probed}")
    assert base != probed, f"{dotted} = {value!r} is accepted and changes nothing in the Config"


def test_no_stale_probes():
    assert set(PROBES) <= set(_supported_leaf_keys()), set(PROBES) - set(_supported_leaf_keys())


def _config_fields() -> dict[str, str]:
    """field name -> the dataclass that declares it, for every Config dataclass."""
    fields = {}
    for obj in vars(schema).values():
        if dataclasses.is_dataclass(obj) and isinstance(obj, type):
            for f in dataclasses.fields(obj):
                fields.setdefault(f.name, obj.__name__)
    return fields


def _attributes_read_outside_config() -> set[str]:
    """Attribute names the code outside zero_core/config reads, plus the fields the schema's
    properties read when that property is read there (``comm_dtype_name`` reads
    ``communication_data_type``)."""
    names: set[str] = set()
    for path in (ROOT / "zero_core").rglob("*.py"):
        if "config" in path.relative_to(ROOT / "zero_core").parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)  # getattr(cfg, "name") / replace(**{"name": ...})
    tree = ast.parse(pathlib.Path(schema.__file__).read_text())
    for fn in ast.walk(tree):
        if (isinstance(fn, ast.FunctionDef) and fn.name in names and fn.name != "to_dict"
                and any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)):
            names.update(n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute))
    return names


# fields read only inside the config package, with why that is an effect
READ_IN_CONFIG = {
    "world_size": "the world size the batch triple was resolved for (parse_config checks it)",
    "check_grad_overflow": "false makes safety.nonfinite_gradients \"ignore\" at parse time",
    "inference_tp_size": "only 1 is accepted (more is refused: no tensor parallelism)",
}


def test_every_config_field_is_read_by_the_code_that_trains():
    read = _attributes_read_outside_config()
    unread = {name: cls for name, cls in _config_fields().items()
              if name not in read and name not in READ_IN_CONFIG}
    assert not unread, (f"Config fields no code outside zero_core/config reads (a key that "
                        f"does nothing): {unread}")
