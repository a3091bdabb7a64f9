"""The oneCCL communicator: Intel oneCCL's own C API (``libccl.so.2``) through ctypes, on CPU
tensors, under mpirun or torchrun.

The library itself — which wheels, plugin and transport it needs, how they are found
without loading anything, and the C API's types — is :mod:`.oneccl_lib`; this module is
the Communicator: the environment it sets before the library initializes, the rendezvous
of the unique id, the worker thread and the collectives.

Settings made before the library initializes (each only when the variable is unset, so a
user's own value always wins; they are process environment variables, so child processes
see them too): ``CCL_PLUGIN`` (the CPU plugin's path), ``CCL_ATL_TRANSPORT=ofi``,
``CCL_OFI_LIBRARY_PATH`` (the libfabric found), ``FI_PROVIDER=tcp`` (with libfabric's own
choice, fi_getinfo found no provider), ``CCL_ATL_SHM=1`` (shared memory between ranks of one
host: large all-reduces are markedly faster than with tcp alone), ``CCL_WORKER_OFFLOAD=0``
(the collective progresses in the calling thread, which here is this module's worker
thread; with oneCCL's own pinned worker thread small all-reduces were far slower on a
machine with few cores), ``CCL_PROCESS_LAUNCHER=none`` with
``CCL_LOCAL_RANK`` / ``CCL_LOCAL_SIZE`` from the launcher, ``CCL_LOG_LEVEL=error``, and on
a single host ``CCL_KVS_IFACE=lo`` / ``FI_TCP_IFACE=lo`` (nothing leaves the machine).
The measurements behind these choices are in docs/design.md.
Known library fault: an ``FI_PROVIDER`` naming a provider libfabric does not have makes
oneCCL 2022.2 abort the process ("free(): double free detected", SIGABRT) while it creates
the communicator; nothing in this module can catch that.

Collectives
-----------
All-gather, reduce-scatter, all-reduce, all-to-all and broadcast are oneCCL's own; barrier is
an all-reduce of one element (the C API has no barrier). Reduce ops sum/max/min are oneCCL's;
``onecclAvg`` is declared in the header but the CPU plugin refuses it ("Unsupported
onecclRedOp_t value"), so avg is a sum followed by a division (integer averages are refused
before anything is sent, as on the other backends). dtypes: int8, uint8, int32, int64, fp16,
bf16, fp32, fp64. Groups are new communicators from a fresh unique id each:
``onecclCommSplit`` returns success on the CPU plugin but a communicator whose
``onecclCommCount`` is garbage, and a non-NULL one for ``ONECCL_SPLIT_NOCOLOR``. A group of
one rank (and a world of one) is served locally, without a oneCCL communicator.

The unique id (4096 bytes) goes from the group's first rank to the others over the job's
own rendezvous: MPI under an MPI launcher, torch.distributed (gloo) otherwise — the same
paths that torch.distributed's own start-up uses (:mod:`.torch_dist_init`). A rank that
cannot make the id sends its error instead, so the others fail with it rather than wait.

Asynchrony and faults: the C API's calls on host buffers block until done, and
``onecclCommGetAsyncError`` is not implemented, so there is no way to wait with a deadline.
Every library call therefore runs, in submission order, on one worker thread (ctypes
releases the GIL), and ``async_op`` returns a handle on its future: a wait past the timeout
raises ``CommTimeoutError`` (a later wait can still succeed). A collective stuck when the
process exits cannot be cancelled; the exit hook then ends the process with ``os._exit``
after saying so, rather than hanging in the library's teardown.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import ctypes
import os
import sys
from typing import Any, Callable

import torch

from zero_core.interfaces.communicator import Communicator, Group, Handle
from zero_core.errors import BackendUnavailable, CommError, CommTimeoutError

from . import CallThread, destroy_torch_distributed_at_exit, refuse_integer_average, wait_future
from .mpi import import_mpi
from .oneccl_lib import (DTYPES, OPS, RESULTS, TRANSPORT_INSTALL, UNIQUE_ID_BYTES, UniqueId,
                         load_library, locate)
from .torch_dist_init import init_torch_distributed

#: rendezvous message: 1 status byte, then the unique id or an error message
_MESSAGE_BYTES = 1 + UNIQUE_ID_BYTES


class _Comm:
    """A oneCCL communicator of one group (None handle: a group of one, served locally)."""

    def __init__(self, ptr: ctypes.c_void_p | None, size: int, name: str):
        self.ptr, self.size, self.name = ptr, size, name


# ---- helpers -------------------------------------------------------------------------------
def _done_handle(op: str, group: Group, timeout: float,
                 finish: Callable[[], None] | None = None) -> Handle:
    return Handle(op, group, timeout, wait_fn=lambda t: True, finish=finish,
                  test_fn=lambda: True)


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


class OneCclCommunicator(Communicator):
    """Collectives through oneCCL's C API on CPU tensors (see the module docstring)."""

    name = "oneccl"
    # onecclCommSplit is broken in 2022.2; each group is a new unique id (0.5-1.5 s)
    cheap_groups = False
    collective_order = "global"   # calls run on one worker thread
    device_types = ("cpu",)

    # ---- availability ------------------------------------------------------------------
    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            found = locate()
        except Exception as exc:  # noqa: BLE001 - availability() must never raise
            return False, f"could not look for oneCCL ({type(exc).__name__}: {exc})"
        return (True, "") if found["ok"] else (False, found["why"])

    def supports(self, op: str, dtype: torch.dtype) -> bool:
        return dtype in DTYPES

    # ---- setup -------------------------------------------------------------------------
    def __init__(self, launch, topology, timeout: float = 300.0):
        ok, why = self.availability()
        if not ok:
            raise BackendUnavailable(f"communicator 'oneccl' cannot run here: {why}")
        self._found = locate()
        self._thread: CallThread | None = None
        self._comms: list[_Comm] = []
        self._mpi = None
        self._gloo_group = None
        self.library_version: int | None = None
        self.settings: dict[str, str] = {}
        super().__init__(launch, topology, timeout)
        atexit.register(self._at_exit)

    def _apply_settings(self) -> None:
        """Environment defaults read by oneCCL when it initializes (module docstring);
        a variable that is already set is left alone. Records what was set."""
        found = self._found
        single_host = self.launch.local_world_size >= self.world_size
        wanted = {"CCL_PLUGIN": found["plugin"], "CCL_ATL_TRANSPORT": "ofi",
                  "FI_PROVIDER": "tcp", "CCL_ATL_SHM": "1", "CCL_WORKER_OFFLOAD": "0",
                  "CCL_PROCESS_LAUNCHER": "none",
                  "CCL_LOCAL_RANK": str(self.launch.local_rank),
                  "CCL_LOCAL_SIZE": str(self.launch.local_world_size),
                  "CCL_LOG_LEVEL": "error"}
        if found.get("fabric") and not os.environ.get("I_MPI_OFI_LIBRARY"):
            wanted["CCL_OFI_LIBRARY_PATH"] = found["fabric"]
        if single_host:
            wanted.update({"CCL_KVS_IFACE": "lo", "FI_TCP_IFACE": "lo"})
        for key, value in wanted.items():
            if key not in os.environ:
                os.environ[key] = value
                self.settings[key] = value

    def _init_world(self) -> Group:
        if self.launch.is_mpi and self.world_size > 1:
            self._mpi = import_mpi()     # initializes MPI before oneCCL reads the environment
        self._apply_settings()
        self._lib, self.library_version = load_library(self._found["lib"])
        self._thread = CallThread("zero-core-oneccl")
        ranks = tuple(range(self.world_size))
        comm = self._create(ranks, "world")
        return Group("world", ranks, self.rank, self.topology.spans_nodes(ranks), comm)

    def _new_group(self, ranks: tuple[int, ...], name: str) -> Any:
        return self._create(ranks, name)

    def _create(self, ranks: tuple[int, ...], name: str) -> _Comm | None:
        """Collective over the world: a oneCCL communicator for *ranks* (None on ranks that
        are not members). The first member makes the unique id; the rendezvous carries it."""
        if len(ranks) == 1:
            return _Comm(None, 1, name) if self.rank in ranks else None
        root = ranks[0]
        message = None
        if self.rank == root:
            message = self._make_unique_id(name)
        message = self._share(message, root)
        if message[0] != 0:   # every rank raises, members or not
            raise BackendUnavailable(
                f"communicator 'oneccl': rank {root} could not create the oneCCL unique id for "
                f"group '{name}': {message[1:].rstrip(bytes(1)).decode(errors='replace')}")
        if self.rank not in ranks:
            return None
        uid = UniqueId.from_buffer_copy(message[1:])
        me = ranks.index(self.rank)
        ptr = ctypes.c_void_p()

        def init():
            return self._lib.onecclCommInitRank(ctypes.byref(ptr), len(ranks), uid, me)

        what = f"onecclCommInitRank for group '{name}' (ranks {list(ranks)})"
        future = self._thread.submit(what, init)
        if not wait_future(future, self.timeout):
            raise CommTimeoutError(
                f"{what} did not finish within {self.timeout:g} s: a member rank has probably "
                f"died, or failed before joining (see its output)")
        code = future.result()
        if code != 0:
            raise BackendUnavailable(
                f"communicator 'oneccl': {what} failed with {RESULTS.get(code, code)}; "
                f"oneCCL's own message is above on stderr. {self._transport_note()}")
        comm = _Comm(ptr, len(ranks), name)
        self._comms.append(comm)
        return comm

    def _make_unique_id(self, name: str) -> bytes:
        uid = UniqueId()
        future = self._thread.submit(f"onecclGetUniqueId for group '{name}'",
                                     lambda: self._lib.onecclGetUniqueId(ctypes.byref(uid)))
        try:
            code = future.result(timeout=self.timeout)
        except cf.TimeoutError:
            code, text = None, f"onecclGetUniqueId did not return within {self.timeout:g} s"
        else:
            text = (f"onecclGetUniqueId failed with {RESULTS.get(code, code)} (oneCCL says why "
                    f"on stderr; 'could not initialize the requested transport library' means "
                    f"no usable transport). {self._transport_note()}")
        if code == 0:
            return b"\0" + ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)
        return b"\1" + text.encode()[:UNIQUE_ID_BYTES].ljust(UNIQUE_ID_BYTES, b"\0")

    def _transport_note(self) -> str:
        keys = ("CCL_ATL_TRANSPORT", "CCL_OFI_LIBRARY_PATH", "FI_PROVIDER", "CCL_ATL_SHM",
                "CCL_PLUGIN")
        used = ", ".join(f"{k}={os.environ.get(k, '<unset>')}" for k in keys)
        return (f"Settings: {used}. The OFI transport needs libfabric.so.1: "
                f"{TRANSPORT_INSTALL}. CCL_LOG_LEVEL=info shows what oneCCL tried.")

    def _share(self, message: bytes | None, root: int) -> bytes:
        """World-collective broadcast of *message* (_MESSAGE_BYTES) from global rank *root*."""
        if self._mpi is not None:
            return self._mpi.COMM_WORLD.bcast(message, root=root)
        import torch.distributed as dist
        if not dist.is_initialized():
            atexit.register(destroy_torch_distributed_at_exit)
            init_torch_distributed(self.launch, "gloo", self.timeout)
        group = None
        if str(dist.get_backend()).lower() != "gloo":
            if self._gloo_group is None:  # CPU bytes need a CPU backend
                self._gloo_group = dist.new_group(backend="gloo")
            group = self._gloo_group
        buf = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        if message is not None:
            buf.copy_(torch.frombuffer(bytearray(message), dtype=torch.uint8))
        dist.broadcast(buf, src=root, group=group)
        return buf.numpy().tobytes()

    # ---- collectives -------------------------------------------------------------------
    def _submit(self, op: str, group: Group, fn: Callable[[], int],
                finish: Callable[[], None] | None = None) -> Handle:
        """Run *fn* (one library call returning an onecclResult_t) on the worker thread.
        *fn* is a closure over the tensors it passes, which keeps them alive until it ran."""
        if self._thread is None:
            raise CommError(f"{op}: the oneccl communicator has been shut down")
        comm: _Comm = group.handle

        def run():
            code = fn()
            if code != 0:
                detail = self._lib.onecclGetLastError(comm.ptr) if comm.ptr else None
                raise CommError(f"{op} on group '{group.name}' (ranks {list(group.ranks)}): "
                                f"oneCCL returned {RESULTS.get(code, code)}"
                                + (f" ({detail.decode(errors='replace')})" if detail else ""))

        future = self._thread.submit(f"{op} on group '{group.name}'", run)
        return Handle(op, group, self.timeout, wait_fn=lambda t: wait_future(future, t),
                      finish=finish, test_fn=future.done)

    @staticmethod
    def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
        return ctypes.c_void_p(t.data_ptr())

    def _avg_after(self, op: str, result: torch.Tensor, group: Group):
        return (lambda: result.div_(group.size)) if op == "avg" else None

    def _all_gather_into(self, output, input, group) -> Handle:
        comm, n = group.handle, input.numel()
        if comm.ptr is None or n == 0:
            output.view(-1).copy_(input.view(-1).repeat(group.size))
            return _done_handle("all_gather_into", group, self.timeout)
        lib, dt = self._lib, DTYPES[input.dtype]
        # in place when input is this rank's chunk of output; any other overlap: a copy
        in_place = input.data_ptr() == output.data_ptr() + group.rank * n * input.element_size()
        src = input.clone() if not in_place and _overlap(input, output) else input
        return self._submit("all_gather_into", group, lambda: lib.onecclAllGather(
            self._ptr(src), self._ptr(output), n, dt, comm.ptr, None))

    def _reduce_scatter(self, output, input, op, group) -> Handle:
        refuse_integer_average("reduce_scatter", op, input.dtype, group)
        comm, n = group.handle, output.numel()
        if comm.ptr is None or n == 0:
            output.copy_(input.view(-1)[:n].view_as(output))
            return _done_handle("reduce_scatter", group, self.timeout)
        lib, dt, code = self._lib, DTYPES[input.dtype], OPS["sum" if op == "avg" else op]
        in_place = output.data_ptr() == input.data_ptr() + group.rank * n * input.element_size()
        src = input.clone() if not in_place and _overlap(input, output) else input
        return self._submit("reduce_scatter", group, lambda: lib.onecclReduceScatter(
            self._ptr(src), self._ptr(output), n, dt, code, comm.ptr, None),
            finish=self._avg_after(op, output, group))

    def _all_reduce(self, tensor, op, group) -> Handle:
        refuse_integer_average("all_reduce", op, tensor.dtype, group)
        comm, n = group.handle, tensor.numel()
        if comm.ptr is None or n == 0:
            return _done_handle("all_reduce", group, self.timeout)
        lib, dt, code = self._lib, DTYPES[tensor.dtype], OPS["sum" if op == "avg" else op]
        return self._submit("all_reduce", group, lambda: lib.onecclAllReduce(
            self._ptr(tensor), self._ptr(tensor), n, dt, code, comm.ptr, None),
            finish=self._avg_after(op, tensor, group))

    def _all_to_all_single(self, output, input, group) -> Handle:
        comm, n = group.handle, input.numel()
        if comm.ptr is None or n == 0:
            output.copy_(input)
            return _done_handle("all_to_all_single", group, self.timeout)
        lib, dt = self._lib, DTYPES[input.dtype]
        src = input.clone() if _overlap(input, output) else input   # out of place only
        return self._submit("all_to_all_single", group, lambda: lib.onecclAllToAll(
            self._ptr(src), self._ptr(output), n // group.size, dt, comm.ptr, None))

    def _broadcast(self, tensor, src, group) -> Handle:
        comm, n = group.handle, tensor.numel()
        if comm.ptr is None or n == 0:
            return _done_handle("broadcast", group, self.timeout)
        lib, dt = self._lib, DTYPES[tensor.dtype]
        # oneCCL communicators are built with ranks in group order: src is the root as is
        return self._submit("broadcast", group, lambda: lib.onecclBroadcast(
            self._ptr(tensor), self._ptr(tensor), n, dt, src, comm.ptr, None))

    def _barrier(self, group) -> Handle:
        comm = group.handle
        if comm.ptr is None:
            return _done_handle("barrier", group, self.timeout)
        token = torch.zeros(1, dtype=torch.int32)
        lib = self._lib
        return self._submit("barrier", group, lambda: lib.onecclAllReduce(
            self._ptr(token), self._ptr(token), 1, DTYPES[torch.int32], OPS["sum"],
            comm.ptr, None))

    # ---- shutdown ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Destroy the oneCCL communicators (after every queued call) and stop the worker
        thread. Safe to call twice."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        comms, self._comms = self._comms, []
        lib = self._lib
        for comm in reversed(comms):
            thread.submit(f"onecclCommDestroy for group '{comm.name}'",
                          lambda c=comm: lib.onecclCommDestroy(c.ptr))
        if not thread.stop_or_report("oneccl", self.timeout):
            self._thread = thread  # keep it visible to the exit hook

    def _at_exit(self) -> None:
        thread = self._thread
        if thread is None:
            return
        if thread.stuck:
            # a collective that never completed (peer died or hung): oneCCL cannot cancel
            # it, and the library's teardown would wait for it; end the process instead
            print(f"zero-core: rank {self.rank} is exiting while '{thread.busy_with}' has not "
                  f"completed; ending the process with os._exit(1) rather than hanging in "
                  f"oneCCL's teardown", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)
        self.shutdown()
