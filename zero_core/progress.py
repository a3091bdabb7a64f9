"""The one progress bar of zero-core's long-running commands (training demo, convert).

On a terminal it is one line redrawn in place; when stderr is a file or a pipe it prints a
plain line every ``1 / plain_lines`` of the work, so that logs stay short.
"""
from __future__ import annotations

import sys
import time


class ProgressBar:
    """Progress of *total* units of work (steps, bytes, ...), shown on *stream* (stderr)."""

    def __init__(self, total: int, label: str = "", enabled: bool = True, width: int = 24,
                 stream=None, plain_lines: int = 20, show_count: bool = True):
        self.total = max(1, total)
        self.label = f"{label} " if label else ""
        self.enabled = enabled
        self.width = width
        self.stream = stream or sys.stderr
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.plain_lines = plain_lines
        self.show_count = show_count      # "done/total" after the bar (steps), else a percentage
        self._last_line = 0
        self.t0 = time.monotonic()

    def update(self, done: int, fields: dict | None = None) -> None:
        """Show *done* of *total* and ``{label: formatted value}`` *fields*."""
        if not self.enabled:
            return
        frac = min(1.0, done / self.total)
        line_no = int(frac * self.plain_lines)
        if not self.interactive and line_no == self._last_line:
            return
        self._last_line = line_no
        filled = int(self.width * frac)
        elapsed = time.monotonic() - self.t0
        eta = elapsed / frac * (1 - frac) if frac > 0 else 0.0
        info = "  ".join(f"{name} {value}" for name, value in (fields or {}).items())
        amount = f"{done}/{self.total}" if self.show_count else f"{frac * 100:5.1f}%"
        line = (f"{self.label}[{'#' * filled}{'.' * (self.width - filled)}] {amount}  "
                f"{info}  {elapsed:.0f}s, eta {eta:.0f}s")
        self.stream.write(("\r" + line) if self.interactive else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the redrawn line (on a terminal)."""
        if self.enabled and self.interactive:
            self.stream.write("\n")
            self.stream.flush()
