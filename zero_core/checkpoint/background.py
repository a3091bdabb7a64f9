"""Asynchronous checkpoint saves: the files are written by a thread while training goes on.

``engine.save_checkpoint(..., async_save=True)`` (or ``checkpoint.async_save``) runs the
save's first phase at the call — every rank copies its state into host memory
(``RankState.snapshot``: buffers reused from one save to the next; device copies are
non-blocking into pinned memory, the writer waits for their event) and rank 0 creates
``.<tag>.partial`` — then a thread per rank writes and hashes its files. Nothing is
visible until the save is *committed*: the same collective end as a synchronous save
(collective_save.SaveJob.commit: agreement, metadata.json, rename into place, ``latest``), run on
the training thread at a point where every rank is — the step boundary at which every
rank's writer has finished (:meth:`BackgroundSaver.poll`, one small all-reduce per step
while a save is in flight), the next save or load, or :meth:`BackgroundSaver.wait`
(``engine.wait_for_checkpoint()``, ``engine.destroy()``).

Why commit on the training thread: the commit's collectives share the communicator with
training, and collectives from two threads of one rank would interleave differently on
different ranks. The writer thread only touches files.

A failed background write (a full disk, a vanished directory) is not lost: it is raised,
as the same CheckpointError on every rank naming the rank and the cause, at the commit —
the next engine step, save, load or wait — and the partial files are removed. A process
killed while writing leaves ``.<tag>.partial`` behind, never a damaged ``<tag>`` or
``latest``; the next save removes it.
"""
from __future__ import annotations

import os
import threading

from zero_core.checkpoint.store import all_ranks_ok


def _lower_priority() -> None:
    """Let the writer thread run where training leaves a core idle: on Linux a thread has
    its own nice value (measured: the steps during a background write were 1.4-1.8x a normal
    step on 2 busy cores at the default priority)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed: the write just competes evenly


class _InFlight:
    """One save being written: the job (collective_save.SaveJob), the rank's state, the thread."""

    def __init__(self, job, state):
        self.job, self.state = job, state
        self.payload, self.failure = b"", None
        self.thread = threading.Thread(target=self._write, name=f"zero-core save {job.tag}",
                                       daemon=True)
        self.thread.start()

    def _write(self) -> None:
        _lower_priority()
        self.payload, self.failure = self.job.write(self.state.write_files, self.state.index)

    def done(self) -> bool:
        return not self.thread.is_alive()

    def commit(self) -> str:
        self.thread.join()
        return self.job.commit(self.payload, self.failure, self.state.metadata)


class BackgroundSaver:
    """An engine's async saves: at most one in flight (the next waits for it), and the
    host buffers of the snapshot, kept for the next save (``buffers``)."""

    def __init__(self, comm):
        self.comm = comm
        self.buffers: dict = {}
        self.in_flight: _InFlight | None = None

    def start(self, job, state) -> None:
        assert self.in_flight is None, "wait() for the previous save first"
        self.in_flight = _InFlight(job, state)

    def poll(self) -> str | None:
        """Collective (every rank at the same step): commit the save in flight if every
        rank's writer has finished; returns its directory, else None. Costs one small
        all-reduce while a save is in flight, nothing otherwise."""
        if self.in_flight is None or not all_ranks_ok(self.comm, self.in_flight.done()):
            return None
        return self._commit()

    def wait(self) -> str | None:
        """Collective: wait for the save in flight and commit it; returns its directory
        (None when nothing was in flight)."""
        return None if self.in_flight is None else self._commit()

    def _commit(self) -> str:
        flight, self.in_flight = self.in_flight, None  # a failed commit is not retried
        with flight.job.peers_failing_named():
            return flight.commit()

    def release(self) -> None:
        """Drop the snapshot buffers (host memory of one copy of the rank's state)."""
        self.buffers.clear()
