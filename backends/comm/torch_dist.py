"""Communicators over torch.distributed: gloo (CPU), nccl (CUDA), hccl (Gaudi), ccl and
xccl (Intel).

One base class, :class:`TorchDistCommunicator`, maps the zero-core collectives onto
torch.distributed with ``async_op=True`` and wraps the returned ``Work`` objects in a
:class:`~zero_core.interfaces.communicator.Handle`. Subclasses only name the backend, the device
types, the vendor module that registers the backend and how to check for the device.
Starting torch.distributed (the env:// rendezvous, ``init_process_group``) is
:mod:`.torch_dist_init`; :meth:`TorchDistCommunicator.start_torch_distributed` is how the
runtime, which imports no backend, gets it started next to any communicator.

Timeouts: ``Work.wait(timeout)`` on gloo raises ``RuntimeError("Operation timed out!")``
when the deadline passes and leaves the work running (a later wait can still succeed);
a dead peer surfaces as a ``RuntimeError`` from the transport ("Connection reset by
peer" / "Connection closed by peer"). The first maps to ``Handle`` returning False
(-> ``CommTimeoutError``), the second is re-raised and the base ``Handle`` names the
collective and the group. On nccl/hccl, ``wait`` does not block the host for the
timeout; there the process group's own timeout (set to the same value at
initialization) and its watchdog end a stuck collective.

Gloo fast paths (measured with ci/bench/comm.py and interleaved micro-benchmarks; the
figures are in docs/design.md): on one host gloo's own all-gather and
reduce-scatter are several times slower than its all-to-all, and an all-gather sent as
point-to-point messages is faster still than an all-to-all of a replicated shard, on 2
and 4 ranks; neither path is slower for small tensors. So :class:`GlooCommunicator` carries

- all_gather_into as point-to-point sends of the shard to every peer (exactly the
  (n-1) x shard bytes of an all-gather, no extra buffer), and
- reduce_scatter as an all-to-all of the chunks followed by a local reduction (the same
  (n-1)/n x input bytes on the wire; 16-bit floats are summed in fp32 locally), which is
  recorded in the ledger as the all-to-all it is.
"""
from __future__ import annotations

import atexit
import datetime
import importlib
import re
import time
from typing import Any, Callable, ClassVar, Sequence

import torch

from zero_core.interfaces.communicator import Communicator, Group, Handle
from zero_core.errors import BackendUnavailable, CommError

from . import (ScratchPool, destroy_torch_distributed_at_exit, reduce_rows_into,
               refuse_integer_average)
from .torch_dist_init import init_torch_distributed

# gloo: "Operation timed out!"; gloo transport: "Timed out waiting 5000ms for recv
# operation to complete"; both mean "not done yet", not "broken".
_TIMEOUT_MESSAGE = re.compile(r"timed out", re.IGNORECASE)


def _dist():
    import torch.distributed as dist
    return dist


def _reduce_op(op: str):
    dist = _dist()
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
            "avg": dist.ReduceOp.AVG}[op]


def _wait_all(works: Sequence[Any], timeout: float) -> bool:
    """Wait for every torch ``Work`` within *timeout* seconds in total; False on timeout."""
    deadline = time.monotonic() + timeout
    for work in works:
        remaining = max(deadline - time.monotonic(), 1e-3)
        try:
            work.wait(timeout=datetime.timedelta(seconds=remaining))
        except RuntimeError as exc:
            if _TIMEOUT_MESSAGE.search(str(exc)):
                return False
            raise
    return True


def _launch(op: str, group: Group, start: Callable[[], Any]) -> Any:
    """Start a torch.distributed call, naming the collective and group if it fails at once
    (a peer that is already gone can make the enqueue itself raise)."""
    try:
        return start()
    except CommError:
        raise
    except RuntimeError as exc:
        raise CommError(f"{op} on group '{group.name}' (ranks {list(group.ranks)}) could not "
                        f"start: {exc}") from exc


def _handle(op: str, group: Group, timeout: float, works: Sequence[Any],
            finish: Callable[[], None] | None = None) -> Handle:
    works = [w for w in works if w is not None]
    return Handle(op, group, timeout, wait_fn=lambda t: _wait_all(works, t), finish=finish,
                  test_fn=lambda: all(w.is_completed() for w in works))


def default_group_backend(backend: str, device_types: tuple[str, ...]) -> str:
    """The backend string that starts torch.distributed's default group for *backend*. A
    device-only backend (nccl, hccl, xccl) gets gloo beside it for host tensors
    ("cpu:gloo,cuda:nccl"), so that user code and zero-core's own host-side control plane
    (the conformance suite's agreement, checkpoint metadata through torch.distributed)
    keep working on the CPU."""
    if "cpu" in device_types:
        return backend
    return ",".join(["cpu:gloo"] + [f"{d}:{backend}" for d in device_types])


def uses_backend(group_backend: str, backend: str) -> bool:
    """Whether a default group started as *group_backend* carries *backend*'s traffic
    ("nccl" and "cpu:gloo,cuda:nccl" both carry nccl's)."""
    parts = [p.split(":")[-1] for p in group_backend.lower().split(",")]
    return backend in parts


class TorchDistCommunicator(Communicator):
    """torch.distributed with the backend named by :attr:`backend`."""

    #: torch.distributed backend string passed to init_process_group / new_group
    backend: ClassVar[str] = ""
    #: module whose import registers the backend with torch.distributed (None: built in)
    vendor_module: ClassVar[str | None] = None
    #: how to get *vendor_module* or the backend, for error messages
    install_hint: ClassVar[str] = ""
    #: True when the backend implements ReduceOp.AVG itself; otherwise sum, then divide
    native_avg: ClassVar[bool] = False

    # ---- availability ------------------------------------------------------------------
    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            dist = _dist()
        except ImportError as exc:  # pragma: no cover - torch always ships it on Linux
            return False, (f"torch.distributed cannot be imported ({exc}); install a torch "
                           f"build with distributed support")
        if not dist.is_available():
            return False, ("this torch build has no torch.distributed; install a build with "
                           "distributed support (the Linux wheels from PyPI have it)")
        if cls.vendor_module:
            try:
                importlib.import_module(cls.vendor_module)
            except Exception as exc:  # vendor modules fail in many ways without their hardware
                return False, (f"the {cls.backend} backend is registered by `import "
                               f"{cls.vendor_module}`, which failed ({type(exc).__name__}: "
                               f"{exc}); {cls.install_hint}")
        if not cls._backend_compiled(dist):
            return False, (f"torch.distributed has no '{cls.backend}' backend in this build "
                           f"(torch {torch.__version__}); {cls.install_hint}")
        return cls._device_availability()

    @classmethod
    def _backend_compiled(cls, dist) -> bool:
        checker = getattr(dist, f"is_{cls.backend}_available", None)
        if checker is not None:
            return bool(checker())
        if hasattr(dist, "is_backend_available"):
            return bool(dist.is_backend_available(cls.backend))
        return cls.backend in getattr(dist.Backend, "backend_list", ())

    @classmethod
    def _device_availability(cls) -> tuple[bool, str]:
        """(True, "") when a device this backend drives is present."""
        return True, ""

    def _device(self) -> torch.device | None:
        """The device to bind the process group to at init (None: let the backend pick)."""
        return None

    def _group_backend(self) -> str:
        """The backend string of the default group, when we start torch.distributed."""
        return default_group_backend(self.backend, self.device_types)

    @classmethod
    def start_torch_distributed(cls, launch, timeout: float) -> None:
        """Start torch.distributed's default group with this backend (gloo beside a
        device-only one), unless it is already initialized; the runtime asks the gloo
        communicator this so that torch.distributed answers next to any communicator."""
        init_torch_distributed(launch, default_group_backend(cls.backend, cls.device_types),
                               timeout)

    # ---- setup -------------------------------------------------------------------------
    def __init__(self, launch, topology, timeout: float = 300.0):
        ok, why = self.availability()
        if not ok:
            raise BackendUnavailable(f"communicator '{self.name}' cannot run here: {why}")
        super().__init__(launch, topology, timeout)

    def _timedelta(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout)

    def _init_world(self) -> Group:
        dist = _dist()
        if not dist.is_initialized():
            # we start torch.distributed, so we also make sure it is torn down before exit
            atexit.register(destroy_torch_distributed_at_exit)
        init_torch_distributed(self.launch, self._group_backend(), self.timeout,
                               device=self._device())
        if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
            raise CommError(
                f"torch.distributed was initialized elsewhere as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the launcher says rank {self.rank} of "
                f"{self.world_size}; initialize torch.distributed with the launcher's "
                f"RANK/WORLD_SIZE or let zero-core do it")
        handle = None  # None: the default process group
        if not uses_backend(str(dist.get_backend()), self.backend):
            # torch.distributed was set up by someone else with another backend: carry our
            # traffic on a world group of our own backend (collective, all ranks are here)
            handle = dist.new_group(ranks=list(range(self.world_size)), backend=self.backend,
                                    timeout=self._timedelta())
        ranks = tuple(range(self.world_size))
        return Group("world", ranks, self.rank, self.topology.spans_nodes(ranks), handle)

    def _new_group(self, ranks: tuple[int, ...], name: str) -> Any:
        return _dist().new_group(ranks=list(ranks), backend=self.backend, timeout=self._timedelta())

    def shutdown(self) -> None:
        """torch.distributed itself is torn down by zero_core.runtime.context.shutdown()."""

    # ---- collectives -------------------------------------------------------------------
    def _all_gather_into(self, output, input, group) -> Handle:
        dist = _dist()
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = _launch("all_gather_into", group,
                       lambda: fn(output, input, group=group.handle, async_op=True))
        return _handle("all_gather_into", group, self.timeout, [work])

    def _reduce_scatter(self, output, input, op, group) -> Handle:
        refuse_integer_average("reduce_scatter", op, input.dtype, group)
        dist = _dist()
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        wire_op, finish = self._avg_plan(op, output, group)
        work = _launch("reduce_scatter", group, lambda: fn(
            output, input, op=_reduce_op(wire_op), group=group.handle, async_op=True))
        return _handle("reduce_scatter", group, self.timeout, [work], finish)

    def _all_reduce(self, tensor, op, group) -> Handle:
        refuse_integer_average("all_reduce", op, tensor.dtype, group)
        wire_op, finish = self._avg_plan(op, tensor, group)
        work = _launch("all_reduce", group, lambda: _dist().all_reduce(
            tensor, op=_reduce_op(wire_op), group=group.handle, async_op=True))
        return _handle("all_reduce", group, self.timeout, [work], finish)

    def _all_to_all_single(self, output, input, group) -> Handle:
        work = _launch("all_to_all_single", group, lambda: _dist().all_to_all_single(
            output, input, group=group.handle, async_op=True))
        return _handle("all_to_all_single", group, self.timeout, [work])

    def _broadcast(self, tensor, src, group) -> Handle:
        # zero-core's src is a group rank; torch's ``src`` is a global rank on every version
        work = _launch("broadcast", group, lambda: _dist().broadcast(
            tensor, src=group.ranks[src], group=group.handle, async_op=True))
        return _handle("broadcast", group, self.timeout, [work])

    def _barrier(self, group) -> Handle:
        # an all-reduce of one element synchronizes like a barrier on every backend (nccl's
        # own barrier has to guess a device) and gives a Work we can wait on with a timeout
        token = torch.zeros(1, device=self._token_device())
        work = _launch("barrier", group, lambda: _dist().all_reduce(
            token, group=group.handle, async_op=True))
        return _handle("barrier", group, self.timeout, [work])

    # ---- helpers -----------------------------------------------------------------------
    def _token_device(self) -> torch.device:
        return self._device() or torch.device("cpu")

    def _avg_plan(self, op: str, result: torch.Tensor, group: Group):
        """The op to send and what to do after completion: "avg" becomes "sum" and a
        division by the group size where the backend has no AVG."""
        if op != "avg" or self.native_avg:
            return op, None
        return "sum", lambda: result.div_(group.size)


class GlooCommunicator(TorchDistCommunicator):
    """gloo on CPU tensors, with all-gather and reduce-scatter carried by faster paths."""

    name = "gloo"
    backend = "gloo"
    device_types = ("cpu",)
    install_hint = "install a torch build with gloo (every Linux/macOS wheel from PyPI has it)"
    collective_order = "per_group"
    #: False restores gloo's own all_gather / reduce_scatter (for comparisons)
    all_gather_via_p2p: ClassVar[bool] = True
    reduce_scatter_via_all_to_all: ClassVar[bool] = True

    def __init__(self, launch, topology, timeout: float = 300.0):
        self._scratch = ScratchPool()
        super().__init__(launch, topology, timeout)

    def shutdown(self) -> None:
        self._scratch.clear()

    def _all_gather_into(self, output, input, group) -> Handle:
        if not self.all_gather_via_p2p or group.size == 1:
            return super()._all_gather_into(output, input, group)
        dist = _dist()
        chunk = input.numel()
        out = output.view(-1)
        ops = []
        # every rank posts its sends and receives in the same (group rank) order, so
        # concurrent all-gathers on one group match up pairwise in posting order
        for peer_index, peer in enumerate(group.ranks):
            if peer_index == group.rank:
                continue
            ops.append(dist.P2POp(dist.isend, input.view(-1), peer, group.handle))
            ops.append(dist.P2POp(dist.irecv, out[peer_index * chunk:(peer_index + 1) * chunk],
                                  peer, group.handle))
        works = _launch("all_gather_into", group, lambda: dist.batch_isend_irecv(ops))
        out[group.rank * chunk:(group.rank + 1) * chunk].copy_(input.view(-1))
        # the ledger's all_gather_into formula, (n-1) x shard sent, is exactly these sends
        return _handle("all_gather_into", group, self.timeout, works)

    def _reduce_scatter(self, output, input, op, group) -> Handle:
        if not self.reduce_scatter_via_all_to_all or group.size == 1:
            return super()._reduce_scatter(output, input, op, group)
        refuse_integer_average("reduce_scatter", op, input.dtype, group)
        n = group.size
        received, buf = self._scratch.take(input.numel(), input.dtype)
        work = _launch("reduce_scatter", group, lambda: _dist().all_to_all_single(
            received, input, group=group.handle, async_op=True))

        def finish():
            reduce_rows_into(output, received.view(n, -1), op)
            self._scratch.give_back(buf)

        handle = _handle("reduce_scatter", group, self.timeout, [work], finish)
        handle.wire_op = "all_to_all_single"
        handle.wire_payload_bytes = input.numel() * input.element_size()
        return handle


class NcclCommunicator(TorchDistCommunicator):
    """NCCL on CUDA tensors (code path not run on this project's CPU-only CI)."""

    name = "nccl"
    backend = "nccl"
    device_types = ("cuda",)
    native_avg = True  # ReduceOp.AVG is native in NCCL >= 2.10
    install_hint = ("install a CUDA build of torch "
                    "(pip install torch --index-url <CUDA wheel index>)")

    @classmethod
    def _device_availability(cls):
        if not torch.cuda.is_available():
            return False, ("no CUDA device is visible (torch.cuda.is_available() is False); "
                           "check the driver and CUDA_VISIBLE_DEVICES")
        return True, ""

    def _device(self):
        return torch.device("cuda", self.launch.local_rank % max(torch.cuda.device_count(), 1))


class HcclCommunicator(TorchDistCommunicator):
    """HCCL on Habana Gaudi (HPU) tensors; the backend is registered by Habana's module."""

    name = "hccl"
    backend = "hccl"
    device_types = ("hpu",)
    vendor_module = "habana_frameworks.torch.distributed.hccl"
    install_hint = ("install Habana's PyTorch integration (habana-torch-plugin / the Gaudi "
                    "software stack, which provides habana_frameworks.torch)")

    @classmethod
    def _device_availability(cls):
        try:
            import habana_frameworks.torch.hpu as hpu  # noqa: PLC0415 - vendor module
            ok = bool(hpu.is_available())
        except Exception as exc:
            return False, f"habana_frameworks.torch.hpu cannot report devices ({exc})"
        return (True, "") if ok else (False, "no Gaudi (HPU) device is visible")

    def _token_device(self):
        return torch.device("hpu")


class CclCommunicator(TorchDistCommunicator):
    """Intel oneCCL through oneccl_bindings_for_pytorch, on XPU or CPU tensors."""

    name = "ccl"
    backend = "ccl"
    device_types = ("xpu", "cpu")
    vendor_module = "oneccl_bindings_for_pytorch"
    install_hint = ("install Intel's oneCCL bindings matching your torch version "
                    "(pip package oneccl_bind_pt from Intel's wheel index)")


class XcclCommunicator(TorchDistCommunicator):
    """torch's built-in XCCL backend on Intel GPU (XPU) tensors (torch >= 2.8)."""

    name = "xccl"
    backend = "xccl"
    device_types = ("xpu",)
    install_hint = ("install an XPU build of torch >= 2.8 "
                    "(pip install torch --index-url <XPU wheel index>)")

    @classmethod
    def _device_availability(cls):
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            return False, "no Intel GPU (XPU) is visible (torch.xpu.is_available() is False)"
        return True, ""

    def _device(self):
        return torch.device("xpu", self.launch.local_rank % max(torch.xpu.device_count(), 1))
