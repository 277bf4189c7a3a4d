"""Time as an injected dependency, so batching deadlines can be tested without sleeping.

The batcher never calls ``time`` or ``asyncio.sleep`` directly: it asks its clock for
``now()`` and waits with ``wait_until(deadline, event)``. In production that is the
monotonic clock; in tests a :class:`FakeClock` whose time only moves when the test calls
``advance()``, which also runs every waiter whose deadline has come, in deadline order. A
test therefore decides exactly which timers fire before which submission, and the result
does not depend on how fast or loaded the machine is.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from typing import Any, Protocol

from streamrec.errors import PipelineError


class Clock(Protocol):
    """Monotonic seconds plus a deadline-aware wait; implemented by both clocks below."""

    def now(self) -> float:
        """Seconds on a monotonic scale (only differences are meaningful)."""
        ...

    async def wait_until(self, deadline: float, event: asyncio.Event | None = None) -> bool:
        """Wait until ``now() >= deadline`` or ``event`` is set, whichever comes first.

        Returns True when the event is set (also if it already was), False on the deadline.
        ``deadline`` may be ``math.inf`` (wait for the event only).
        """
        ...

    async def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass on this clock."""
        ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` and the event loop's timers."""

    def now(self) -> float:
        return time.monotonic()

    async def wait_until(self, deadline: float, event: asyncio.Event | None = None) -> bool:
        if event is not None and event.is_set():
            return True
        if event is None:
            await self.sleep(deadline - self.now())
            return False
        delay = deadline - self.now()
        if delay <= 0:
            return False
        if math.isinf(delay):
            await event.wait()
            return True
        try:
            async with asyncio.timeout(delay):
                await event.wait()
        except TimeoutError:
            return event.is_set()
        return True

    async def sleep(self, seconds: float) -> None:
        if math.isinf(seconds):
            raise PipelineError(f"cannot sleep for {seconds} s")
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that stands still until the test moves it.

    ``advance(seconds)`` walks through the registered deadlines in order: for each one it
    sets ``now()`` to that deadline, wakes its waiter and lets the event loop run the woken
    tasks (``settle_yields`` turns of the loop) before the next deadline, so a waiter that
    registers a new deadline inside the advanced span is also honoured. Waiters with the
    same deadline wake in registration order. Nothing here reads the real time.
    """

    def __init__(self, start: float = 0.0, settle_yields: int = 16) -> None:
        if settle_yields < 1:
            raise PipelineError(f"settle_yields = {settle_yields}: must be >= 1")
        self._now = start
        self._settle_yields = settle_yields
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    @property
    def pending_timers(self) -> int:
        """Deadlines still registered and not yet abandoned (to assert nothing is left)."""
        return sum(1 for _, _, fut in self._timers if not fut.done())

    async def wait_until(self, deadline: float, event: asyncio.Event | None = None) -> bool:
        if event is not None and event.is_set():
            return True
        if deadline <= self._now:
            return False
        loop = asyncio.get_running_loop()
        timer: asyncio.Future[None] = loop.create_future()
        if not math.isinf(deadline):
            heapq.heappush(self._timers, (deadline, next(self._seq), timer))
        waiters: list[asyncio.Future[Any]] = [timer]
        event_task: asyncio.Task[bool] | None = None
        if event is not None:
            event_task = asyncio.ensure_future(event.wait())
            waiters.append(event_task)
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()  # lazily dropped from the heap
            if event_task is not None and not event_task.done():
                event_task.cancel()
                await asyncio.wait([event_task])
        return event is not None and event.is_set()

    async def sleep(self, seconds: float) -> None:
        if math.isinf(seconds):
            raise PipelineError(f"cannot sleep for {seconds} s")
        await self.wait_until(self._now + max(0.0, seconds))

    async def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``, firing every deadline on the way, in order."""
        if seconds < 0 or math.isnan(seconds):
            raise PipelineError(f"cannot advance a clock by {seconds} s")
        target = self._now + seconds
        await self.settle()
        while self._timers and self._timers[0][0] <= target:
            deadline, _, timer = heapq.heappop(self._timers)
            if timer.done():
                continue
            self._now = max(self._now, deadline)
            timer.set_result(None)
            await self.settle()
        self._now = target
        await self.settle()

    async def settle(self) -> None:
        """Give ready tasks a few turns of the event loop without moving time."""
        for _ in range(self._settle_yields):
            await asyncio.sleep(0)
