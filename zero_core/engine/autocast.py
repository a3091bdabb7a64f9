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

**Stage-3 gathers** (:class:`MixedGather`, used by stage3/gather.py), as DeepSpeed 0.19.8
does (read in ``runtime/zero/partition_parameters.py`` and checked with its own 2-rank runs,
ci/tools/make_autocast_fixture.py):

- its coordinator's fetch (``all_gather_coalesced``) gathers each parameter in
  ``get_allgather_dtype``: the autocast dtype for every parameter of a safe module (frozen
  ones too: the mark is on all of the module's own parameters), else the partition's dtype;
  a fetch mixing both runs one collective per dtype. The wait widens the result back to
  the partition's dtype, so the gathered parameter keeps its dtype (fp32 with
  ``torch_autocast`` alone) with rounded values, and its gradient stays fp32 (reduced in
  the dtype of the rule above). With ``bf16.enabled`` nothing changes (already bf16).
- **persistent** parameters (``stage3_param_persistence_threshold``): fetched that way at
  their first use, but after every optimizer step (``_post_step``) and checkpoint load
  DeepSpeed re-gathers them with ``param.all_gather()``, in the partition's dtype, and keeps
  them. So here: rounded until the persistent unit's first release, exact after it.
- ``param.all_gather()`` (GatheredParameters, state dicts) is exact; here a unit still
  holding a rounded gather is gathered again exactly for them when no forward runs it
  (DeepSpeed hands out the copy it holds).
- one rank: no collective and no rounding (DeepSpeed's ``_no_gather_coalesced``).

**Loss scaling** (:func:`autocast_loss_scaler`): with ``torch_autocast.dtype`` fp16 given
explicitly and fp32 parameters, DeepSpeed 0.19.8 makes a ``torch.amp.GradScaler`` (torch's
defaults) at every stage — the engine's at stage 0, its ZeRO optimizer's at stages 1-3 — and
multiplies the loss by its scale before backward. zero-core gives the engine a scaler with
that rule (optim/loss_scaler.py :class:`GradScalerLossScaler`) where the fp16 section's
would go, so the engine's fp16 machinery does the rest on the device: loss × scale,
gradients × 1/scale before clipping, an inf/NaN step skipped (``engine.skipped_steps``, the
LR schedule holds) and the scale halved, the state in checkpoints. DeepSpeed differs at
stages 1-3 (read in ``stage_1_and_2.py``/``stage3.py`` and seen in its runs,
ci/tools/make_autocast_fixture.py): it clips with the norm of the still-scaled gradients
(its own loss scale is 1) before the GradScaler unscales, and its non-finite norm check
skips an overflowing step before the GradScaler sees it, so the scale never backs off, and
it steps and updates the GradScaler once per parameter group (stage 3: sub-group), so with
several groups its scale grows sooner than every 2000 steps; its stage 0 (the GradScaler on the engine's torch optimizer) backs off as here but does not count
the skipped step. A null dtype gets no scaler there either.

Not done: ZeRO++ gather strategies (hpZ) stay exact.
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
#: the attribute on a parameter naming the dtype stage 3 all-gathers it in for compute
GATHER_DTYPE_ATTR = "_zero_core_gather_dtype"

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


def autocast_loss_scaler(config, device: torch.device):
    """The loss scaler of a ``torch_autocast`` run without ``fp16``: torch's GradScaler rule
    (optim/loss_scaler.py :class:`GradScalerLossScaler`, torch's defaults) when the section
    names fp16 explicitly, as DeepSpeed 0.19.8 creates one then (a null dtype, even where
    torch's default is fp16, gets none there too); else None."""
    ac = config.torch_autocast
    if not ac.enabled or config.fp16.enabled or torch_dtype(ac.dtype) != torch.float16:
        return None
    from zero_core.optim.loss_scaler import GradScalerLossScaler
    return GradScalerLossScaler().to(device)


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
        for attr in (COMM_DTYPE_ATTR, GATHER_DTYPE_ATTR):
            if hasattr(p, attr):
                delattr(p, attr)
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
        if zc.stage == 3 and id(p) in safe:   # frozen ones too (module docstring)
            setattr(p, GATHER_DTYPE_ATTR, dtype)


def reducer_dtype(params, configured: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype a reducer's own buffers use: *compute* when *params* carry marks (the rule
    above decides per parameter, ``communication_data_type`` is out), else *configured*."""
    return compute if any(hasattr(p, COMM_DTYPE_ATTR) for p in params) else configured


def param_comm_dtype(p: torch.Tensor, default: torch.dtype) -> torch.dtype:
    """The dtype *p*'s gradient is reduced in: its mark, else *default*."""
    return getattr(p, COMM_DTYPE_ATTR, None) or default


class _Handles:
    """Several collectives' handles as one (*then*: run once after they completed)."""

    def __init__(self, handles, then=None):
        self.handles, self.then = handles, then

    def wait(self):
        for h in self.handles:
            h.wait()
        if self.then is not None:
            self.then, then = None, self.then
            then()


class MixedReduction:
    """The reduce-scatter of one flat bucket of ``size`` elements whose runs are reduced in
    different dtypes: *runs* ``[(lo, hi, dtype)]`` cover ``[0, size)``. Per dtype, the
    elements of that dtype in rank r's slice ``[r·S, (r+1)·S)`` (S = size / world_size) are
    packed into chunk r of one buffer, chunks padded with zeros to the longest, and that
    buffer is reduce-scattered; this rank's chunk is then written into its slice."""

    def __init__(self, runs, size: int, world_size: int, rank: int):
        if size % world_size:
            raise ValueError(f"bucket of {size} elements is not split in {world_size} slices")
        self.rank, self.world_size, self.shard = rank, world_size, size // world_size
        self.dtypes, self.pieces, self.chunk = _rank_pieces(runs, size, world_size)

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


def _rank_pieces(runs, size: int, world_size: int):
    """Runs ``[(lo, hi, dtype)]`` covering ``[0, size)`` cut at the rank slices (``size /
    world_size`` elements each): ``(dtypes, pieces, chunk)`` with ``pieces[dtype][r]`` the
    ``(lo, n)`` pieces of that dtype in rank r's slice and ``chunk[dtype]`` the most
    elements of that dtype any rank holds (the per-rank chunk of its collective)."""
    shard = size // world_size
    pieces: dict[torch.dtype, list[list[tuple[int, int]]]] = {}
    for lo, hi, dtype in runs:
        per_rank = pieces.setdefault(dtype, [[] for _ in range(world_size)])
        for r in range(lo // shard, min(-(-hi // shard), world_size)):
            a, b = max(lo, r * shard), min(hi, (r + 1) * shard)
            if a < b:
                per_rank[r].append((a, b - a))
    dtypes = sorted(pieces, key=str)  # one order on every rank
    chunk = {d: max(sum(n for _, n in pr) for pr in pieces[d]) for d in dtypes}
    return dtypes, pieces, chunk


class MixedGather:
    """The all-gather of one fetch unit (``size`` padded elements, ``part`` this rank's
    slice) whose runs ``[(lo, hi, dtype)]`` travel in different dtypes: per dtype, the
    elements of that dtype in each rank's slice are packed (cast) into one chunk per rank,
    padded with zeros to the longest, all-gathered, and unpacked (widened back) into the
    unit's flat buffer. See the module docstring for which parameters use it."""

    def __init__(self, runs, size: int, world_size: int, rank: int):
        self.rank, self.world_size, self.shard = rank, world_size, size // world_size
        self.dtypes, self.pieces, self.chunk = _rank_pieces(runs, size, world_size)

    def launch(self, comm, part: torch.Tensor, full: torch.Tensor):
        """Start the collectives from *part* into *full*; the handle's ``wait`` completes
        them and writes *full*."""
        base, outs, handles = self.rank * self.shard, [], []
        for d in self.dtypes:
            m = self.chunk[d]
            send = torch.zeros(m, dtype=d, device=part.device)
            pos = 0
            for lo, n in self.pieces[d][self.rank]:
                send.narrow(0, pos, n).copy_(part.narrow(0, lo - base, n))
                pos += n
            recv = torch.empty(m * self.world_size, dtype=d, device=part.device)
            handles.append(comm.all_gather_into(recv, send, async_op=True))
            outs.append((d, m, recv))

        def unpack():
            for d, m, recv in outs:
                for r, pieces in enumerate(self.pieces[d]):
                    pos = r * m
                    for lo, n in pieces:
                        full.narrow(0, lo, n).copy_(recv.narrow(0, pos, n))
                        pos += n
            outs.clear()
        return _Handles(handles, unpack)


def mixed_gather(comm, spans, size: int, part_dtype: torch.dtype,
                 rank: int) -> MixedGather | None:
    """The gather of a fetch unit of *size* padded elements holding the parameters *spans*
    ``[(lo, n, param)]``, whose partition is in *part_dtype*, when some travel in a lower
    dtype for compute (:data:`GATHER_DTYPE_ATTR`); None when all travel in *part_dtype* (a
    plain all-gather does). Refused by name when *comm* cannot carry the dtype."""
    runs = _bucket_runs(spans, size, part_dtype, GATHER_DTYPE_ATTR)
    if runs is None:
        return None
    for _, _, dtype in runs:
        if not comm.supports("all_gather_into", dtype):
            raise ConfigError(
                f"torch_autocast.lower_precision_safe_modules: stage 3 all-gathers those "
                f"modules' parameters in {dtype_name(dtype)} (as DeepSpeed does), but the "
                f"{comm.name} communicator cannot carry {dtype_name(dtype)}; pick another "
                f"comm_backend or set lower_precision_safe_modules to []")
    return MixedGather(runs, size, comm.world_size, rank)


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


def _bucket_runs(spans, size: int, default: torch.dtype, attr: str = COMM_DTYPE_ATTR):
    """*spans* ``[(lo, n, param)]`` of a flat bucket of *size* elements as runs ``[(lo, hi,
    dtype)]`` covering ``[0, size)`` (gaps and padding take the neighbouring run's dtype), or
    None when every parameter's dtype is *default*."""
    runs = []
    for lo, n, p in sorted(spans, key=lambda s: s[0]):
        d = getattr(p, attr, None) or default
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
