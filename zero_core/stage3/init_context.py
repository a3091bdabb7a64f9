"""``zero_core.Init`` (build a model already partitioned) and ``zero_core.GatheredParameters``
(gather full parameters for reading or modification).

Init
----
``with zero_core.Init(config=cfg): model = Model()`` partitions every parameter as soon as
the module that creates it has finished its ``__init__``: each rank keeps its 1/N slice of
the parameter's values (padded to world_size × alignment) and the parameter's ``.data``
becomes an empty tensor. Peak memory while building is therefore about 1/N of the model
plus the module being built. Inside the context, ``__init__`` of every ``nn.Module`` class
is wrapped (classes defined inside the context too); outside, nothing is patched.

Code that touches already-partitioned parameters during construction — typically a
parent's ``self.apply(init_weights)`` calling ``nn.init.normal_`` on its children's
weights — runs on the full values: the parameter is gathered, the function runs on every
rank (the same RNG draws as without Init, since every rank runs the same code with the
same seed), and each rank keeps its slice of the result. One all-gather per such call.

When the context exits, one all-reduce compares checksums of every parameter it
partitioned across ranks, and a difference (a missing ``torch.manual_seed``) is an error
naming the parameter, as ``initialize`` does for models built without Init.

Where and in what dtype (DeepSpeed's arguments): ``remote_device`` puts the partitions in
host memory (``"cpu"``, pinned with ``pin_memory``) or in one mapped file each under
``offload_param.nvme_path`` (``"nvme"``) instead of on the accelerator's device; the
config's ``offload_param.device`` overrides it when set, as in DeepSpeed. ``initialize``
then moves them where the config says. ``dtype`` is the dtype parameters are created in
(the default dtype inside the context) and partitioned in: fp32 or the config's compute
dtype. ``dtype=None`` keeps the dtype the model creates — DeepSpeed casts to the config's
precision there; zero-core keeps the exact values, which its engine's fp32 master uses.

At stages 0-2 (or ``enabled=False``) Init does nothing.

GatheredParameters
------------------
``with zero_core.GatheredParameters(params, modifier_rank=None):`` gathers full values of
the partitioned parameters among *params* on every rank. With ``modifier_rank=r``, on
exit rank r's values (which the block may have modified) are broadcast and every rank
keeps its slice (the fp32 master copy is updated too). With ``modifier_rank=None`` the
values are only read; if the block runs between a training forward (autograd on) and its
``engine.backward``, and a parameter requires grad, the parameters stay gathered until
that backward ends, so a loss term computed from them (a parameter used outside any
module's forward) gets its gradient. A no-op for parameters
that are not partitioned (stages 0-2).
"""
from __future__ import annotations

import functools
import threading
import warnings

import torch

from zero_core.config import Config, parse_config
from zero_core.config.schema import ZeroConfig
from zero_core.config.precision import torch_dtype
from zero_core.errors import ConfigError, ConfigWarning, ZeroCoreError
from zero_core.runtime.launch import discover
from zero_core.runtime.partition_comm import build_sharding
from zero_core.partitioning.layout import alignment_for, round_up
from zero_core.stage3 import partitioned_params as pp

_LOCK = threading.RLock()
_ACTIVE: list["Init"] = []          # nested Init contexts; the innermost partitions
_WRAPPED: dict[type, object] = {}   # class -> its original __init__
_SUBCLASS_HOOK_INSTALLED = [False]


# ---------------------------------------------------------------------------------------------
# Per-parameter partitions (before an engine owns the parameter).
# ---------------------------------------------------------------------------------------------

def partition_own(p: torch.nn.Parameter, name: str, comm,
                  device: torch.device | None = None, dtype: torch.dtype | None = None,
                  allocate=None) -> pp.ParamMeta:
    """Keep only this rank's slice of *p*'s values over *comm*'s ranks (padded to
    world_size × alignment; the stages' partition communicator, runtime/partition_comm.py), on
    *device* (default: where *p* was built), in *dtype* (default: *p*'s; a floating
    parameter is cast, rounding as a copy does). *allocate(numel, dtype)*, when given,
    makes the zeroed host tensor instead (Init's remote_device: pinned memory, a file).
    *p* becomes a released PartitionedParameter."""
    rank, world_size = comm.rank, comm.world_size
    values = p.data.detach().reshape(-1)
    meta = pp.mark_partitioned(p, name)
    if dtype is not None and values.is_floating_point():
        meta.extra["init_dtype"] = dtype   # the engine checks it against its compute dtype
    else:
        dtype = values.dtype
    elem = torch.empty((), dtype=dtype).element_size()
    padded = round_up(meta.numel, world_size * alignment_for(elem))
    shard = padded // world_size
    if allocate is not None:
        part = allocate(shard, dtype)
    else:
        part = torch.zeros(shard, dtype=dtype, device=device or values.device)
    lo = rank * shard
    hi = min(lo + shard, meta.numel)
    if lo < hi:
        part[:hi - lo].copy_(values[lo:hi])
    meta.own_part, meta.own_padded, meta.own_comm = part, padded, comm
    meta.owner = _INIT_OWNER
    meta.dtype = dtype
    pp.release(p, dtype=dtype)
    return meta


def gather_own(p) -> torch.Tensor:
    """The padded flat full values of a parameter partitioned by :func:`partition_own`
    (collective over the ranks it was partitioned over: each calls it for the parameter)."""
    meta = pp.meta_of(p)
    comm = meta.own_comm
    full = torch.empty(meta.own_padded, dtype=meta.own_part.dtype, device=meta.own_part.device)
    if comm.world_size == 1:
        full.copy_(meta.own_part)
    else:
        comm.all_gather_into(full, meta.own_part)
    return full


def _write_back_own(p, full: torch.Tensor) -> None:
    meta = pp.meta_of(p)
    shard = meta.own_part.numel()
    meta.own_part.copy_(full.narrow(0, meta.own_comm.rank * shard, shard))


def _checksum(x: torch.Tensor) -> torch.Tensor:
    """Sum, sum of squares and a strided sum of *x*, in its own dtype (a float64 sum would
    make a full-size float64 copy and raise the construction peak). Equal values give equal
    sums on every rank (same ops, same order); the strided sum catches most permutations."""
    x = x.detach().reshape(-1)
    if not x.is_floating_point():
        x = x.double()
    return torch.stack([x.sum(), x.dot(x), x[::7].sum()]).double()


# ---------------------------------------------------------------------------------------------
# Init
# ---------------------------------------------------------------------------------------------

def _subclasses(cls):
    seen, stack = [], [cls]
    while stack:
        c = stack.pop()
        seen.append(c)
        stack.extend(s for s in c.__subclasses__() if s not in seen)
    return seen


def _wrap_class(cls) -> None:
    orig = cls.__dict__.get("__init__")
    if orig is None or cls in _WRAPPED:
        return

    @functools.wraps(orig)
    def init(self, *args, **kwargs):
        ctx = _ACTIVE[-1] if _ACTIVE else None
        if ctx is None:
            return orig(self, *args, **kwargs)
        depth = self.__dict__.get("_zero_core_init_depth", 0)
        self.__dict__["_zero_core_init_depth"] = depth + 1
        try:
            orig(self, *args, **kwargs)
        finally:
            self.__dict__["_zero_core_init_depth"] = depth
        if depth == 0:
            del self.__dict__["_zero_core_init_depth"]
            ctx.partition_module(self)

    _WRAPPED[cls] = orig
    cls.__init__ = init


def _on_subclass(cls, **kwargs):
    super(torch.nn.Module, cls).__init_subclass__(**kwargs)
    if _ACTIVE:
        _wrap_class(cls)


def _install() -> None:
    for cls in _subclasses(torch.nn.Module):
        _wrap_class(cls)
    if "__init_subclass__" not in torch.nn.Module.__dict__:
        torch.nn.Module.__init_subclass__ = classmethod(_on_subclass)
        _SUBCLASS_HOOK_INSTALLED[0] = True


def _uninstall() -> None:
    for cls, orig in _WRAPPED.items():
        cls.__init__ = orig
    _WRAPPED.clear()
    if _SUBCLASS_HOOK_INSTALLED[0]:
        del torch.nn.Module.__init_subclass__
        _SUBCLASS_HOOK_INSTALLED[0] = False


class _InitOwner:
    """The owner (``ParamMeta.owner``, partitioned_params.py) of the parameters Init
    partitioned, until an engine adopts them: while an Init context is open, a function
    that reads them runs on their full values (:func:`_materialize`); after, it is the
    plain error."""

    @staticmethod
    def read_released(func, args, kwargs, released):
        if _ACTIVE:
            return _materialize(func, args, kwargs, released)
        raise pp.not_gathered_error(released[0], func)

    @staticmethod
    def running_module() -> None:
        return None


_INIT_OWNER = _InitOwner()


def _materialize(func, args, kwargs, released):
    """Init is building: run *func* on the full values of the released parameters."""
    ctx = _ACTIVE[-1]
    for p in released:
        if pp.meta_of(p).own_part is None:
            raise pp.not_gathered_error(p, func)
    fulls = []
    for p in released:
        full = gather_own(p)
        fulls.append(full)
        pp.attach(p, full.narrow(0, 0, pp.meta_of(p).numel))
    try:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    finally:
        for p, full in zip(released, fulls):
            _write_back_own(p, full)
            pp.release(p)


#: the dtypes Init may create and partition parameters in (DeepSpeed's list)
INIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _remote_device(remote_device, pin_memory, cfg) -> tuple[str | None, bool]:
    """Where Init puts the partitions, as DeepSpeed decides it: the config's
    ``offload_param.device`` when it offloads parameters (the argument is then overridden,
    as in DeepSpeed, with a warning when it says otherwise), else *remote_device*; None: the
    accelerator's device. ``"nvme"`` needs ``offload_param.device: nvme`` in the config.
    ``"cpu"``: host memory (pinned with *pin_memory* or ``offload_param.pin_memory``);
    ``"nvme"``: a file per partition under ``offload_param.nvme_path``, mapped into host
    memory (offload/params.py, FileBackedPartitions). ``initialize`` then puts them where
    the config says (its own swap files; the device when the config has no offload_param)."""
    if remote_device not in (None, "none", "cpu", "nvme"):
        raise ConfigError(f"zero_core.Init(remote_device={remote_device!r}): use None (the "
                          f"accelerator's device), 'cpu' or 'nvme'")
    if remote_device == "none":
        remote_device = None
    offload = cfg.zero_optimization.offload_param if cfg is not None else None
    if offload is not None and offload.enabled:
        if remote_device is not None and remote_device != offload.device:
            warnings.warn(
                f"zero_core.Init(remote_device={remote_device!r}) is overridden by the config's "
                f"zero_optimization.offload_param.device = {offload.device!r}, as DeepSpeed does; "
                f"pass remote_device=None or make them agree", ConfigWarning, stacklevel=3)
        return offload.device, bool(pin_memory or offload.pin_memory)
    if remote_device == "nvme":
        raise ConfigError(
            "zero_core.Init(remote_device='nvme') needs zero_optimization.offload_param with "
            "device 'nvme' and an nvme_path in the config (as DeepSpeed requires): pass "
            "config=... with it, or use remote_device='cpu'")
    return remote_device, bool(pin_memory) and remote_device is not None


def _init_dtype(dtype, cfg) -> torch.dtype | None:
    """*dtype* checked: one of INIT_DTYPES and, with a config, fp32 or the config's compute
    dtype (values created in another 16-bit format would be rounded twice, or trained in a
    precision the config does not ask for)."""
    if dtype is None:
        return None
    if dtype not in INIT_DTYPES:
        raise ConfigError(f"zero_core.Init(dtype={dtype!r}): use torch.float32, torch.bfloat16 "
                          f"or torch.float16 (or None: the dtype the model creates)")
    if cfg is not None and dtype != torch.float32:
        compute = torch_dtype(cfg.precision)
        if dtype != compute:
            raise ConfigError(
                f"zero_core.Init(dtype={dtype}) with a config that trains in {compute}: the "
                f"parameters would be rounded to {dtype} and then trained in {compute}. Pass "
                f"dtype={compute} (the compute dtype), torch.float32 (exact), or None")
    return dtype


class Init:
    """Context manager that builds models already partitioned for ZeRO stage 3 (see the
    module docstring). *config*: the training config (dict, JSON path or Config; also
    accepted as *config_dict_or_path*); with ``enabled=False`` or a stage below 3 it does
    nothing. *module*: partition an already-built module right away instead."""

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group=None,
                 mem_efficient_linear: bool = True, remote_device=None, pin_memory: bool = False,
                 config_dict_or_path=None, config=None, enabled: bool = True, dtype=None,
                 mpu=None):
        if data_parallel_group is not None or mpu is not None:
            raise ConfigError("zero_core.Init: data_parallel_group/mpu are not supported (zero-core "
                              "partitions over all ranks); pass None")
        cfg = config if config is not None else config_dict_or_path
        if cfg is not None and not isinstance(cfg, Config):
            cfg = parse_config(cfg, discover().world_size)
        stage = cfg.zero_optimization.stage if cfg is not None else 3
        self.enabled = bool(enabled) and stage == 3
        self.config = cfg
        self.remote_device, self.pin_memory = _remote_device(remote_device, pin_memory, cfg)
        self.dtype = _init_dtype(dtype, cfg)
        self.comm = self.partition_comm = None
        self.device = None
        self._allocate = None
        self._default_dtype = None
        self._checks: list[tuple] = []   # (parameter, name, checksums)
        self._outermost = None
        if module is not None and self.enabled:
            with self:
                self.partition_module(module)

    def _runtime(self):
        from zero_core.runtime.context import init_distributed
        cfg = self.config
        if cfg is None:
            return init_distributed()
        return init_distributed(cfg.accelerator, cfg.comm_backend, cfg.comm_timeout,
                                cfg.topology.ranks_per_node)

    def __enter__(self):
        if not self.enabled:
            return self
        runtime = self._runtime()
        self.comm, self.device = runtime.comm, runtime.device
        # the ranks the engine will partition over (all, or MiCS's shard group); the
        # engine reads each parameter's own partition through meta.own_comm
        zc = self.config.zero_optimization if self.config is not None else ZeroConfig(stage=3)
        self.partition_comm = build_sharding(runtime.comm, zc, 3,
                                             uses_qgz=zc.zero_quantized_gradients).comm
        if self.remote_device is not None:   # the partitions go to host memory or files
            self.device = torch.device("cpu")
            self._allocate = self._host_allocator(runtime)
        with _LOCK:
            if not _ACTIVE:
                _install()
            _ACTIVE.append(self)
            if self.dtype is not None:   # modules create their floating tensors in dtype
                self._default_dtype = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.enabled:
            return False
        with _LOCK:
            _ACTIVE.remove(self)
            if self._default_dtype is not None:
                torch.set_default_dtype(self._default_dtype)
                self._default_dtype = None
            if not _ACTIVE:
                _uninstall()
        if exc_type is None:
            self._verify()
        return False

    def partition_module(self, module: torch.nn.Module) -> None:
        """Partition every parameter of *module* (recursively) not partitioned yet."""
        self._outermost = module  # the last module finished holds all earlier ones
        for name, p in module.named_parameters():
            if pp.is_partitioned(p):
                continue
            self._checks.append((p, f"{type(module).__name__}.{name}", _checksum(p.data)))
            # modules are built on the host one at a time; only partitions stay, on the
            # device (or in host memory: remote_device)
            partition_own(p, name, self.partition_comm, self.device, self.dtype,
                          self._allocate)

    def _host_allocator(self, runtime):
        """remote_device: "nvme" — each partition a file in this rank's swap directory
        (offload/params.py, FileBackedPartitions); "cpu" — host memory, pinned with
        pin_memory; else None (plain host memory)."""
        if self.remote_device == "nvme":
            from zero_core.offload.params import FileBackedPartitions
            return FileBackedPartitions(self.config.zero_optimization.offload_param.nvme_path,
                                        runtime.comm.rank)
        if self.pin_memory:
            pin = runtime.accelerator.pin_memory
            return lambda numel, dtype: pin(torch.zeros(numel, dtype=dtype))
        return None

    def _verify(self) -> None:
        """Every rank must have built the same values (one all-reduce)."""
        if not self._checks or self.comm.world_size == 1:
            return
        sums = torch.stack([c for _, _, c in self._checks])
        both = torch.cat([sums, -sums]).contiguous()
        self.comm.all_reduce(both, "max")
        n = len(self._checks)
        differs = (both[:n] != -both[n:]).any(dim=1)
        qualified = {id(p): n for n, p in self._outermost.named_parameters()}
        names = [qualified.get(id(p), fallback) for p, fallback, _ in self._checks]
        self._checks = []
        if bool(differs.any()):
            first = int(differs.nonzero()[0, 0])
            raise ZeroCoreError(
                f"zero_core.Init: parameter '{names[first]}' was built with different values on different ranks ({int(differs.sum())} "
                f"parameters differ). Every rank must build the same model: call "
                f"torch.manual_seed(<same seed>) before constructing it.")


# ---------------------------------------------------------------------------------------------
# GatheredParameters
# ---------------------------------------------------------------------------------------------

def _adopt_assigned_data(params, full: torch.Tensor, offsets) -> None:
    """If the block replaced ``p.data`` (instead of modifying it in place), copy the new
    values into the gathered buffer and point the parameter back at it."""
    elem = full.element_size()
    for p, off in zip(params, offsets):
        meta = pp.meta_of(p)
        if p.data.data_ptr() != full.data_ptr() + off * elem or p.data.numel() != meta.numel:
            view = full.narrow(0, off, meta.numel)
            view.copy_(p.data.reshape(-1).to(full.dtype))
            pp.attach(p, view)


class GatheredParameters:
    """Gather the full values of *params* (one parameter or an iterable) for the block;
    see the module docstring. *fwd_module* is accepted for DeepSpeed compatibility
    (register_external_parameter is zero-core's way to declare external use)."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None,
                 enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        params = [] if params is None else list(params)
        self.params = [p for p in params if pp.is_partitioned(p)] if enabled else []
        self.modifier_rank = modifier_rank
        self._units: list = []
        self._own: list = []

    def __enter__(self):
        if not self.params:
            return self
        units = []
        for p in self.params:
            meta = pp.meta_of(p)
            if meta.unit is not None:
                if all(meta.unit is not u for u in units):
                    units.append(meta.unit)
            elif all(p is not q for q in self._own):
                self._own.append(p)
        units.sort(key=lambda u: u.index)
        self._units = units
        if units:
            units[0].owner.pin(units)
        if self._own:
            comm = self._comm()
            self._fulls = []
            for p in self._own:
                full = gather_own(p)
                self._fulls.append(full)
                pp.attach(p, full.narrow(0, 0, pp.meta_of(p).numel))
        return self

    def _comm(self):
        from zero_core.runtime.context import get_runtime
        return get_runtime().comm

    def __exit__(self, exc_type, exc, tb):
        if not self.params:
            return False
        comm = self._comm()
        modify = self.modifier_rank is not None
        if modify and not 0 <= self.modifier_rank < comm.world_size:
            raise ConfigError(f"GatheredParameters(modifier_rank={self.modifier_rank}): use a rank "
                              f"in 0..{comm.world_size - 1}, or None to only read")
        if self._units:
            coord = self._units[0].owner
            if modify:
                with torch.no_grad():
                    for u in self._units:
                        _adopt_assigned_data(u.params, u.full, u.offsets)
                        if comm.world_size > 1:
                            comm.broadcast(u.full, src=self.modifier_rank)
                        coord.gatherer.write_back(u)
            # read between a training forward and its backward: the values may be in the
            # loss, so keep them until backward has used them
            keep = (not modify and torch.is_grad_enabled() and coord.awaiting_backward
                    and any(p.requires_grad for p in self.params))
            coord.unpin(self._units, keep_for_backward=keep)
        if self._own:
            with torch.no_grad():
                for p, full in zip(self._own, self._fulls):
                    _adopt_assigned_data([p], full, [0])
                    if modify and comm.world_size > 1:
                        comm.broadcast(full, src=self.modifier_rank)
                    _write_back_own(p, full)
                    pp.release(p)
            self._fulls = []
        return False
