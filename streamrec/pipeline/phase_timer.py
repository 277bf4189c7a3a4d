"""Per-phase time of one model step, measured without stalling the host.

Timing a phase with the host clock is only honest after a device synchronize, and a
synchronize per phase keeps the host from queueing the next phase while the GPU runs the
current one. On CUDA the timer records an event on the current stream at each phase end
and reads the elapsed times once, after the step's final copy to the host has
synchronized anyway; on the CPU it reads the host clock.
"""

from __future__ import annotations

import time

import torch


class PhaseTimer:
    """``mark(name)`` ends phase ``name``; ``seconds()`` after the step is done."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[tuple[str, torch.cuda.Event | float]] = []
        self.mark("")

    def mark(self, name: str) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((name, event))
        else:
            self._marks.append((name, time.perf_counter()))

    def seconds(self) -> dict[str, float]:
        """Time per phase name (summed when a name repeats); waits for the last mark."""
        out: dict[str, float] = {}
        if self._cuda and self._marks:
            last = self._marks[-1][1]
            assert isinstance(last, torch.cuda.Event)
            last.synchronize()
        for (_, start), (name, end) in zip(self._marks, self._marks[1:], strict=False):
            if isinstance(start, float) and isinstance(end, float):
                spent = end - start
            else:
                assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
                spent = start.elapsed_time(end) / 1000.0
            out[name] = out.get(name, 0.0) + spent
        return out
