"""A dependency-free progress bar for long CPU/GPU loops, written to stderr.

On a terminal it redraws one line; in a log file (CI, ``kubectl logs``) it writes a line
every tenth of the way so the output stays readable. Each line shows the time spent and
the time left at the average pace so far, as ``elapsed<left``.
"""

from __future__ import annotations

import time
from typing import TextIO


class ProgressBar:
    """``update(done, **figures)`` redraws ``label [####....] done/total 12s<30s k=v ...``."""

    def __init__(self, total: int, label: str, stream: TextIO | None, width: int = 24) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream
        self.width = width
        self._tty = bool(stream is not None and stream.isatty())
        self._last_draw = 0.0
        self._last_decile = -1
        self._started = time.monotonic()

    def update(self, done: int, **figures: float) -> None:
        if self.stream is None:
            return
        now = time.monotonic()
        decile = done * 10 // self.total
        if self._tty:
            if now - self._last_draw < 0.1 and done < self.total:
                return
        elif decile == self._last_decile and done < self.total:
            return
        self._last_draw = now
        self._last_decile = decile
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - self._started
        left = _clock(elapsed / done * (self.total - done)) if done else "?"
        extra = " ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
        line = f"{self.label} [{bar}] {done}/{self.total} {_clock(elapsed)}<{left} {extra}"
        self.stream.write(("\r" + line) if self._tty else (line + "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None and self._tty:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    """``42s``, ``3m05s`` or ``1h02m``."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _fmt(value: float) -> str:
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.4g}"
