"""Progress of the long stages (capture, profiling, planning), the usual Python way.

On an interactive terminal (stderr is a TTY) a stage longer than :data:`SHOW_AFTER_S` gets a
``tqdm`` bar (counted, like "profiling 120/1000 nodes", or just the elapsed time); otherwise it
logs INFO records on the ``fxpooch.progress`` logger: once it has run :data:`SHOW_AFTER_S`, then
every :data:`LOG_EVERY_S`, and when it ends. Configure logging (or pass ``-v`` to the CLI) to see
them in a script or a job log.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("fxpooch.progress")

#: a stage shorter than this shows nothing
SHOW_AFTER_S = 2.0
#: without a terminal, a running stage logs a line this often
LOG_EVERY_S = 10.0
#: how often the bar of a stage without counts is redrawn (its elapsed time)
REFRESH_S = 1.0


def interactive() -> bool:
    """True when stderr is a terminal: progress bars, not log records."""
    stream = sys.stderr
    return bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())


class Stage:
    """One long stage; :meth:`update` counts its steps when ``total`` is known."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "step"):
        self.desc, self.total, self.unit = desc, total, unit
        self.done = 0
        self.t0 = time.perf_counter()
        self._bar: Any = None
        if interactive():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, delay=SHOW_AFTER_S, leave=False, file=sys.stderr,
                             dynamic_ncols=True, bar_format=None if total is not None else "{desc}: {elapsed}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"fxpooch progress: {desc}", daemon=True)
        self._thread.start()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def _counts(self) -> str:
        if self.total is None:
            return ""
        return f", {self.done}/{self.total} {self.unit}s"

    def _beat(self) -> None:
        next_log = SHOW_AFTER_S
        while not self._stop.wait(REFRESH_S if self._bar is not None else min(REFRESH_S, next_log)):
            elapsed = time.perf_counter() - self.t0
            if self._bar is not None:
                if elapsed >= SHOW_AFTER_S:
                    self._bar.refresh()
            elif elapsed >= next_log:
                log.info("%s: running for %.0f s%s", self.desc, elapsed, self._counts())
                next_log += LOG_EVERY_S

    def close(self) -> float:
        """End the stage; returns its seconds."""
        self._stop.set()
        self._thread.join()
        elapsed = time.perf_counter() - self.t0
        if self._bar is not None:
            if elapsed >= SHOW_AFTER_S:
                self._bar.refresh()  # the final count, which the bar's rate limit may have skipped
            self._bar.close()
        if elapsed >= SHOW_AFTER_S:
            log.info("%s: done in %.1f s%s", self.desc, elapsed, self._counts())
        return elapsed


@contextmanager
def stage(desc: str, total: int | None = None, unit: str = "step") -> Iterator[Stage]:
    """``with stage("profiling node by node", total=n, unit="node") as s: ... s.update()``."""
    s = Stage(desc, total, unit)
    try:
        yield s
    finally:
        s.close()
