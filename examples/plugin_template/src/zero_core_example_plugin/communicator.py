"""A communicator over torch.distributed's gloo backend, under its own name ("example-gloo").

zero-core's ``Communicator`` base class does the bookkeeping: it validates arguments
before anything is sent, records every collective in the ledger, and turns a handle's
failed wait into an error naming the collective and the group. A backend implements
only the ``_``-prefixed hooks, each starting one collective and returning a
:class:`~zero_core.interfaces.communicator.Handle`. Conventions (see zero_core/communicator.py):
tensors are flat and contiguous; ``src`` of broadcast is a rank *within the group*;
creating a group is collective over the whole world.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from zero_core.interfaces.communicator import Communicator, Group, Handle
from zero_core.errors import BackendUnavailable
# zero-core's torch.distributed start-up: initializes it through whatever launched us
# (torchrun, mpirun, Slurm), sharing rank 0's address via MPI when none is set. It belongs
# to the built-in torch.distributed backends, which a plugin may use as a library.
from zero_core.backends.comm.torch_dist_init import init_torch_distributed

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        # gloo has no average: sum, then divide when the collective has finished
        "avg": dist.ReduceOp.SUM}


class ExampleGlooCommunicator(Communicator):
    name = "example-gloo"       # config "comm_backend" / ZERO_CORE_COMM
    device_types = ("cpu",)     # gloo moves host tensors only

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if not dist.is_available():
            return False, f"torch {torch.__version__} was built without torch.distributed"
        if not dist.is_gloo_available():
            return False, f"torch {torch.__version__} was built without the gloo backend"
        return True, ""

    # ---- connection and groups ------------------------------------------------------------
    def _init_world(self) -> Group:
        init_torch_distributed(self.launch, "gloo", self.timeout)
        if dist.get_backend() != "gloo":
            raise BackendUnavailable(
                f"torch.distributed is already initialized with {dist.get_backend()!r}; the "
                f"{self.name} communicator needs gloo: let zero-core initialize it")
        ranks = tuple(range(self.world_size))
        # handle=None: torch's default (world) process group
        return Group("world", ranks, self.rank, self.topology.spans_nodes(ranks), None)

    def _new_group(self, ranks, name):
        # collective: every rank calls it; non-members get torch's NON_GROUP_MEMBER marker,
        # and the base class gives them a Group with rank -1 that refuses collectives
        return dist.new_group(list(ranks), backend="gloo",
                              timeout=datetime.timedelta(seconds=self.timeout))

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- collectives: start the work, hand back a Handle ----------------------------------
    def _handle(self, op: str, group: Group, work, finish=None) -> Handle:
        def wait(timeout_s: float) -> bool:
            try:
                return bool(work.wait(datetime.timedelta(seconds=timeout_s)))
            except RuntimeError as exc:
                # report a timeout as False: the Handle turns it into CommTimeoutError with
                # advice; any other error propagates and becomes a CommError
                if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                    return False
                raise
        return Handle(op, group, self.timeout, wait, finish=finish, test_fn=work.is_completed)

    @staticmethod
    def _average(tensor: torch.Tensor, n: int):
        if tensor.is_floating_point():
            return lambda: tensor.div_(n)
        return lambda: tensor.floor_divide_(n)

    def _all_gather_into(self, output, input, group):
        work = dist.all_gather_into_tensor(output, input, group=group.handle, async_op=True)
        return self._handle("all_gather_into", group, work)

    def _reduce_scatter(self, output, input, op, group):
        work = dist.reduce_scatter_tensor(output, input, op=_OPS[op], group=group.handle,
                                          async_op=True)
        finish = self._average(output, group.size) if op == "avg" else None
        return self._handle("reduce_scatter", group, work, finish)

    def _all_reduce(self, tensor, op, group):
        work = dist.all_reduce(tensor, op=_OPS[op], group=group.handle, async_op=True)
        finish = self._average(tensor, group.size) if op == "avg" else None
        return self._handle("all_reduce", group, work, finish)

    def _all_to_all_single(self, output, input, group):
        work = dist.all_to_all_single(output, input, group=group.handle, async_op=True)
        return self._handle("all_to_all_single", group, work)

    def _broadcast(self, tensor, src, group):
        # torch wants the global rank of the source; ours is the rank within the group
        work = dist.broadcast(tensor, src=group.ranks[src], group=group.handle, async_op=True)
        return self._handle("broadcast", group, work)

    def _barrier(self, group):
        return self._handle("barrier", group, dist.barrier(group=group.handle, async_op=True))
