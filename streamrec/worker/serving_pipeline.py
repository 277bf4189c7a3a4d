"""Batches from the batcher to acknowledged recommendations, three stages overlapped.

    prepare n+1 (event loop)  ─┐
    execute n   (engine thread, GPU)   ← the step the GPU is busy with
    publish n-1 (event loop)  ─┘  encode to bytes, hand to the producer

``prepare`` (history append, plan, history reads of rebuilt users) runs ahead of the
step; a prepared batch is handed to the engine thread at once, so the thread runs step
after step without a round trip through the event loop. At most two batches are taken and
not yet executed (one executing, one prepared behind it): while the engine is saturated
the next batch stays in the batcher and grows there, one larger step instead of several
small ones queued; while no step is pending the batcher releases at once
(``set_consumer_idle``). ``publish`` of a finished batch runs while the engine thread
executes the next one, so neither the store round trip nor result encoding leaves the GPU
idle. Order still holds where it matters: batches execute one at a time in batcher order (per-user
token order), are published in that order (per-user output order), and an offset is
done only when its append is durable (``prepare`` returned) and its record acknowledged
(the producer's callback), quoting the generation its partition had when the batch was
taken, so a batch begun before a rebalance never completes a record re-read after it.

``hold()`` stops taking new batches and waits until every batch taken has been published
(the rebalance hand-over needs an idle engine); ``release()`` lets batches flow again.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from streamrec.pipeline.delta import UserDelta
from streamrec.pipeline.engine import BatchResult, Engine, PreparedBatch
from streamrec.pipeline.micro_batcher import Batch, BatcherClosed, MicroBatcher
from streamrec.schemas.records import Recommendation
from streamrec.schemas.wire import WireFormat
from streamrec.worker.metrics import WorkerMetrics
from streamrec.worker.offset_tracker import OffsetTracker
from streamrec.worker.publisher import Publisher

TP = tuple[str, int]
Generations = dict[TP, int | None]
_TRACES = 4096  # batch traces kept for the latency split (bench, debugging)
_STEPS_AHEAD = 2  # steps handed to the engine thread before the oldest is published
# Batches taken from the batcher whose step has not finished: one executing, one prepared
# behind it. The next batch is taken only when one of them is done, so that while the
# engine is saturated events coalesce in the batcher into one larger step instead of
# queueing as many small ones (each with its own fixed cost) behind it.
_UNEXECUTED_MAX = 2


@dataclass(frozen=True, slots=True)
class Published:
    """One acknowledged recommendation, as the ``on_published`` hook sees it."""

    user_id: str
    version: int
    value: bytes
    fmt: WireFormat
    latency_s: float  # batcher enqueue of the user's oldest event -> broker ack

    def recommendation(self) -> Recommendation:
        """The validated record (decodes ``value``: off the hot path)."""
        return Recommendation.from_bytes(self.value, self.fmt)


PublishedHook = Callable[[Published], None]


@dataclass(slots=True)
class BatchTrace:
    """When one batch passed each stage (``time.monotonic`` seconds): the latency split.

    ``queue_waits`` is per event (batcher enqueue -> release); the rest is per batch:
    ``prepared`` (appended and planned), ``taken`` (handed to the engine thread),
    ``executed`` (step done), ``encode_s`` (arrays -> bytes), ``handed`` (given to the
    producer), ``acked`` (the last acknowledgement of its records).
    """

    n_events: int
    queue_waits: np.ndarray  # [events] seconds
    released: float
    prepared: float = 0.0
    taken: float = 0.0
    executed: float = 0.0
    encode_s: float = 0.0
    handed: float = 0.0
    acked: float = 0.0


@dataclass
class PipelineStats:
    """Counters plus the traces of the newest batches (bounded)."""

    batches: int = 0
    published: int = 0
    traces: deque[BatchTrace] = field(default_factory=lambda: deque(maxlen=_TRACES))


@dataclass
class _InFlight:
    batch: Batch
    generations: Generations
    trace: BatchTrace
    prepared: PreparedBatch | None = None
    step: asyncio.Task[BatchResult] | None = None


class ServingPipeline:
    def __init__(
        self,
        engine: Engine,
        batcher: MicroBatcher,
        tracker: OffsetTracker,
        publisher: Publisher,
        metrics: WorkerMetrics,
        same_log: Callable[[], Awaitable[bool]],
        on_published: PublishedHook | None = None,
    ) -> None:
        self._engine = engine
        self._batcher = batcher
        self._tracker = tracker
        self._publisher = publisher
        self._metrics = metrics
        self._same_log = same_log
        self._on_published = on_published
        self._fmt = publisher.output_format
        self._clock = batcher.now
        self._queue: asyncio.Queue[_InFlight | None] = asyncio.Queue(maxsize=1)
        self._stepping: asyncio.Queue[_InFlight | None] = asyncio.Queue(maxsize=_STEPS_AHEAD)
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0
        self._unexecuted = 0  # batches taken whose step has not finished
        self._room = asyncio.Event()  # set while _unexecuted < _UNEXECUTED_MAX
        self._room.set()
        batcher.set_consumer_idle(True)
        self._taken_seq = -1
        self._finished_seq = -1
        self._progress = asyncio.Condition()
        self.last_step_at = time.monotonic()
        self.stats = PipelineStats()

    async def run(self) -> None:
        """Until the batcher is closed and everything taken from it is published."""
        loops = [
            asyncio.create_task(self._prepare_loop(), name="streamrec-prepare"),
            asyncio.create_task(self._submit_loop(), name="streamrec-submit"),
        ]
        try:
            await self._publish_loop()
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

    async def hold(self, timeout_s: float) -> bool:
        """Take no new batch; True once every batch taken is published (within timeout)."""
        self._open.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def release(self) -> None:
        self._open.set()

    @property
    def last_taken_seq(self) -> int:
        """The batcher seq of the newest batch taken (-1 before the first)."""
        return self._taken_seq

    async def finished_through(self, seq: int) -> None:
        """Wait until every batch up to ``seq`` is finished (batches finish in order)."""
        async with self._progress:
            await self._progress.wait_for(lambda: self._finished_seq >= seq)

    # ------------------------------------------------------------------ stages

    async def _prepare_loop(self) -> None:
        while True:
            await self._open.wait()
            await self._room.wait()
            try:
                batch = await self._batcher.next_batch()
            except BatcherClosed:
                await self._queue.put(None)
                return
            self._in_flight += 1
            self._unexecuted += 1
            if self._unexecuted >= _UNEXECUTED_MAX:
                self._room.clear()
            self._batcher.set_consumer_idle(False)
            self._taken_seq = batch.seq
            self._idle.clear()
            tps = {d.source.tp for u in batch.users for d in u.deltas}
            # Every delta of a tp here was tracked in the tp's current generation: a
            # revoke discards the queued deltas of its partitions.
            generations = {tp: self._tracker.generation(tp) for tp in tps}
            waits = np.array(
                [batch.released_at - d.enqueued_at for u in batch.users for d in u.deltas]
            )
            item = _InFlight(
                batch, generations, BatchTrace(batch.n_events, waits, time.monotonic())
            )
            if not await self._same_log():
                self._executed(item.trace, None)  # never applied: re-read from the new log
                await self._finished(batch.seq)
                continue
            item.prepared = await self._engine.prepare(batch)
            item.trace.prepared = time.monotonic()
            await self._queue.put(item)

    async def _submit_loop(self) -> None:
        """Hand each prepared batch to the engine thread at once: its one worker runs the
        steps in submission order, back to back, without waiting on this loop."""
        while True:
            item = await self._queue.get()
            if item is None:
                await self._stepping.put(None)
                return
            assert item.prepared is not None
            item.trace.taken = time.monotonic()
            item.step = asyncio.create_task(self._engine.execute(item.prepared))
            item.step.add_done_callback(functools.partial(self._executed, item.trace))
            await self._stepping.put(item)  # bounded: at most STEPS_AHEAD steps queued

    async def _publish_loop(self) -> None:
        while True:
            item = await self._stepping.get()
            if item is None:
                return
            assert item.step is not None
            result = await item.step
            self.last_step_at = time.monotonic()
            self._account(item)
            await self._publish(item, result)

    def _executed(self, trace: BatchTrace, _: object) -> None:
        """A step finished (or its batch was dropped): with none left the engine is idle,
        and the batcher may release what is pending at once."""
        trace.executed = time.monotonic()
        self._unexecuted -= 1
        if self._unexecuted < _UNEXECUTED_MAX:
            self._room.set()
        if self._unexecuted == 0:
            self._batcher.set_consumer_idle(True)

    async def _finished(self, seq: int) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()
        async with self._progress:
            self._finished_seq = seq
            self._progress.notify_all()

    # ------------------------------------------------------------------ publish

    async def _publish(self, item: _InFlight, result: BatchResult) -> None:
        """Encode, hand to the producer; the batch is finished once it is handed over."""
        try:
            await self._hand_over(item, result)
        finally:
            await self._finished(item.batch.seq)

    async def _hand_over(self, item: _InFlight, result: BatchResult) -> None:
        trace = item.trace
        started = time.perf_counter()
        output = result.output
        values = output.encode(self._fmt)
        trace.encode_s = time.perf_counter() - started
        generations = item.generations
        tracker = self._tracker
        stale = {tp for tp, g in generations.items() if tracker.generation(tp) != g}
        records: list[tuple[bytes, bytes]] = []
        covered: list[tuple[UserDelta, int]] = []
        for ud, row in zip(result.batch.users, result.recommendation_rows(), strict=True):
            if stale and any(d.source.tp in stale for d in ud.deltas):
                continue  # a partition of this user was revoked: the new owner redoes it
            if row is None:
                self._complete(ud, generations)  # no history at all: nothing to publish
                continue
            records.append((ud.user_id.encode(), values[row]))
            covered.append((ud, row))
        if records:
            versions = output.versions

            def acked(indices: Sequence[int]) -> None:
                now = self._clock()
                for i in indices:
                    ud, row = covered[i]
                    latency = now - ud.first_enqueued_at
                    self._metrics.recommendation_acked(latency)
                    self._complete(ud, generations)
                    if self._on_published is not None:
                        self._on_published(
                            Published(
                                ud.user_id, int(versions[row]), values[row], self._fmt, latency
                            )
                        )
                self.stats.published += len(indices)
                trace.acked = time.monotonic()

            await self._publisher.publish(records, acked)
        trace.handed = time.monotonic()

    def _complete(self, ud: UserDelta, generations: Generations) -> None:
        for d in ud.deltas:
            generation = generations[(d.topic, d.partition)]
            if generation is not None:
                self._tracker.done((d.topic, d.partition), d.offset, generation)

    def _account(self, item: _InFlight) -> None:
        t = item.trace
        self.stats.batches += 1
        self.stats.traces.append(t)
        phases = {
            "prepare": t.prepared - t.released,
            "pipeline_wait": t.taken - t.prepared,
            "execute": t.executed - t.taken,
        }
        self._metrics.observe_batch(item.batch, self._engine.stats().phase_seconds, phases)
