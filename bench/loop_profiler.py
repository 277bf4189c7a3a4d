"""What a worker's event loop spends one bench phase on, callback by callback.

The issue 13 runs left one question open. In the paced phases most of an event's
event-to-publish time passes before the batcher: the e2p p99 is 7 to 8 times the workers'
own p99 with MPS at 10,000 events/s. So what does each worker's event loop do then?

A sampling profiler answers badly from inside the process: another thread can only be
seen where it drops the GIL, so the loop's waits in ``select`` are over-counted (a test
sampler saw 0 of 77 samples in a coroutine that held the loop 80 % of the time, at the
default switch interval). py-spy sees the whole run, set-up included.

``LoopProfiler`` instead times every handle the loop runs: it wraps
``asyncio.events.Handle._run`` while started. It reports wall time per callback, named
after the coroutine of the task it steps (``Intake.take``, ``ServingPipeline._publish``,
aiokafka's fetcher...) or the plain callback. That time includes any wait for the GIL
inside the callback, which is the cost the loop pays while the engine thread runs Python.
The overhead is two clock reads per handle. Bench-only: the worker never imports it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class CallbackTime:
    """Handles of one name: how many ran, their total and longest wall time."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0


class LoopProfiler:
    """Times the handles of every event loop in this process between start and stop.

    Only one can be started per process at a time (it patches the class method)."""

    def __init__(self) -> None:
        self._times: dict[str, CallbackTime] = {}
        self._original: Callable[[asyncio.Handle], None] | None = None
        self._started = 0.0
        self.wall_s = 0.0

    @property
    def running(self) -> bool:
        return self._original is not None

    def start(self) -> None:
        if self._original is not None:
            raise RuntimeError("LoopProfiler.start() while already profiling")
        original = asyncio.events.Handle._run
        if getattr(original, "_loop_profiler", False):
            raise RuntimeError("another LoopProfiler is running in this process")
        times: dict[str, CallbackTime] = {}
        clock = time.perf_counter

        def timed_run(handle: asyncio.Handle) -> None:
            t0 = clock()
            try:
                original(handle)
            finally:
                spent = clock() - t0
                name = callback_name(handle)
                entry = times.get(name)
                if entry is None:
                    entry = times[name] = CallbackTime()
                entry.count += 1
                entry.total_s += spent
                entry.max_s = max(entry.max_s, spent)

        timed_run._loop_profiler = True  # type: ignore[attr-defined]
        self._times, self._original = times, original
        self._started = clock()
        asyncio.events.Handle._run = timed_run  # type: ignore[method-assign,assignment]

    def stop(self) -> dict[str, CallbackTime]:
        """Time per callback name since ``start`` (``wall_s`` holds the window)."""
        if self._original is None:
            return {}
        asyncio.events.Handle._run = self._original  # type: ignore[method-assign,assignment]
        self._original = None
        self.wall_s = time.perf_counter() - self._started
        return self._times


def callback_name(handle: asyncio.Handle) -> str:
    """The coroutine a task step runs (``Class.method``), else the callback's own name."""
    callback: Any = handle._callback  # type: ignore[attr-defined]
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        coro: Any = owner.get_coro()
        return getattr(coro, "__qualname__", None) or type(coro).__name__
    func = getattr(callback, "__func__", callback)
    return getattr(func, "__qualname__", None) or repr(callback)


def busy_share(times: dict[str, CallbackTime], wall_s: float) -> float:
    """The share of the window the loop spent running callbacks (the rest: waiting)."""
    return sum(t.total_s for t in times.values()) / wall_s if wall_s > 0 else 0.0


def summary(times: dict[str, CallbackTime], wall_s: float, top: int = 10) -> dict[str, Any]:
    """The loop's busy share and its ``top`` callbacks by total time: share of the window,
    count, mean and max ms: a bench row's ``loop_profile``."""
    ranked = sorted(times.items(), key=lambda kv: -kv[1].total_s)[:top]
    return {
        "wall_s": round(wall_s, 3),
        "busy_share": round(busy_share(times, wall_s), 3),
        "callbacks": [
            {
                "name": name,
                "share": round(t.total_s / wall_s, 4) if wall_s > 0 else 0.0,
                "count": t.count,
                "mean_ms": round(1000 * t.total_s / t.count, 3),
                "max_ms": round(1000 * t.max_s, 2),
            }
            for name, t in ranked
        ],
    }


def merge(parts: list[dict[str, CallbackTime]]) -> dict[str, CallbackTime]:
    """Several processes' times as one (counts and totals add; the longest is kept)."""
    out: dict[str, CallbackTime] = {}
    for part in parts:
        for name, t in part.items():
            entry = out.setdefault(name, CallbackTime())
            entry.count += t.count
            entry.total_s += t.total_s
            entry.max_s = max(entry.max_s, t.max_s)
    return out
