"""Full garbage collections of a bench process, timed: a full collection stops the whole
process, so a producer or worker that pays one holds every event in flight for its length.

The bench's spawned children (worker processes, the event producer) re-import the bench's
main module, torch and the model code with it: ~200,000 objects that every full collection
walks (100-210 ms on the H200 host and the CPU machine alike, the ninth session's
measurement) unless the process freezes its start-up heap first, as a worker does
(``streamrec.worker.interpreter.freeze_heap``).
"""

from __future__ import annotations

import gc
import time

import numpy as np


class GcPauses:
    """Every full (generation-2) collection of this process: when it began (monotonic s)
    and how long the whole process stood still for it (ms)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float]] = []
        self._began = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.monotonic()
        else:
            self.pauses.append((self._began, (time.monotonic() - self._began) * 1000.0))

    def durations(self, start: float, end: float) -> np.ndarray:
        return np.array([ms for began, ms in self.pauses if start <= began < end])
