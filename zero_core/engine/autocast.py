"""DeepSpeed's ``torch_autocast`` section: the forward's autocast, and which parameters'
gradients are reduced in the autocast dtype (``lower_precision_safe_modules``).

What DeepSpeed 0.19.8 does, and therefore this module (docs/usage.md, "torch_autocast"):

- **The forward** runs under ``torch.autocast(device, dtype)`` (``dtype`` null: torch's
  default for the device). An autocast the caller opened around ``engine(...)`` is
  overridden by the section's; with the section off, an outer autocast is switched off
  inside the engine (warned once), so the engine's own precision (fp32/bf16) decides.
- **Parameters** keep the dtype of the training mode: fp32 with ``torch_autocast`` alone,
  bf16 with ``bf16.enabled`` too (the model is cast as in plain bf16 training; fp32 master
  weights, or bf16 ones with ``bf16_master_weights_and_grads`` — DeepSpeedExamples'
  ``training/bf16_master_weight`` configs). Autocast then casts per operation.
- **Gradient reduction** at ZeRO stages 1-3: every parameter of a module whose class is
  *exactly* one of ``lower_precision_safe_modules`` (default ``torch.nn.Linear`` and
  ``Conv1d/2d/3d``; subclasses do not count; the module's own parameters, not its
  children's) has its gradient reduced in the autocast dtype; every other parameter in its
  own dtype. ``communication_data_type`` is not consulted there (DeepSpeed ignores it; a
  warning says so). Stage 0 — and stage 1 with bf16 parameters and fp32 gradient
  accumulation, which DeepSpeed hands to its BF16_Optimizer — reduce everything in
  ``communication_data_type`` (default: the compute dtype), as DeepSpeed's engine does.

The choice is written on each trainable parameter (:data:`COMM_DTYPE_ATTR`) when the engine
is built (:func:`mark_comm_dtypes`), and the gradient reducers read it
(:func:`param_comm_dtype`); a bucket or fetch unit whose parameters differ is reduced as
one collective per dtype (:class:`MixedReduction`).

Not done: DeepSpeed's stage 3 also all-gathers non-persistent safe parameters in the
autocast dtype (and widens them back); here they are gathered in their own dtype. Under
autocast, Linear/ConvNd round those weights to the same dtype anyway, so their forward is
the same; a custom safe class whose operations autocast does not cast (e.g. LayerNorm)
computes with unrounded weights here.
"""
from __future__ import annotations

import contextlib
import importlib
import logging

import torch

from zero_core.config.precision import comm_dtype_for, dtype_name, torch_dtype
from zero_core.errors import ConfigError

log = logging.getLogger("zero_core.engine")

#: DeepSpeed's default lower_precision_safe_modules
DEFAULT_SAFE_MODULES = ("torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d",
                        "torch.nn.Conv3d")
#: the attribute on a parameter naming the dtype its gradient is reduced in
COMM_DTYPE_ATTR = "_zero_core_comm_dtype"

_warned_outer = False


def autocast_dtype(config, device: torch.device) -> torch.dtype | None:
    """The dtype the forward autocasts to (None: ``torch_autocast`` is off)."""
    ac = config.torch_autocast
    if not ac.enabled:
        return None
    return torch_dtype(ac.dtype) or torch.get_autocast_dtype(device.type)


def autocast_context(config, device: torch.device):
    """The context ``engine.forward`` runs the model in (see the module docstring)."""
    global _warned_outer
    dtype = autocast_dtype(config, device)
    if dtype is not None:
        return torch.autocast(device_type=device.type, dtype=dtype)
    try:
        outer = torch.is_autocast_enabled(device.type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return contextlib.nullcontext()
    if not outer:
        return contextlib.nullcontext()
    if not _warned_outer:
        _warned_outer = True
        log.warning("zero-core: torch.autocast is enabled around the engine but the config's "
                    "torch_autocast section is off: the engine runs the model without "
                    "autocast (as DeepSpeed does); enable torch_autocast to autocast it")
    return torch.autocast(device_type=device.type, enabled=False)


def safe_module_classes(paths) -> tuple[type, ...]:
    """The classes of *paths* (``"package.module.Class"``), imported; None: the default."""
    classes = []
    for path in DEFAULT_SAFE_MODULES if paths is None else paths:
        package, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(package), name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(
                f"torch_autocast.lower_precision_safe_modules: cannot import {path!r} "
                f"({type(exc).__name__}: {exc}); give the full import path of a module "
                f"class, e.g. \"torch.nn.Linear\" or \"my_package.layers.MyLinear\"") from None
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise ConfigError(f"torch_autocast.lower_precision_safe_modules: {path!r} is not a "
                              f"torch.nn.Module class; list module classes only")
        classes.append(cls)
    return tuple(classes)


def per_param_rule_applies(config) -> bool:
    """Whether gradients are reduced per parameter (stages 1-3 under torch_autocast, except
    stage 1 with bf16 parameters and fp32 accumulation: see the module docstring)."""
    if not config.torch_autocast.enabled or config.zero_optimization.stage == 0:
        return False
    stage1_bf16_fp32 = (config.zero_optimization.stage == 1 and config.precision == "bf16"
                        and config.grad_accum_dtype_name == "fp32")
    return not stage1_bf16_fp32


def mark_comm_dtypes(model: torch.nn.Module, config, device: torch.device) -> None:
    """Write on every parameter of *model* the dtype its gradient is reduced in, or clear
    it where ``communication_data_type`` decides (a model may be given to several engines)."""
    for p in model.parameters():
        if hasattr(p, COMM_DTYPE_ATTR):
            delattr(p, COMM_DTYPE_ATTR)
    dtype = autocast_dtype(config, device)
    if dtype is None:
        return
    if config.precision == "bf16" and dtype != torch.bfloat16:
        raise ConfigError(
            f"torch_autocast.dtype is null, and torch's autocast default on {device.type} is "
            f"{dtype_name(dtype)}: with bf16.enabled the bf16 parameters would be cast to "
            f"{dtype_name(dtype)} per operation (DeepSpeed would need a GradScaler). Set "
            f"torch_autocast.dtype to \"bf16\"")
    zc = config.zero_optimization
    if zc.stage == 3 and zc.zero_quantized_weights:
        raise ConfigError("torch_autocast.enabled with zero_optimization.zero_quantized_weights "
                          "(ZeRO++ qwZ): DeepSpeed refuses the pair too; turn one of them off")
    classes = safe_module_classes(config.torch_autocast.lower_precision_safe_modules)
    if not per_param_rule_applies(config):
        if config.torch_autocast.lower_precision_safe_modules is not None:
            log.warning("zero-core: torch_autocast.lower_precision_safe_modules has no effect "
                        "at ZeRO stage %d%s: every gradient is reduced in "
                        "communication_data_type (as in DeepSpeed)", zc.stage,
                        "" if zc.stage == 0 else " with bf16 and fp32 gradient accumulation")
        return
    if config.communication_data_type is not None:
        log.warning("zero-core: communication_data_type %r has no effect with torch_autocast at "
                    "ZeRO stage %d: gradients of lower_precision_safe_modules are reduced in "
                    "%s, the others in their parameters' dtype (as in DeepSpeed)",
                    config.communication_data_type, zc.stage, dtype_name(dtype))
    safe = set()
    for module in model.modules():
        if type(module) in classes:
            safe.update(id(p) for p in module.parameters(recurse=False))
    for p in model.parameters():
        if p.requires_grad:
            setattr(p, COMM_DTYPE_ATTR, dtype if id(p) in safe else config.compute_dtype)


def reducer_dtype(params, configured: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype a reducer's own buffers use: *compute* when *params* carry marks (the rule
    above decides per parameter, ``communication_data_type`` is out), else *configured*."""
    return compute if any(hasattr(p, COMM_DTYPE_ATTR) for p in params) else configured


def param_comm_dtype(p: torch.Tensor, default: torch.dtype) -> torch.dtype:
    """The dtype *p*'s gradient is reduced in: its mark, else *default*."""
    return getattr(p, COMM_DTYPE_ATTR, None) or default


class _Handles:
    """Several collectives' handles as one."""

    def __init__(self, handles):
        self.handles = handles

    def wait(self):
        for h in self.handles:
            h.wait()


class MixedReduction:
    """The reduce-scatter of one flat bucket of ``size`` elements whose runs are reduced in
    different dtypes: *runs* ``[(lo, hi, dtype)]`` cover ``[0, size)``. Per dtype, the
    elements of that dtype in rank r's slice ``[r·S, (r+1)·S)`` (S = size / world_size) are
    packed into chunk r of one buffer, chunks padded with zeros to the longest, and that
    buffer is reduce-scattered; this rank's chunk is then written into its slice."""

    def __init__(self, runs, size: int, world_size: int, rank: int):
        if size % world_size:
            raise ValueError(f"bucket of {size} elements is not split in {world_size} slices")
        shard = size // world_size
        self.rank, self.world_size, self.shard = rank, world_size, shard
        pieces: dict[torch.dtype, list[list[tuple[int, int]]]] = {}
        for lo, hi, dtype in runs:
            per_rank = pieces.setdefault(dtype, [[] for _ in range(world_size)])
            for r in range(lo // shard, min(-(-hi // shard), world_size)):
                a, b = max(lo, r * shard), min(hi, (r + 1) * shard)
                if a < b:
                    per_rank[r].append((a, b - a))
        self.dtypes = sorted(pieces, key=str)  # one order on every rank
        self.pieces = pieces
        self.chunk = {d: max(sum(n for _, n in pr) for pr in pieces[d]) for d in self.dtypes}

    def launch(self, comm, src: torch.Tensor, dst: torch.Tensor, add: bool, take, release):
        """Reduce-scatter *src* (the whole bucket) into *dst* (this rank's slice): copy, or
        add when *add*. *take(dtype, n)* / *release(t)* lend buffers. Returns (handle, done)."""
        handles, outs = [], []
        for d in self.dtypes:
            m = self.chunk[d]
            inp = take(d, m * self.world_size)
            for r, pr in enumerate(self.pieces[d]):
                pos = r * m
                for lo, n in pr:
                    inp.narrow(0, pos, n).copy_(src.narrow(0, lo, n))
                    pos += n
                if pos < (r + 1) * m:
                    inp.narrow(0, pos, (r + 1) * m - pos).zero_()
            out = take(d, m)
            handles.append(comm.reduce_scatter(out, inp, "sum", async_op=True))
            outs.append((d, inp, out))

        def done():
            base = self.rank * self.shard
            for d, inp, out in outs:
                pos = 0
                for lo, n in self.pieces[d][self.rank]:
                    piece = dst.narrow(0, lo - base, n)
                    piece.add_(out.narrow(0, pos, n)) if add else piece.copy_(
                        out.narrow(0, pos, n))
                    pos += n
                release(inp)
                release(out)
        return _Handles(handles), done


class DtypePools:
    """Buffer pools per dtype for :class:`MixedReduction` (zero_core's BufferPool each)."""

    def __init__(self, numel: int, device: torch.device, on_allocate=None, make_room=None):
        from zero_core.partitioning.buffer_pool import BufferPool
        self._make = lambda d: BufferPool(max(numel, 1), d, device, on_allocate)
        self._pools: dict[torch.dtype, object] = {}
        self._of: dict[int, object] = {}
        self.make_room = make_room

    def take(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        pool = self._pools.get(dtype)
        if pool is None:
            pool = self._pools[dtype] = self._make(dtype)
        t = pool.take(n, self.make_room)
        self._of[id(t)] = pool
        return t

    def release(self, t: torch.Tensor) -> None:
        self._of.pop(id(t)).release(t)

    @property
    def allocated(self) -> int:
        return sum(p.allocated for p in self._pools.values())


def mixed_reduction(comm, spans, size: int, default: torch.dtype,
                    rank: int) -> MixedReduction | None:
    """The per-dtype reduce-scatter of a flat bucket of *size* elements whose parameters
    *spans* ``[(lo, n, param)]`` are reduced in several dtypes (the stages' gradient
    reducers ask it per bucket; *rank*: this rank's slice), or None when all take *default*
    (one plain collective does). Each dtype is checked against what *comm* can carry."""
    runs = _bucket_runs(spans, size, default)
    if runs is None:
        return None
    for _, _, dtype in runs:
        comm_dtype_for(comm, dtype, "reduce_scatter")
    return MixedReduction(runs, size, comm.world_size, rank)


def _bucket_runs(spans, size: int, default: torch.dtype):
    """*spans* ``[(lo, n, param)]`` of a flat bucket of *size* elements as runs ``[(lo, hi,
    dtype)]`` covering ``[0, size)`` (gaps and padding take the neighbouring run's dtype), or
    None when every parameter's dtype is *default*."""
    runs = []
    for lo, n, p in sorted(spans, key=lambda s: s[0]):
        d = param_comm_dtype(p, default)
        if runs and runs[-1][2] == d and runs[-1][1] >= lo:
            runs[-1][1] = max(runs[-1][1], lo + n)
        else:
            if runs:
                runs[-1][1] = lo  # close a gap into the previous run
            runs.append([lo, lo + n, d])
    if not runs or all(r[2] == default for r in runs):
        return None
    runs[0][0] = 0
    runs[-1][1] = size
    return [tuple(r) for r in runs]
