"""Out-of-order times are kept; times too far ahead are rejected as out_of_range."""

from __future__ import annotations

import pytest

from streamrec.errors import ConfigError
from streamrec.schemas.codec import DecodedEvent, RawRecord
from streamrec.schemas.events import InteractionEvent
from streamrec.schemas.validation import ErrorKind
from streamrec.worker.config import TopicsConfig
from streamrec.worker.event_time_policy import EventTimePolicy

NOW = 1_764_529_200_000
DAY = 86_400_000


def decoded(times: list[int]) -> tuple[list[DecodedEvent], list[RawRecord]]:
    records = [RawRecord(b"x%d" % n, (), "ia", 2, 10 + n) for n in range(len(times))]
    events = [
        DecodedEvent(InteractionEvent("u1", "i1", ts, "like"), "ia", 2, 10 + n)
        for n, ts in enumerate(times)
    ]
    return events, records


def test_out_of_order_and_up_to_the_bound_are_kept_in_arrival_order() -> None:
    times = [NOW, NOW - DAY, NOW + DAY, 0, NOW - 5]
    events, records = decoded(times)
    kept, rejected = EventTimePolicy(DAY).split(events, records, NOW)
    assert [item.event.ts_ms for item in kept] == times
    assert rejected == []


def test_beyond_the_bound_is_rejected_with_value_and_bound() -> None:
    times = [NOW, NOW + DAY + 1, NOW - 1, NOW + 30 * DAY]
    events, records = decoded(times)
    kept, rejected = EventTimePolicy(DAY).split(events, records, NOW)
    assert [item.offset for item in kept] == [10, 12]
    assert [r.record.offset for r in rejected] == [11, 13]
    assert rejected[0].record is records[1]
    assert {r.kind for r in rejected} == {ErrorKind.OUT_OF_RANGE}
    assert f"ts_ms {NOW + DAY + 1}" in rejected[0].reason
    assert f"max_future_skew_ms={DAY}" in rejected[0].reason


def test_the_bound_is_configured_and_validated() -> None:
    assert TopicsConfig().max_future_skew_ms == DAY
    with pytest.raises(ConfigError, match=r"max_future_skew_ms.*-1"):
        TopicsConfig(max_future_skew_ms=-1)
    with pytest.raises(ConfigError, match="-5"):
        EventTimePolicy(-5)
