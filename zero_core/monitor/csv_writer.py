"""The ``csv_monitor`` writer: one CSV file per event name in ``output_path/job_name``, the
same files and bytes DeepSpeed's CSV monitor writes (``tests/test_monitors.py`` compares them
with a reference DeepSpeed made). The file name is the event name with '/' and ' ' turned into
'_' plus ".csv"; its header row is ``step,<last '/'-part of the name>``; each event appends a
``step,value`` row (Python's csv module: "\\r\\n" line ends, float written as its repr).

Files are opened for appending, so a restarted job goes on in the same files; like DeepSpeed,
each writer writes the header the first time it writes a file, so a restart leaves a second
header row where it began — which is also how a reader finds the restarts.
"""
from __future__ import annotations

import csv
import os

from zero_core.config.monitors import CSVMonitorConfig
from zero_core.monitor.events import Event, log_dir

__all__ = ["CsvWriter", "csv_file_name", "csv_column"]


def csv_file_name(event_name: str) -> str:
    return event_name.replace("/", "_").replace(" ", "_") + ".csv"


def csv_column(event_name: str) -> str:
    return event_name.rsplit("/", 1)[-1]


class CsvWriter:
    """Appends events to ``<log_dir>/<file name>.csv``."""

    def __init__(self, config: CSVMonitorConfig):
        self.log_dir = log_dir(config.output_path, config.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._headed: set[str] = set()      # files this writer has written its header to

    @staticmethod
    def check_available() -> None:
        """The csv module is in the standard library: always available."""

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            file_name = csv_file_name(name)
            with open(os.path.join(self.log_dir, file_name), "a", newline="") as f:
                rows = csv.writer(f)
                if file_name not in self._headed:
                    self._headed.add(file_name)
                    rows.writerow(["step", csv_column(name)])
                rows.writerow([step, value])

    def close(self) -> None:
        """Nothing stays open between writes."""
