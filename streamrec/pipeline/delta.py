"""What the batcher carries: one decoded event (``Delta``) and one user's share of a batch.

The types are deliberately flat (strings and ints, no schema classes) so the pipeline can be
fed from Kafka, a replay file or a test without importing the wire schemas. Each delta keeps
its source coordinates because an offset may only be committed after the effect of that
exact record is durable and published; the engine hands them back with the recommendation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from streamrec.errors import PipelineError


class SourceOffset(NamedTuple):
    """Where a record came from: a Kafka topic-partition and the record's offset."""

    topic: str
    partition: int
    offset: int

    @property
    def tp(self) -> tuple[str, int]:
        """The topic-partition, equal (and hash-equal) to aiokafka's ``TopicPartition``."""
        return (self.topic, self.partition)


class TokenEvent(Protocol):
    """The few attributes of a decoded event that become a token (schemas satisfy it)."""

    @property
    def user_id(self) -> str: ...

    @property
    def item_id(self) -> str: ...

    @property
    def ts_ms(self) -> int: ...

    @property
    def token_action(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Delta:
    """One event for one user: the token it becomes and the record it came from.

    ``enqueued_at`` is stamped by the batcher from its own clock on ``submit`` (whatever the
    caller put there is replaced), so queue delays are always measured on one time base.
    """

    user_id: str
    item_id: str
    action: int
    ts_ms: int
    topic: str
    partition: int
    offset: int
    enqueued_at: float = 0.0

    @classmethod
    def from_event(cls, event: TokenEvent, topic: str, partition: int, offset: int) -> Delta:
        return cls(
            user_id=event.user_id,
            item_id=event.item_id,
            action=int(event.token_action),
            ts_ms=event.ts_ms,
            topic=topic,
            partition=partition,
            offset=offset,
        )

    @property
    def source(self) -> SourceOffset:
        return SourceOffset(self.topic, self.partition, self.offset)


@dataclass(frozen=True, slots=True)
class UserDelta:
    """All events of one user inside one batch, in arrival order: one model step.

    Arrival order is the per-partition offset order (a user's records of one topic sit in
    one partition), interleaved across the user's topics as the consumer delivered them;
    the history store orders and de-duplicates tokens, the batcher only preserves order.
    """

    user_id: str
    deltas: tuple[Delta, ...]

    def __post_init__(self) -> None:
        if not self.deltas:
            raise PipelineError(f"UserDelta for user {self.user_id!r} has no events")

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
        """Every record this step covers, in arrival order (what the worker completes)."""
        return tuple(d.source for d in self.deltas)

    @property
    def first_enqueued_at(self) -> float:
        return self.deltas[0].enqueued_at
