"""What the batcher carries: one decoded event (``Delta``) and one user's share of a batch.

The types are deliberately flat (strings and ints, no schema classes) so the pipeline can be
fed from Kafka, a replay file or a test without importing the wire schemas. Each delta keeps
its source coordinates because an offset may only be committed after the effect of that
exact record is durable and published; the engine hands them back with the recommendation.

Both are ``NamedTuple``s: one ``Delta`` is built per consumed event on the event loop, and a
tuple costs a third of a frozen dataclass to build (no ``object.__setattr__`` per field).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple


class SourceOffset(NamedTuple):
    """Where a record came from: a Kafka topic-partition and the record's offset."""

    topic: str
    partition: int
    offset: int

    @property
    def tp(self) -> tuple[str, int]:
        """The topic-partition, equal (and hash-equal) to aiokafka's ``TopicPartition``."""
        return (self.topic, self.partition)


class Delta(NamedTuple):
    """One event for one user: the token it becomes and the record it came from.

    ``enqueued_at`` is stamped by the batcher from its own clock on submit, so queue delays
    are always measured on one time base.
    """

    user_id: str
    item_id: str
    action: int
    ts_ms: int
    topic: str
    partition: int
    offset: int
    enqueued_at: float = 0.0

    @property
    def source(self) -> SourceOffset:
        return SourceOffset(self.topic, self.partition, self.offset)


class UserDelta(NamedTuple):
    """All events of one user inside one batch, in application order: one model step.

    Application order is event time across the user's topic-partitions and offset order
    within each (``event_time_order``); that order is what the history store records.
    """

    user_id: str
    deltas: tuple[Delta, ...]

    @property
    def n_events(self) -> int:
        return len(self.deltas)

    @property
    def item_ids(self) -> tuple[str, ...]:
        return tuple(d.item_id for d in self.deltas)

    @property
    def actions(self) -> tuple[int, ...]:
        return tuple(d.action for d in self.deltas)

    @property
    def ts_ms(self) -> tuple[int, ...]:
        return tuple(d.ts_ms for d in self.deltas)

    @property
    def newest_ts_ms(self) -> int:
        """The newest event time: the query timestamp for ranking and the output's event time."""
        return max(d.ts_ms for d in self.deltas)

    @property
    def sources(self) -> tuple[SourceOffset, ...]:
        """Every record this step covers (what the worker completes)."""
        return tuple(d.source for d in self.deltas)

    @property
    def first_enqueued_at(self) -> float:
        return min(d.enqueued_at for d in self.deltas)


def event_time_order(deltas: Sequence[Delta]) -> tuple[Delta, ...]:
    """One user's pending events in the order their tokens are applied.

    A user's playback and interaction events arrive on two partitions, interleaved as the
    consumer happened to fetch them; replaying the same offsets after a crash may fetch
    them in another interleaving. Ordering by event time makes the history independent of
    fetch timing, as Kafka Streams' stream-time merge does: each partition's events stay in
    offset order (the history store's watermarks rely on it, and an out-of-order event time
    inside one partition is the producer's order to keep), and the partitions are merged by
    ``ts_ms``, ties broken by topic name. The bound of the wait is the batcher's
    ``max_wait_ms``: events released in different batches stay in batch order.
    """
    first = deltas[0]
    if all(d.topic == first.topic and d.partition == first.partition for d in deltas):
        return tuple(deltas)  # the common case: one partition, already in offset order
    runs: dict[tuple[str, int], list[Delta]] = {}
    for d in deltas:
        runs.setdefault((d.topic, d.partition), []).append(d)
    merged = heapq.merge(*runs.values(), key=lambda d: (d.ts_ms, d.topic, d.partition))
    return tuple(merged)
