"""Execution-order recording and prefetch planning for stage 3.

A *pass* runs from the root module's forward until the next one (so it holds the forward,
the backward and, with activation checkpointing, the recomputes in between). Every
request of a fetch unit is appended to the pass's sequence. The first pass of each kind
(training/eval × grad on/off) is recorded; later passes *follow* the recorded sequence,
which tells what to gather next (prefetch) and when a unit will be used again (release
or keep). When a request differs from the recording — the model took another path — the
pass stops following, and its own sequence replaces the recording when it ends
(re-recorded), so a changed order costs one pass without prefetch.

All decisions depend only on the sequence of requests, which every rank sees identically
(same program), so every rank issues the same collectives in the same order.
"""
from __future__ import annotations

import bisect
import logging

log = logging.getLogger("zero_core.stage3")

#: how many recorded requests ahead the prefetcher looks at, at most
LOOKAHEAD = 32


class ExecutionTrace:
    """Recorded unit-request sequences, and the pass now running against one of them.
    *numels[u]*: elements of unit u (for reuse distances)."""

    def __init__(self, numels: list[int]):
        self.numels = numels
        self.recordings: dict = {}
        self.key = None
        self.recorded: list[int] | None = None
        self.current: list[int] = []
        self.following = False
        self.pos = 0
        self.rerecorded = 0      # passes whose order differed from the recording
        self.passes = 0
        self._positions: dict[int, list[int]] = {}
        self._cum: list[int] = []

    def begin(self, key) -> None:
        """Start a pass of kind *key* (ends the previous one)."""
        self.finish()
        self.key = key
        self.recorded = self.recordings.get(key)
        self.current = []
        self.pos = 0
        self.following = self.recorded is not None
        self.passes += 1
        if self.following:
            rec = self.recorded
            self._positions = {}
            for i, u in enumerate(rec):
                self._positions.setdefault(u, []).append(i)
            cum = [0]
            for u in rec:
                cum.append(cum[-1] + self.numels[u])
            self._cum = cum

    def finish(self) -> None:
        """End the running pass: keep its sequence as the recording if there was none or
        the order changed."""
        if self.key is None or not self.current:
            return
        if self.recorded is None:
            self.recordings[self.key] = self.current
        elif not self.following or self.pos != len(self.recorded):
            self.recordings[self.key] = self.current
            self.rerecorded += 1
            log.info("stage 3: the module execution order changed; re-recorded (%d requests)",
                     len(self.current))
        self.current = []
        self.key = None

    def record(self, unit: int) -> None:
        """A unit was requested: append it, and check it against the recording."""
        if self.key is None:
            return
        self.current.append(unit)
        if self.following:
            if self.pos < len(self.recorded) and self.recorded[self.pos] == unit:
                self.pos += 1
            else:
                self.following = False

    def upcoming(self) -> list[int]:
        """The next recorded requests (at most LOOKAHEAD), when following."""
        if not self.following:
            return []
        return self.recorded[self.pos:self.pos + LOOKAHEAD]

    def lookahead_end(self) -> int:
        """Where the prefetcher's window ends: pos + LOOKAHEAD, at most the recording's
        length (pos when the pass does not follow a recording)."""
        if not self.following:
            return self.pos
        return min(self.pos + LOOKAHEAD, len(self.recorded))

    def next_use(self, unit: int) -> int | None:
        """The recorded position of *unit*'s next request (>= pos); None if it is not
        requested again in this pass (or the pass does not follow a recording)."""
        if not self.following:
            return None
        where = self._positions.get(unit)
        if not where:
            return None
        i = bisect.bisect_left(where, self.pos)
        return where[i] if i < len(where) else None

    def reuse_distance(self, unit: int) -> int | None:
        """Elements requested between now and *unit*'s next recorded use; None if it is
        not used again in this pass (or the pass does not follow a recording)."""
        at = self.next_use(unit)
        return None if at is None else self.elements_until(at)

    def elements_until(self, at: int) -> int:
        """Elements of the recorded requests from now up to position *at* (exclusive)."""
        return self._cum[at] - self._cum[self.pos]
