"""Progress bars on stderr for the long operations of the ``tierstore`` command (verify, scrub,
promote, export, wait): bytes and files, driven by the engine's own phases (``verify_file``,
``drain_file``, ``read_file`` carry each file's size), drawn with tqdm. Quiet when stderr is not
a terminal or under ``--json``."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from tierstore.events import Phase
from tierstore.plugin import hookimpl

__all__ = ["ProgressBars"]

#: the phases announced once per file, before it is read or copied
_FILE_PHASES = {Phase.VERIFY_FILE, Phase.DRAIN_FILE, Phase.READ_FILE}


def _width() -> int:
    """The terminal's width (a terminal that says 0, as a fresh pseudo-terminal does, or none:
    $COLUMNS, else 100)."""
    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        columns = 0
    return columns or int(os.environ.get("COLUMNS", "0") or 0) or 100


class ProgressBars:
    """An observer (pass it to ``tierstore.open(plugins=[...])``) drawing one bar at a time:
    :meth:`start` it with the bytes and files the operation will go through, :meth:`finish`
    it after. Files are counted as they start (a bar fills when the last file begins, and is
    completed by :meth:`finish`)."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._lock = threading.Lock()
        self._bar: Any = None
        self._files = 0
        self._total_files = 0

    def start(self, what: str, total_bytes: int, total_files: int) -> None:
        """Begin a bar named ``what``."""
        self.finish()
        if not self.enabled:
            return
        from tqdm import tqdm

        with self._lock:
            self._files, self._total_files = 0, total_files
            self._bar = tqdm(total=total_bytes, desc=what, unit="B", unit_scale=True,
                             unit_divisor=1024, file=sys.stderr, leave=True, ncols=_width(),
                             nrows=50)  # a terminal of unknown height hides bars otherwise
            self._bar.set_postfix_str(f"0/{total_files} files")

    def finish(self) -> None:
        """Complete and close the current bar, if any."""
        with self._lock:
            bar, self._bar = self._bar, None
            if bar is not None:
                bar.update(max(0, bar.total - bar.n))
                bar.set_postfix_str(f"{self._total_files}/{self._total_files} files")
                bar.close()

    @hookimpl
    def tierstore_phase(self, phase: str, detail: dict) -> None:
        """Advance by each file as it starts."""
        if phase not in _FILE_PHASES or self._bar is None:
            return
        with self._lock:
            if self._bar is None:
                return
            self._files += 1
            self._bar.update(int(detail.get("size") or 0))
            self._bar.set_postfix_str(f"{min(self._files, self._total_files)}/"
                                      f"{self._total_files} files")
