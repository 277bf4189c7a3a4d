"""The bench's event-loop profiler: handle times attributed to the right coroutines."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.loop_profiler import LoopProfiler, busy_share, merge, summary


async def hog(seconds: float, chunk_s: float) -> None:
    """Holds the loop ``chunk_s`` at a time (busy, never awaiting inside a chunk)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < chunk_s:
            pass
        await asyncio.sleep(0.001)


async def idle(seconds: float) -> None:
    await asyncio.sleep(seconds)


def test_busy_coroutines_get_their_time_and_waiting_is_not_busy() -> None:
    profiler = LoopProfiler()

    async def main() -> None:
        profiler.start()
        with pytest.raises(RuntimeError, match="already profiling"):
            profiler.start()
        await asyncio.gather(hog(0.3, 0.004), idle(0.3))
        times = profiler.stop()
        assert not profiler.running and profiler.stop() == {}
        assert times["hog"].total_s > 0.2  # ~80 % of its 0.3 s held the loop
        assert times["hog"].max_s >= 0.004
        assert times.get("idle") is None or times["idle"].total_s < 0.01
        row = summary(times, profiler.wall_s)
        assert row["callbacks"][0]["name"] == "hog"
        assert 0.6 < row["busy_share"] <= 1.0
        assert busy_share(times, profiler.wall_s) == pytest.approx(row["busy_share"], abs=1e-3)

    asyncio.run(main())
    # the loop's own method is restored: a later loop runs unprofiled
    assert asyncio.run(idle(0.01)) is None


def test_time_goes_to_the_task_and_processes_merge() -> None:
    """A handle is named after its task's coroutine (the App's loops are tasks), not the
    coroutine it awaits inside."""
    profiler = LoopProfiler()
    got = {}

    async def main() -> None:
        profiler.start()
        await asyncio.create_task(hog(0.05, 0.002))
        await hog(0.05, 0.002)  # inside main's own task
        got.update(profiler.stop())

    asyncio.run(main())
    one = dict(got)
    assert one["hog"].total_s > 0.02
    assert one["test_time_goes_to_the_task_and_processes_merge.<locals>.main"].total_s > 0.02
    both = merge([one, one])
    assert both["hog"].count == 2 * one["hog"].count
    assert both["hog"].total_s == pytest.approx(2 * one["hog"].total_s)
    assert both["hog"].max_s == one["hog"].max_s
