"""What the worker does with event times that are out of order or far in the future.

The rules (README "Event times"):

- **Out of order is accepted.** A user's events are applied in event-time order across
  its two partitions and in offset order within each, over the events the batcher
  holds together (``pipeline.delta.event_time_order``); an event time that goes back
  inside one partition, or across batches, is applied where it arrived. The model does
  not need more: its time bias buckets ``|Δt|``, so a key older or newer than the query
  is equally well defined, and the offline recompute reads the tokens in the order the
  history store applied them.
- **Far future is rejected.** A ``ts_ms`` more than ``max_future_skew_ms`` ahead of the
  worker's wall clock is a broken producer clock or a unit mix-up (µs for ms); kept, it
  would stay the user's newest time for as long as the skew lasts. Such a record goes to
  the dead-letter topic with kind ``out_of_range`` and a reason that names the value and
  the bound; its offset completes once the dead letter is acknowledged.
- A recommendation's ``last_event_ts_ms`` is the largest ``ts_ms`` among the events of
  the step that produced it (``UserDelta.newest_ts_ms``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from streamrec.errors import ConfigError
from streamrec.schemas.codec import ConsumedRecord, DecodedEvent, RejectedRecord
from streamrec.schemas.validation import ErrorKind


@dataclass(frozen=True)
class EventTimePolicy:
    max_future_skew_ms: int

    def __post_init__(self) -> None:
        if self.max_future_skew_ms <= 0:
            raise ConfigError(f"max_future_skew_ms must be > 0, got {self.max_future_skew_ms}")

    def split(
        self, events: Sequence[DecodedEvent], records: Sequence[ConsumedRecord], now_ms: int
    ) -> tuple[list[DecodedEvent], list[RejectedRecord]]:
        """``events`` (decoded from ``records``) into those to apply and those too far ahead."""
        bound = now_ms + self.max_future_skew_ms
        if all(item.event.ts_ms <= bound for item in events):  # the common case: no copies
            return list(events), []
        by_offset = {record.offset: record for record in records}
        kept: list[DecodedEvent] = []
        rejected: list[RejectedRecord] = []
        for item in events:
            ts = item.event.ts_ms
            if ts <= bound:
                kept.append(item)
                continue
            reason = (
                f"ts_ms {ts} is {ts - now_ms} ms ahead of the worker clock ({now_ms}), "
                f"more than max_future_skew_ms={self.max_future_skew_ms}"
            )
            rejected.append(RejectedRecord(by_offset[item.offset], ErrorKind.OUT_OF_RANGE, reason))
        return kept, rejected
