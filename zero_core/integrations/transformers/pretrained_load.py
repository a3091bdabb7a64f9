"""``from_pretrained``: a local Hugging Face safetensors checkpoint loaded straight into
ZeRO stage-3 partitions (public as ``zero_core.integrations.transformers.from_pretrained``).

At stage 3 the model is built from its ``config.json`` inside ``zero_core.Init`` — so each
parameter is born partitioned — with what transformers 5 does for DeepSpeed ZeRO-3
(``PreTrainedModel.get_init_context``): the target dtype as torch's default
(``local_torch_dtype``), weights not tied yet (``no_tie_weights``: every checkpoint key has
a parameter to land in) and no weight initialization (``no_init_weights``: torch's init
functions and ``init_weights`` do nothing, as the checkpoint overwrites them). Without
initialization, parameters would hold whatever ``torch.empty`` returned, which differs
between ranks and would fail Init's cross-rank check; here ``torch.empty``-family results
are zero-filled while the model is built, so every rank builds the same zeros.

Then each rank reads, for every parameter, only the elements of its own slice
(``[rank·s, rank·s + s)`` of the flattened tensor, s = the padded partition size) with
``pread`` from the file that holds it, straight into its partition when the dtypes agree,
or through a bounded staging chunk converted to the model's dtype otherwise. No rank
holds the whole model, nor a whole tensor (only persistent buffers, which every rank
keeps whole anyway, are read whole).

After loading, transformers' order of operations (``PreTrainedModel._finalize_model_loading``):
tied targets are marked initialized, missing weights are initialized by the model's own
``_init_weights`` on gathered values (rank 0's broadcast, as HF does under ZeRO-3), the
weights are tied (symmetric: a checkpoint holding only the target ties to it; both
present with different values are left untied, with HF's warning), and the missing /
unexpected keys are reported by HF's own report (``log_state_dict_report``). A shape that
differs from the model's is an error.

Memory accounting: :class:`LoadLedger` counts every tensor the loader holds (partitions
Init allocated and the loader fills, persistent buffers, staging chunks) with its peak;
the result's ``zero_core_load_report`` carries it, and rank 0 logs one line.

At stages 0-2 every rank holds the whole model anyway: transformers' own
``from_pretrained`` loads it.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os

import torch
from torch.overrides import TorchFunctionMode

from zero_core.config import Config, parse_config
from zero_core.errors import ConfigError
from zero_core.integrations.transformers.hf_safetensors import CheckpointFiles, PretrainedError
from zero_core.runtime.launch import discover
from zero_core.stage3 import partitioned_params as pp

log = logging.getLogger("zero_core.integrations.transformers")

#: elements per staging chunk when the checkpoint's dtype differs from the model's
#: (2**22 fp32 elements = 16 MiB): the staging never exceeds a chunk of one slice
CHUNK = 2 ** 22
_MIB = 2 ** 20


class LoadLedger:
    """Bytes the loader holds now and at its peak, by category (this rank only)."""

    def __init__(self):
        self.now = 0
        self.peak = 0
        self.held: dict[str, int] = {}

    def hold(self, category: str, nbytes: int) -> None:
        self.now += nbytes
        self.held[category] = self.held.get(category, 0) + nbytes
        self.peak = max(self.peak, self.now)

    def drop(self, category: str, nbytes: int) -> None:
        self.now -= nbytes
        self.held[category] -= nbytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _ZeroFilledEmpty(TorchFunctionMode):
    """While the model is built: ``torch.empty``-family results are zero-filled (see the
    module docstring). Every other torch function passes through unchanged."""

    _EMPTY = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._EMPTY and isinstance(out, torch.Tensor) and out.device.type != "meta":
            with torch.no_grad():
                out.zero_()
        return out


# ---- what to build ---------------------------------------------------------------------------
def _resolve(cls_or_path, kwargs) -> tuple[type | None, str]:
    if isinstance(cls_or_path, (str, os.PathLike)):
        if "pretrained_model_name_or_path" in kwargs:
            raise ConfigError("from_pretrained: a path was given twice (positional and "
                              "pretrained_model_name_or_path=); pass one")
        return None, os.fspath(cls_or_path)
    if isinstance(cls_or_path, type):
        path = kwargs.pop("pretrained_model_name_or_path", None)
        if path is None:
            raise ConfigError(f"from_pretrained({cls_or_path.__name__}, ...): pass "
                              f"pretrained_model_name_or_path=<local checkpoint directory>")
        return cls_or_path, os.fspath(path)
    raise ConfigError(f"from_pretrained: the first argument is a transformers model class or "
                      f"a local directory, not {type(cls_or_path).__name__}")


def _model_class(cls, hf_config):
    """The concrete class: *cls*, or (an auto class or none given) the architecture named
    in config.json, else what AutoModelForCausalLM maps the config to."""
    import transformers
    if cls is not None and not hasattr(cls, "_model_mapping"):
        return cls
    mapping = getattr(cls, "_model_mapping", None)
    if cls is None:
        for arch in getattr(hf_config, "architectures", None) or ():
            found = getattr(transformers, arch, None)
            if isinstance(found, type):
                return found
        mapping = transformers.AutoModelForCausalLM._model_mapping
    try:
        return mapping[type(hf_config)]
    except KeyError:
        raise ConfigError(f"from_pretrained: no model class for {type(hf_config).__name__} "
                          f"(model_type {getattr(hf_config, 'model_type', None)!r}); pass the "
                          f"transformers class as the first argument") from None


def _dtype(requested, hf_config, files: CheckpointFiles) -> torch.dtype:
    """HF's ``dtype="auto"`` (its default): config.json's dtype, else the checkpoint's first
    floating tensor's, else torch's default; or the dtype asked for."""
    if requested is None or requested == "auto":
        requested = getattr(hf_config, "dtype", None)
        if requested is None:
            for name in files.where:
                dtype, _ = files.spec(name)
                if dtype.is_floating_point:
                    return dtype
            return torch.get_default_dtype()
    if isinstance(requested, str):
        requested = getattr(torch, requested, None)
    if not isinstance(requested, torch.dtype) or not requested.is_floating_point:
        raise ConfigError("from_pretrained(dtype=...): pass 'auto', a floating torch.dtype or "
                          "its name (e.g. 'bfloat16')")
    return requested


def _zero_config(config) -> Config:
    if config is None:
        raise ConfigError("from_pretrained(config=...): pass the zero-core config (dict or JSON "
                          "path) you will give zero_core.initialize; the stage decides how the "
                          "model is built")
    return config if isinstance(config, Config) else parse_config(config, discover().world_size)


# ---- from_pretrained -------------------------------------------------------------------------
def from_pretrained(cls_or_name_or_path, config=None, **model_kwargs):
    """Build a transformers model and load a local safetensors checkpoint into it; ready
    for ``zero_core.initialize(model=model, config=config)``. See the module docstring.

    *cls_or_name_or_path*: a transformers model class (with
    ``pretrained_model_name_or_path=``) or a local directory. *config*: the zero-core
    config. Keyword arguments as transformers': ``dtype`` (default ``"auto"``),
    ``attn_implementation``, ``hf_config`` (a config object instead of config.json), and
    the rest updates the HF config or goes to the model's constructor.
    """
    import transformers
    cfg = _zero_config(config)
    kwargs = dict(model_kwargs)
    cls, path = _resolve(cls_or_name_or_path, kwargs)
    requested_dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
    attn = kwargs.pop("attn_implementation", None)
    hf_config = kwargs.pop("hf_config", None)
    if not os.path.isdir(path):
        raise PretrainedError(f"{path} is not a local directory: from_pretrained reads local "
                              f"checkpoints only (fetch the model first, e.g. "
                              f"`hf download <repo> --local-dir DIR`)")
    if hf_config is None:
        if not os.path.exists(os.path.join(path, "config.json")):
            raise PretrainedError(f"{path} has no config.json: pass the directory a Hugging "
                                  f"Face save_pretrained wrote (or hf_config=)")
        hf_config, kwargs = transformers.AutoConfig.from_pretrained(
            path, return_unused_kwargs=True, **kwargs)
    hf_config = copy.deepcopy(hf_config)
    if attn is not None:
        hf_config._attn_implementation = attn
    if cfg.zero_optimization.stage != 3:
        model = _model_class(cls, hf_config).from_pretrained(
            path, config=hf_config, dtype=requested_dtype or "auto", **kwargs)
        full = sum(_nbytes(t) for t in {id(t): t for t in model.state_dict().values()}.values())
        model.zero_core_load_report = {
            "stage": cfg.zero_optimization.stage, "tensors": len(model.state_dict()),
            "peak_bytes": full, "partition_bytes": full, "full_model_bytes": full,
            "note": "stages 0-2 hold the whole model on every rank: loaded by transformers"}
        if discover().rank == 0:
            _log_report(model.zero_core_load_report)
        return model
    with CheckpointFiles(path) as files:
        return _load_stage3(cls, path, hf_config, cfg, files, requested_dtype, kwargs)


def _load_stage3(cls, path, hf_config, cfg, files, requested_dtype, kwargs):
    import transformers
    from transformers import initialization as hf_init
    from transformers.modeling_utils import local_torch_dtype
    from transformers.monkey_patching import patch_output_recorders
    import zero_core
    dtype = _dtype(requested_dtype, hf_config, files)
    hf_config.dtype = dtype
    hf_config.name_or_path = path
    model_cls = _model_class(cls, hf_config)
    with contextlib.ExitStack() as stack:
        stack.enter_context(local_torch_dtype(dtype, model_cls.__name__))
        stack.enter_context(hf_init.no_tie_weights())
        stack.enter_context(hf_init.no_init_weights())
        stack.enter_context(_ZeroFilledEmpty())
        init = stack.enter_context(zero_core.Init(config=cfg))
        model = model_cls(hf_config, **kwargs)
        patch_output_recorders(model)
    comm = init.comm
    ledger = LoadLedger()
    expected = model.state_dict(keep_vars=True)
    for t in {id(t): t for t in expected.values()}.values():
        if pp.is_partitioned(t):
            ledger.hold("partitions", _nbytes(pp.meta_of(t).own_part))
        else:
            ledger.hold("replicated", _nbytes(t))
    targets = _map_checkpoint_keys(model, files, expected)
    _check_shapes(targets, files, expected, path)
    loaded = set()
    for key, name in targets.items():
        _read_into(files, name, expected[key], comm.rank, ledger)
        expected[key]._is_hf_initialized = True
        loaded.add(key)
    unexpected = {n for n in files.where if n not in set(targets.values())}
    info = _finalize(model, files, targets, expected, loaded, unexpected, path)
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()
    full = sum(pp.meta_of(t).numel * pp.meta_of(t).dtype.itemsize if pp.is_partitioned(t)
               else _nbytes(t) for t in unique)
    partition = sum(_nbytes(pp.meta_of(p).own_part) for p in model.parameters()
                    if pp.is_partitioned(p))
    report = {"stage": 3, "rank": comm.rank, "world_size": comm.world_size,
              "tensors": len(loaded), "peak_bytes": ledger.peak,
              "partition_bytes": partition, "full_model_bytes": full,
              "held_bytes": dict(ledger.held), "missing_keys": sorted(info.missing_keys),
              "unexpected_keys": sorted(info.unexpected_keys)}
    model.zero_core_load_report = report
    if comm.rank == 0:
        _log_report(report)
    model.eval()
    gen_path = os.path.join(path, "generation_config.json")
    if model.can_generate() and os.path.exists(gen_path):
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    return model


def _log_report(report: dict) -> None:
    line = (f"zero-core from_pretrained: loaded {report['tensors']} tensors, peak "
            f"{report['peak_bytes'] / _MIB:.2f} MiB per rank vs partition "
            f"{report['partition_bytes'] / _MIB:.2f} MiB, full model "
            f"{report['full_model_bytes'] / _MIB:.2f} MiB")
    log.info(line)
    print(line, flush=True)


# ---- loading ------------------------------------------------------------------------------------
def _map_checkpoint_keys(model, files: CheckpointFiles, expected: dict) -> dict[str, str]:
    """``{model key: checkpoint name}``, renaming checkpoint names by transformers' rules
    (legacy names, base-model prefix added or removed) where they are not model keys."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, apply_converters, rename_source_key
    conversions = get_model_conversion_mapping(model) or []
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None) or None
    out: dict[str, str] = {}
    for name in files.where:
        key = name
        if key not in expected:
            if converters and apply_converters(name, converters)[1] is not None:
                raise PretrainedError(
                    f"checkpoint tensor {name!r} needs transformers' weight conversion "
                    f"({type(model).__name__} fuses or splits tensors on load), which cannot "
                    f"be read slice by slice; load it with transformers and save it again")
            key, _ = rename_source_key(name, renamings, [], prefix, expected)
        if key in expected:
            if key in out:
                raise PretrainedError(f"checkpoint tensors {out[key]!r} and {name!r} both "
                                      f"map to the model's {key!r}: the checkpoint is ambiguous")
            out[key] = name
    # as transformers records them: the renamings that matched, reverted on save (which
    # also orders a loaded model's keys by their natural sort, pretrained.py)
    model._weight_conversions = [c for c in renamings if c.was_used()]
    return out


def _check_shapes(targets, files, expected, path) -> None:
    bad = []
    for key, name in targets.items():
        _, shape = files.spec(name)
        if tuple(shape) != tuple(expected[key].shape):
            bad.append(f"{name}: checkpoint {list(shape)}, model {list(expected[key].shape)}")
    if bad:
        raise PretrainedError(f"{path}: {len(bad)} tensor(s) have another shape than the "
                              f"model's ({'; '.join(bad[:4])}{' …' if len(bad) > 4 else ''}): "
                              f"the config.json does not describe this checkpoint, or the wrong "
                              f"model class was used")


def _read_into(files: CheckpointFiles, name: str, t: torch.Tensor, rank: int,
               ledger: LoadLedger) -> None:
    """Read this rank's slice of checkpoint tensor *name* into partitioned parameter *t*
    (or all of it into a replicated tensor)."""
    reader = files.reader(files.where[name])
    stored, _ = reader.spec(name)
    if pp.is_partitioned(t):
        meta = pp.meta_of(t)
        dst_all = meta.own_part
        shard = dst_all.numel()
        lo, hi = rank * shard, min(rank * shard + shard, meta.numel)
    else:
        dst_all = t.data.reshape(-1)
        lo, hi = 0, t.numel()
    direct = (dst_all.dtype == stored and dst_all.device.type == "cpu" and stored != torch.bool
              and dst_all.is_contiguous())
    with torch.no_grad():
        for start in range(lo, hi, CHUNK):
            n = min(CHUNK, hi - start)
            dst = dst_all.narrow(0, start - lo, n)
            if direct:
                reader.read_into(name, start, dst)
                continue
            staged = reader.read(name, start, n)
            ledger.hold("staging", _nbytes(staged))
            dst.copy_(staged)
            ledger.drop("staging", _nbytes(staged))
            del staged


def _same_values(files: CheckpointFiles, a: str, b: str) -> bool:
    """Whether checkpoint tensors *a* and *b* hold equal values (read chunk by chunk)."""
    ra, rb = files.reader(files.where[a]), files.reader(files.where[b])
    (_, sa), (_, sb) = ra.spec(a), rb.spec(b)
    if tuple(sa) != tuple(sb):
        return False
    numel = 1
    for s in sa:
        numel *= s
    for start in range(0, numel, CHUNK):
        n = min(CHUNK, numel - start)
        wide_a = ra.read(a, start, n).to(torch.float64)
        if not torch.equal(wide_a, rb.read(b, start, n).to(torch.float64)):
            return False
    return True


def _finalize(model, files, targets, expected, loaded, unexpected, path):
    """transformers' post-load steps on a partitioned model (see the module docstring)."""
    from transformers.utils.loading_report import LoadStateDictInfo, log_state_dict_report
    import zero_core
    missing = set(expected) - loaded
    # parameters registered under several names (module sharing) are loaded once
    loaded_ids = {id(expected[k]) for k in loaded}
    missing = {k for k in missing if id(expected[k]) not in loaded_ids}
    info = LoadStateDictInfo(missing_keys=missing, unexpected_keys=set(unexpected),
                             mismatched_keys=set(), error_msgs=[], conversion_errors={},
                             skipped_pp_keys=set())
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    pretend_missing = set()
    for target, source in list(tied.items()):
        if target in loaded and source in loaded:
            if _same_values(files, targets[target], targets[source]):
                pretend_missing.add(target)   # tie as if only the source were there
            else:
                log.warning("%s: %s and %s are tied by the config but the checkpoint holds "
                            "different values: not tied (set tie_word_embeddings=False to "
                            "silence this)", path, target, source)
                tied.pop(target)
    model.mark_tied_weights_as_initialized(info)
    pending = list({id(t): t for t in model.state_dict(keep_vars=True).values()
                    if not getattr(t, "_is_hf_initialized", False)}.values())
    if pending:
        with zero_core.GatheredParameters([t for t in pending if pp.is_partitioned(t)],
                                          modifier_rank=0):
            model.initialize_weights()
    biases = [getattr(_module_of(model, target), "bias", None) for target in tied]
    biases = [b for b in biases if b is not None and pp.is_partitioned(b)]
    info.missing_keys |= pretend_missing
    with zero_core.GatheredParameters(biases, modifier_rank=0):   # _adjust_bias reads them
        model.tie_weights(missing_keys=info.missing_keys, recompute_mapping=False)
    model._adjust_missing_and_unexpected_keys(info)
    if _is_rank0():
        log_state_dict_report(model=model, pretrained_model_name_or_path=path,
                              ignore_mismatched_sizes=False, loading_info=info,
                              logger=logging.getLogger("transformers.modeling_utils"))
    return info


def _module_of(model, key: str):
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    try:
        return model.get_submodule(parent)
    except AttributeError:
        return None


def _is_rank0() -> bool:
    from zero_core.runtime.context import get_runtime
    return get_runtime().comm.rank == 0
