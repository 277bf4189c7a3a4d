"""Dynamic micro-batching of per-user deltas, after Triton's dynamic batcher.

Knobs (Triton's names in brackets): ``max_batch_users`` [max batch size], ``max_wait_ms``
[max queue delay], ``max_queue_events`` [max queue size], ``release_when_idle``. A batch is
released when ``max_batch_users`` *distinct* users are pending or when the oldest pending
delta has waited ``max_wait_ms``, whichever comes first, and, with ``release_when_idle``,
at once whenever the consumer says it is idle (``set_consumer_idle``: the engine has no
step queued or running, so a batch released now starts now). Waiting out ``max_wait_ms``
buys coalescing only while the GPU is busy; under light load it was pure latency (the
whole window, ~5 ms of every event's p50), and under load the engine is never idle, so
batches still form by size and time. Every event of a user pending at release
time is coalesced into that user's one :class:`UserDelta` (one model step, one
recommendation), so a burst of a user's events costs one step, not one per event.

Backpressure is counted in events. Crossing ``queue_high_watermark`` upwards signals
*pause* and falling to ``queue_low_watermark`` signals *resume* (hysteresis: nothing is
signalled in between, so the consumer does not flap). The consumer is expected to pause
its partitions on that signal; what it already fetched still arrives, which is what the
room between the high watermark and ``max_queue_events`` absorbs. Beyond capacity
``submit`` refuses the delta (returns False, counts a reject) rather than growing without
bound or blocking the event loop: the caller still owns the record, must not mark it done,
and re-submits it after ``wait_resumed()`` (or seeks back to it).

Ordering: users are released oldest-first (by their oldest pending delta), and batches get
consecutive ``seq`` numbers. All of a user's events in batch ``n`` arrived before any of
its events in batch ``n + 1``. The batcher does not hold back a user whose previous batch is
still running; per-user order therefore rests on the engine applying batches strictly in
``seq`` order (one engine thread consuming a FIFO), which the engine must check.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass

from streamrec.errors import PipelineError
from streamrec.pipeline.clock import Clock, MonotonicClock
from streamrec.pipeline.delta import Delta, SourceOffset, UserDelta, event_time_order

PressureListener = Callable[[bool], None]  # called with True on pause, False on resume


class BatcherClosed(PipelineError):
    """The batcher was closed and everything pending has been handed out."""


class ReleaseReason(enum.Enum):
    """Why a batch left the queue (the size/time split tells whether the batcher is full)."""

    SIZE = "size"
    TIME = "time"
    IDLE = "idle"  # the consumer was idle (``release_when_idle``)
    CLOSE = "close"


@dataclass(frozen=True)
class BatcherConfig:
    """Batching and backpressure knobs. ``max_queue_events`` None means twice the high mark."""

    max_batch_users: int = 64
    max_wait_ms: float = 5.0
    queue_high_watermark: int = 8_192
    queue_low_watermark: int = 2_048
    max_queue_events: int | None = None
    release_when_idle: bool = True

    def __post_init__(self) -> None:
        if self.max_batch_users < 1:
            raise PipelineError(f"max_batch_users = {self.max_batch_users}: must be >= 1")
        if not (self.max_wait_ms >= 0 and math.isfinite(self.max_wait_ms)):
            raise PipelineError(f"max_wait_ms = {self.max_wait_ms}: must be finite and >= 0")
        if not 0 <= self.queue_low_watermark < self.queue_high_watermark:
            raise PipelineError(
                f"queue_low_watermark = {self.queue_low_watermark}, queue_high_watermark = "
                f"{self.queue_high_watermark}: need 0 <= low < high"
            )
        if self.capacity < self.queue_high_watermark:
            raise PipelineError(
                f"max_queue_events = {self.max_queue_events}: must be >= "
                f"queue_high_watermark ({self.queue_high_watermark})"
            )

    @property
    def capacity(self) -> int:
        """Most events that may be pending; ``submit`` refuses beyond it."""
        if self.max_queue_events is None:
            return 2 * self.queue_high_watermark
        return self.max_queue_events

    @property
    def max_wait_s(self) -> float:
        return self.max_wait_ms / 1000.0


@dataclass(frozen=True, slots=True)
class Batch:
    """Users released together; the engine runs them as one jagged step, in ``seq`` order."""

    seq: int
    users: tuple[UserDelta, ...]
    reason: ReleaseReason
    released_at: float
    n_events: int

    @property
    def n_users(self) -> int:
        return len(self.users)

    @property
    def oldest_wait_s(self) -> float:
        """Queue delay of the batch's oldest delta (users are ordered oldest first)."""
        return self.released_at - self.users[0].first_enqueued_at

    def queue_delays_s(self) -> list[float]:
        """Per-delta queue delay, to observe into a histogram (Triton's queue duration)."""
        return [self.released_at - d.enqueued_at for u in self.users for d in u.deltas]

    def sources(self) -> list[SourceOffset]:
        """Every record the batch covers."""
        return [d.source for u in self.users for d in u.deltas]


@dataclass(frozen=True)
class BatcherStats:
    """Cumulative counters since construction plus the current queue state."""

    submitted: int
    rejected: int
    batches: int
    released_by_size: int
    released_by_time: int
    released_by_close: int
    released_by_idle: int
    users_released: int
    events_released: int
    discarded: int
    queue_depth_events: int
    queue_depth_users: int
    max_queue_depth_events: int
    queue_delay_sum_s: float  # over released deltas
    queue_delay_max_s: float
    oldest_wait_sum_s: float  # over batches: each batch's oldest delta
    oldest_wait_max_s: float
    paused: bool
    pauses: int
    resumes: int

    @property
    def mean_batch_users(self) -> float:
        return self.users_released / self.batches if self.batches else 0.0

    @property
    def mean_queue_delay_s(self) -> float:
        return self.queue_delay_sum_s / self.events_released if self.events_released else 0.0


class MicroBatcher:
    """Bounded, coalescing queue between the Kafka consumer and the engine.

    One producer side (``submit``, synchronous, never blocks) and one consumer
    (``next_batch`` or ``async for``); both live on the same event loop.
    """

    def __init__(self, config: BatcherConfig, clock: Clock | None = None) -> None:
        self._config = config
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._pending: OrderedDict[str, list[Delta]] = OrderedDict()
        self._depth = 0
        self._wakeup = asyncio.Event()  # something changed that may release a batch
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._paused = False
        self._listeners: list[PressureListener] = []
        self._closed = False
        self._consumer_waiting = False
        self._consumer_idle = False
        self._seq = 0
        self._submitted = 0
        self._rejected = 0
        self._released = dict.fromkeys(ReleaseReason, 0)
        self._users_released = 0
        self._events_released = 0
        self._discarded = 0
        self._max_depth = 0
        self._delay_sum = 0.0
        self._delay_max = 0.0
        self._oldest_sum = 0.0
        self._oldest_max = 0.0
        self._pauses = 0
        self._resumes = 0

    @property
    def config(self) -> BatcherConfig:
        return self._config

    @property
    def depth(self) -> int:
        """Pending events (the quantity the watermarks and capacity are counted in)."""
        return self._depth

    @property
    def paused(self) -> bool:
        """True from crossing the high watermark until falling to the low watermark."""
        return self._paused

    @property
    def closed(self) -> bool:
        return self._closed

    def on_pressure(self, listener: PressureListener) -> None:
        """Call ``listener(True)`` on every pause transition and ``listener(False)`` on resume.

        Listeners run synchronously inside ``submit``/``next_batch``/``discard``, so a pause
        takes effect before the next record is fed; they must not block.
        """
        self._listeners.append(listener)

    async def wait_resumed(self) -> None:
        """Return once the queue is not paused (immediately if it is not)."""
        await self._resumed.wait()

    def set_consumer_idle(self, idle: bool) -> None:
        """The consumer says whether a batch released now would start at once; with
        ``release_when_idle`` pending users then leave without waiting for ``max_wait_ms``."""
        if idle != self._consumer_idle:
            self._consumer_idle = idle
            if idle:
                self._wakeup.set()

    def now(self) -> float:
        """The batcher's clock: what ``submit_many`` callers stamp ``enqueued_at`` with."""
        return self._clock.now()

    def submit(self, delta: Delta) -> bool:
        """Enqueue one delta, stamped now; False (and a counted reject) at capacity."""
        return self.submit_many([delta._replace(enqueued_at=self._clock.now())]) == 1

    def submit_many(self, deltas: Sequence[Delta]) -> int:
        """Enqueue deltas already stamped from ``now()`` (one stamp per fetched chunk);
        returns how many were taken: a prefix, all of them unless the queue filled up. The
        caller still owns the rest and submits them again after ``wait_resumed()``."""
        if self._closed:
            first = deltas[0] if deltas else None
            where = f" of {first.source} for user {first.user_id!r}" if first else ""
            raise BatcherClosed(f"submit{where} after close()")
        room = self._config.capacity - self._depth
        taken = deltas if len(deltas) <= room else deltas[: max(room, 0)]
        if len(taken) < len(deltas):
            self._rejected += 1
        if not taken:
            return 0
        pending = self._pending
        before = len(pending)
        for delta in taken:
            events = pending.get(delta.user_id)
            if events is None:
                pending[delta.user_id] = [delta]
            else:
                events.append(delta)
        n_users = len(pending)
        # A first pending user sets a new deadline; reaching the size limit releases now.
        if before == 0 or before < self._config.max_batch_users <= n_users:
            self._wakeup.set()
        self._depth += len(taken)
        self._submitted += len(taken)
        self._max_depth = max(self._max_depth, self._depth)
        if not self._paused and self._depth >= self._config.queue_high_watermark:
            self._set_paused(True)
        return len(taken)

    async def next_batch(self) -> Batch:
        """Wait for and return the next batch; raises :class:`BatcherClosed` once drained.

        After ``close()`` whatever is pending is released at once (reason CLOSE), in
        batches of at most ``max_batch_users`` users, without waiting for ``max_wait_ms``.
        """
        if self._consumer_waiting:
            raise PipelineError("next_batch() is already being awaited: one consumer only")
        self._consumer_waiting = True
        try:
            while True:
                now = self._clock.now()
                if len(self._pending) >= self._config.max_batch_users:
                    return self._release(ReleaseReason.SIZE, now)
                deadline = math.inf
                if self._pending:
                    if self._closed:
                        return self._release(ReleaseReason.CLOSE, now)
                    deadline = self._oldest_enqueued_at() + self._config.max_wait_s
                    if now >= deadline:
                        return self._release(ReleaseReason.TIME, now)
                    if self._consumer_idle and self._config.release_when_idle:
                        return self._release(ReleaseReason.IDLE, now)
                elif self._closed:
                    raise BatcherClosed("the batcher is closed and drained")
                self._wakeup.clear()
                await self._clock.wait_until(deadline, self._wakeup)
        finally:
            self._consumer_waiting = False

    def __aiter__(self) -> AsyncIterator[Batch]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Batch]:
        while True:
            try:
                batch = await self.next_batch()
            except BatcherClosed:
                return
            yield batch

    def close(self) -> None:
        """Refuse further submits; the consumer drains what is pending, then stops."""
        self._closed = True
        self._wakeup.set()

    def discard(self, partitions: Collection[tuple[str, int]]) -> int:
        """Drop pending deltas of these topic-partitions (revoked); returns how many.

        Their offsets were never done, so they are not committed and the partitions' next
        owner re-reads them.
        """
        wanted = set(partitions)
        dropped = 0
        for user_id in list(self._pending):
            events = self._pending[user_id]
            kept = [d for d in events if (d.topic, d.partition) not in wanted]
            dropped += len(events) - len(kept)
            if kept:
                self._pending[user_id] = kept
            else:
                del self._pending[user_id]
        self._depth -= dropped
        self._discarded += dropped
        self._maybe_resume()
        self._wakeup.set()
        return dropped

    def stats(self) -> BatcherStats:
        return BatcherStats(
            submitted=self._submitted,
            rejected=self._rejected,
            batches=self._seq,
            released_by_size=self._released[ReleaseReason.SIZE],
            released_by_time=self._released[ReleaseReason.TIME],
            released_by_close=self._released[ReleaseReason.CLOSE],
            released_by_idle=self._released[ReleaseReason.IDLE],
            users_released=self._users_released,
            events_released=self._events_released,
            discarded=self._discarded,
            queue_depth_events=self._depth,
            queue_depth_users=len(self._pending),
            max_queue_depth_events=self._max_depth,
            queue_delay_sum_s=self._delay_sum,
            queue_delay_max_s=self._delay_max,
            oldest_wait_sum_s=self._oldest_sum,
            oldest_wait_max_s=self._oldest_max,
            paused=self._paused,
            pauses=self._pauses,
            resumes=self._resumes,
        )

    def _oldest_enqueued_at(self) -> float:
        # The first user in the ordered dict holds the oldest pending delta: users enter in
        # order of their first pending event and batches always take a prefix.
        first = next(iter(self._pending.values()))
        return first[0].enqueued_at

    def _release(self, reason: ReleaseReason, now: float) -> Batch:
        n = min(len(self._pending), self._config.max_batch_users)
        users: list[UserDelta] = []
        n_events = 0
        for _ in range(n):
            user_id, events = self._pending.popitem(last=False)
            users.append(UserDelta(user_id, event_time_order(events)))
            n_events += len(events)
            for d in events:
                delay = now - d.enqueued_at
                self._delay_sum += delay
                self._delay_max = max(self._delay_max, delay)
        batch = Batch(
            seq=self._seq,
            users=tuple(users),
            reason=reason,
            released_at=now,
            n_events=n_events,
        )
        self._seq += 1
        self._released[reason] += 1
        self._users_released += n
        self._events_released += n_events
        self._depth -= n_events
        oldest = batch.oldest_wait_s
        self._oldest_sum += oldest
        self._oldest_max = max(self._oldest_max, oldest)
        self._maybe_resume()
        return batch

    def _maybe_resume(self) -> None:
        if self._paused and self._depth <= self._config.queue_low_watermark:
            self._set_paused(False)

    def _set_paused(self, paused: bool) -> None:
        self._paused = paused
        if paused:
            self._pauses += 1
            self._resumed.clear()
        else:
            self._resumes += 1
            self._resumed.set()
        for listener in self._listeners:
            listener(paused)
