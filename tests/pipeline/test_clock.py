"""The fake clock fires deadlines in order; the real clock honours events and timeouts."""

from __future__ import annotations

import asyncio
import math

import pytest

from streamrec.errors import PipelineError
from streamrec.pipeline.clock import FakeClock, MonotonicClock


async def test_fake_clock_fires_deadlines_in_order_at_their_own_time():
    clock = FakeClock(start=10.0)
    fired: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        fired.append((name, clock.now()))

    tasks = [asyncio.create_task(sleeper(n, s)) for n, s in [("b", 2.0), ("a", 1.0), ("c", 5.0)]]
    await clock.advance(3.0)
    assert fired == [("a", 11.0), ("b", 12.0)]
    assert clock.now() == 13.0
    await clock.advance(2.0)
    assert fired[-1] == ("c", 15.0)
    await asyncio.gather(*tasks)
    assert clock.pending_timers == 0


async def test_fake_clock_honours_deadlines_registered_inside_an_advance():
    clock = FakeClock()
    times: list[float] = []

    async def ticker() -> None:
        for _ in range(3):
            await clock.sleep(1.0)
            times.append(clock.now())

    task = asyncio.create_task(ticker())
    await clock.advance(10.0)
    assert times == [1.0, 2.0, 3.0]
    await task


async def test_fake_clock_wait_until_returns_on_event_or_deadline():
    clock = FakeClock()
    event = asyncio.Event()
    waiter = asyncio.create_task(clock.wait_until(5.0, event))
    await clock.advance(1.0)
    event.set()
    await clock.settle()
    assert waiter.result() is True
    assert clock.pending_timers == 0

    event.clear()
    waiter = asyncio.create_task(clock.wait_until(2.0, event))
    await clock.advance(1.0)
    assert waiter.result() is False
    assert await clock.wait_until(0.0, event) is False  # deadline already passed
    event.set()
    assert await clock.wait_until(math.inf, event) is True


async def test_fake_clock_refuses_to_go_backwards():
    with pytest.raises(PipelineError, match="-1"):
        await FakeClock().advance(-1.0)


async def test_monotonic_clock_waits_for_the_event_or_times_out():
    clock = MonotonicClock()
    event = asyncio.Event()
    assert await clock.wait_until(clock.now() + 0.01, event) is False
    asyncio.get_running_loop().call_soon(event.set)
    assert await clock.wait_until(clock.now() + 5.0, event) is True
    assert await clock.wait_until(math.inf, event) is True
    assert clock.now() <= clock.now()
