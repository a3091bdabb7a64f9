"""In-flight ZeRO++ work: a collective's handle plus what must run after it completes."""
from __future__ import annotations

from typing import Callable


class Then:
    """Wraps *handle* (a communicator handle, or None for work already done) and runs
    *after()* once, on the first ``wait()``; ``after`` may return another handle-like
    object, which is waited for too. This is how dequantization on arrival, the middle hop
    of qgZ and hpZ's refresh attach to the collectives the stage-3 engine waits for."""

    def __init__(self, handle, after: Callable[[], object] | None):
        self.handle, self.after = handle, after
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        if self.handle is not None:
            self.handle.wait()
        self._done = True
        if self.after is not None:
            nxt = self.after()
            if nxt is not None:
                nxt.wait()

    def is_completed(self) -> bool:
        if self._done:
            return True
        return self.handle is None or self.handle.is_completed()
