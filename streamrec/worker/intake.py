"""Fetched records to the batcher: track, decode, route, with backpressure.

Per fetched chunk of one partition (the unit aiokafka hands over), in this order: track
every offset the moment it is read (``OffsetTracker.track_many``), decode the chunk
(``decode_batch``: one bad record never costs the others), reject event times too far
ahead (``EventTimePolicy``), submit the valid events as deltas stamped with one clock
read, and send the rejects to the dead-letter topic, each completing its offset once
acknowledged. When the batcher is full the chunk's remainder waits for it to resume
(the consumer has paused the partitions by then); a revoke meanwhile drops the rest,
which the partition's next owner reads again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass

from streamrec.pipeline.delta import Delta
from streamrec.pipeline.micro_batcher import MicroBatcher
from streamrec.schemas.codec import ConsumedRecord, RejectedRecord, decode_batch
from streamrec.schemas.events import EventKind
from streamrec.schemas.records import DeadLetter
from streamrec.worker.config import TopicsConfig
from streamrec.worker.event_time_policy import EventTimePolicy
from streamrec.worker.metrics import WorkerMetrics
from streamrec.worker.offset_tracker import OffsetTracker
from streamrec.worker.publisher import Publisher

TP = tuple[str, int]


@dataclass
class IntakeStats:
    consumed: int = 0
    invalid: int = 0
    dead_letters: int = 0


class Intake:
    def __init__(
        self,
        topics: TopicsConfig,
        tracker: OffsetTracker,
        batcher: MicroBatcher,
        publisher: Publisher,
        metrics: WorkerMetrics,
        owns: Callable[[TP], bool],
        stopping: asyncio.Event,
    ) -> None:
        self._kinds = {
            topics.playback: EventKind.PLAYBACK,
            topics.interaction: EventKind.INTERACTION,
        }
        self._max_bytes = topics.max_record_bytes
        self._time_policy = EventTimePolicy(topics.max_future_skew_ms)
        self._tracker = tracker
        self._batcher = batcher
        self._publisher = publisher
        self._metrics = metrics
        self._owns = owns
        self._stopping = stopping
        self.stats = IntakeStats()

    async def take(self, tp: TP, records: Sequence[ConsumedRecord]) -> None:
        """One partition's fetched records, in offset order."""
        if not records or not self._owns(tp):
            return  # fetched before a revoke: the partition's next owner reads it again
        topic, partition = tp
        generation = self._tracker.track_many(tp, [r.offset for r in records])
        self.stats.consumed += len(records)
        self._metrics.consumed(topic, len(records))
        decoded = decode_batch(records, self._kinds[topic], self._max_bytes)
        events, too_new = self._time_policy.split(decoded.events, records, int(time.time() * 1000))
        now = self._batcher.now()
        deltas = [
            Delta(e.user_id, e.item_id, e.token_action, e.ts_ms, topic, partition, off, now)
            for e, _, _, off in events
        ]
        while deltas:
            taken = self._batcher.submit_many(deltas)
            deltas = deltas[taken:]
            if deltas:  # over capacity: wait for the engine
                await _wait_either(self._batcher.wait_resumed(), self._stopping)
                if self._stopping.is_set() or not self._owns(tp):
                    return
        errors = [*decoded.errors, *too_new]
        if errors:
            await self._dead_letter(tp, errors, generation)

    async def _dead_letter(self, tp: TP, errors: list[RejectedRecord], generation: int) -> None:
        self.stats.invalid += len(errors)
        counts: dict[str, int] = {}
        for rejected in errors:
            counts[rejected.kind.value] = counts.get(rejected.kind.value, 0) + 1
        self._metrics.invalid(tp[0], counts)
        now_ms = int(time.time() * 1000)
        for rejected in errors:
            if not self._owns(tp):
                return
            offset = rejected.record.offset

            def acked(offset: int = offset) -> None:
                self.stats.dead_letters += 1
                self._metrics.dead_letter_acked()
                self._tracker.done(tp, offset, generation)

            await self._publisher.dead_letter(DeadLetter.from_rejected(rejected, now_ms), acked)


async def _wait_either(coro: Coroutine[object, object, None], event: asyncio.Event) -> None:
    """Wait until ``coro`` finishes or ``event`` is set, whichever comes first."""
    first = asyncio.ensure_future(coro)
    second = asyncio.ensure_future(event.wait())
    _, pending = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
