"""Communication backends: torch.distributed (``torch_dist``) and MPI (``mpi``).

This package module holds the small pieces both families share: the local reduction
used when a reduce-scatter is carried as an all-to-all (gloo's fast path, and MPI's
16-bit floats, for which MPI has no datatype), and the check that refuses an average of
integer tensors before anything is sent. It imports torch only, never a vendor library.
"""
from __future__ import annotations

import concurrent.futures as cf
import queue
import sys
import threading
from typing import Any, Callable

import torch

from zero_core.errors import CommError

#: floating dtypes that are summed in fp32 locally, then rounded once
LOW_PRECISION_FLOATS = (torch.float16, torch.bfloat16)


def refuse_integer_average(opname: str, op: str, dtype: torch.dtype, group) -> None:
    """Raise before sending when *op* is "avg" on an integer dtype (the mean of integers is
    not an integer; rounding it silently would be a wrong answer)."""
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise CommError(f"{opname} on group '{group.name}': op='avg' needs a floating-point "
                        f"tensor, got {dtype}; reduce with op='sum' and divide, or convert "
                        f"the tensor to a float dtype first")


def reduce_rows_into(output: torch.Tensor, rows: torch.Tensor, op: str) -> None:
    """Reduce the *rows* (shape ``(n, c)``, one row per rank, in group rank order) into the
    flat *output* (``c`` elements) with *op* ("sum", "avg", "max", "min").

    16-bit floats are accumulated in fp32 and rounded once at the end, so the result is
    at least as accurate as a backend that reduces in 16 bits. Integers follow the
    wrap-around semantics of the backends' own integer sums.
    """
    n = rows.shape[0]
    out = output.view(-1)
    if op in ("max", "min"):
        torch.amax(rows, dim=0, out=out) if op == "max" else torch.amin(rows, dim=0, out=out)
        return
    if rows.dtype in LOW_PRECISION_FLOATS:
        acc = rows.sum(dim=0, dtype=torch.float32)
        if op == "avg":
            acc.div_(n)
        out.copy_(acc)
        return
    torch.sum(rows, dim=0, out=out)
    if op == "avg":
        out.div_(n)


class ScratchPool:
    """Reusable staging buffers for collectives that need a temporary (an all-to-all's
    receive buffer before a local reduction).

    Allocating a fresh 64 MiB tensor per call costs page faults on every first touch
    (the CPU allocator returns large blocks to the OS on free); ZeRO's buckets have a
    constant size, so a handful of reused buffers removes that cost. A buffer is taken
    at launch and given back when the collective has finished, so concurrent async ops
    never share one. Buffers are byte tensors viewed as the dtype asked for.
    """

    def __init__(self, max_free: int = 4):
        self._free: list[torch.Tensor] = []
        self._max_free = max_free
        self._lock = threading.Lock()  # taken on the caller's thread, given back on MPI's

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(view of *numel* elements of *dtype*, backing buffer to give back)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            # the smallest buffer that fits (by index: tensors do not compare with ==)
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes].view(dtype), buf

    def give_back(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self._max_free:  # keep the largest ones
                self._free.sort(key=torch.Tensor.numel)
                self._free.pop(0)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


class CallThread:
    """Runs a library's calls one at a time, in submission order, on one daemon thread.

    For libraries whose calls block without a timeout of their own (MPI, oneCCL): the
    caller waits on the returned future with a deadline (:func:`wait_future`), so a dead
    peer becomes a timeout error instead of a hang; ``stuck`` tells whether a call is still
    running when the process wants to exit.
    """

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_with: str | None = None      # description of the call in progress
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, what: str, fn: Callable[[], Any]) -> cf.Future:
        future: cf.Future = cf.Future()
        self._queue.put((what, fn, future))
        return future

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run *fn* on the thread and return its result (for setup calls, no timeout)."""
        return self.submit(what, fn).result()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            what, fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            self.busy_with = what
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
            finally:
                self.busy_with = None

    def stop(self, timeout: float) -> bool:
        """Let queued calls finish, then end the thread; False if it is still stuck."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop_or_report(self, library: str, timeout: float) -> bool:
        """:meth:`stop`, saying on stderr which call is still running when it fails."""
        if self.stop(timeout):
            return True
        print(f"zero-core: the {library} worker thread is still inside '{self.busy_with}' "
              f"after {timeout:g} s", file=sys.stderr, flush=True)
        return False

    @property
    def stuck(self) -> bool:
        return self._thread.is_alive() and self.busy_with is not None


def wait_future(future: cf.Future, timeout: float) -> bool:
    """Wait for *future* up to *timeout* seconds; False on timeout (its error is raised)."""
    try:
        future.result(timeout=timeout)
    except cf.TimeoutError:
        return False
    return True


def destroy_torch_distributed_at_exit() -> None:
    """For ``atexit``: tear torch.distributed down while the interpreter is still whole.

    A gloo worker thread that drops the last reference to a tensor during interpreter
    finalization cannot take the GIL and aborts the process (seen as SIGABRT in
    ProcessGroupGloo's runLoop when a script exits right after its last collective).
    """
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
