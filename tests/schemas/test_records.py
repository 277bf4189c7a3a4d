import base64
import math

import orjson
import pytest

from streamrec.errors import SchemaError
from streamrec.schemas.codec import RawRecord, RejectedRecord, decode_batch
from streamrec.schemas.events import EventKind
from streamrec.schemas.records import CacheOutcome, DeadLetter, Recommendation
from streamrec.schemas.validation import ErrorKind
from streamrec.schemas.wire import WireFormat


def make_recommendation(**overrides: object) -> Recommendation:
    fields: dict[str, object] = {
        "user_id": "u1",
        "items": [("i3", 0.9), ("i7", 0.5), ("i1", 0.25)],
        "model_name": "hstu-small",
        "model_version": "2024-06-01.3",
        "version": 17,
        "last_event_ts_ms": 1_700_000_000_000,
        "generated_at_ms": 1_700_000_000_050,
        "cache_outcome": "gpu_hit",
        "task_scores": {"complete": [0.7, 0.4, 0.1], "skip": [0.1, 0.3, 0.6]},
        "timings_ms": {"queue": 1.5, "model": 3},
    }
    fields.update(overrides)
    return Recommendation(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", list(WireFormat))
def test_recommendation_round_trip(fmt: WireFormat) -> None:
    rec = make_recommendation()
    assert rec.items == (("i3", 0.9), ("i7", 0.5), ("i1", 0.25))
    assert rec.cache_outcome is CacheOutcome.GPU_HIT
    assert rec.task_scores == {"complete": (0.7, 0.4, 0.1), "skip": (0.1, 0.3, 0.6)}
    assert rec.timings_ms == {"queue": 1.5, "model": 3.0}
    assert rec.item_ids == ["i3", "i7", "i1"]
    data = rec.to_bytes(fmt)
    assert Recommendation.from_bytes(data) == rec
    assert Recommendation.from_bytes(data, fmt) == rec


@pytest.mark.parametrize("fmt", list(WireFormat))
def test_recommendation_without_optional_fields(fmt: WireFormat) -> None:
    rec = make_recommendation(task_scores=None, timings_ms=None, items=[], cache_outcome="miss")
    wire = rec.to_wire()
    assert "task_scores" not in wire and "timings_ms" not in wire
    assert Recommendation.from_bytes(rec.to_bytes(fmt)) == rec


@pytest.mark.parametrize("fmt", list(WireFormat))
def test_recommendation_with_generated_continuation(fmt: WireFormat) -> None:
    rec = make_recommendation(generated=[("i9", 0.8), ("i3", 0.71)])
    assert rec.generated == (("i9", 0.8), ("i3", 0.71))
    wire = rec.to_wire()
    assert wire["generated"] == [["i9", 0.8], ["i3", 0.71]]
    assert Recommendation.from_bytes(rec.to_bytes(fmt), fmt) == rec
    assert "generated" not in make_recommendation().to_wire()
    assert Recommendation.from_bytes(make_recommendation().to_bytes(fmt)).generated is None


def test_recommendation_json_is_readable() -> None:
    wire = orjson.loads(make_recommendation().to_bytes(WireFormat.JSON))
    assert wire["items"] == [["i3", 0.9], ["i7", 0.5], ["i1", 0.25]]
    assert wire["cache_outcome"] == "gpu_hit"
    assert wire["version"] == 17


@pytest.mark.parametrize(
    ("overrides", "kind", "needle"),
    [
        ({"user_id": ""}, ErrorKind.OUT_OF_RANGE, "'user_id'"),
        ({"version": -1}, ErrorKind.OUT_OF_RANGE, "'version': -1"),
        ({"version": True}, ErrorKind.WRONG_TYPE, "'version'"),
        ({"cache_outcome": "warm"}, ErrorKind.OUT_OF_RANGE, "'warm'"),
        ({"items": [("i1", math.nan)]}, ErrorKind.OUT_OF_RANGE, "'items[0].score'"),
        ({"items": [("i1",)]}, ErrorKind.WRONG_TYPE, "'items[0]'"),
        ({"items": [(5, 0.1)]}, ErrorKind.WRONG_TYPE, "'items[0].item_id'"),
        ({"items": "i1"}, ErrorKind.WRONG_TYPE, "'items'"),
        ({"generated": [("i1", math.inf)]}, ErrorKind.OUT_OF_RANGE, "'generated[0].score'"),
        ({"generated": [("i1", 0.5, 1)]}, ErrorKind.WRONG_TYPE, "'generated[0]'"),
        ({"generated": {"i1": 0.5}}, ErrorKind.WRONG_TYPE, "'generated'"),
        ({"task_scores": {"like": [0.1]}}, ErrorKind.OUT_OF_RANGE, "1 scores for 3 items"),
        ({"task_scores": {"like": [0.1, "x", 0.2]}}, ErrorKind.WRONG_TYPE, "task_scores.like[1]"),
        ({"timings_ms": {"model": "slow"}}, ErrorKind.WRONG_TYPE, "timings_ms.model"),
        ({"generated_at_ms": -3}, ErrorKind.OUT_OF_RANGE, "'generated_at_ms': -3"),
    ],
)
def test_recommendation_validation(overrides: dict, kind: ErrorKind, needle: str) -> None:
    with pytest.raises(SchemaError) as info:
        make_recommendation(**overrides)
    assert info.value.kind == kind
    assert needle in str(info.value)


def test_recommendation_decode_errors_name_the_field() -> None:
    wire = make_recommendation().to_wire()
    del wire["model_version"]
    with pytest.raises(SchemaError, match="'model_version'") as info:
        Recommendation.from_bytes(orjson.dumps(wire))
    assert info.value.kind == ErrorKind.MISSING_FIELD
    with pytest.raises(SchemaError) as info:
        Recommendation.from_bytes(b"\xc1")
    assert info.value.kind == ErrorKind.UNDECODABLE


def make_dead_letter() -> DeadLetter:
    batch = decode_batch(
        [RawRecord(b"\x93\x01\x02\x03", (), "playback-events", 2, 1234, key=b"u\x00")],
        EventKind.PLAYBACK,
    )
    (rejected,) = batch.errors
    return DeadLetter.from_rejected(rejected, failed_at_ms=1_700_000_000_123)


@pytest.mark.parametrize("fmt", list(WireFormat))
def test_dead_letter_round_trip(fmt: WireFormat) -> None:
    letter = make_dead_letter()
    assert letter.value == b"\x93\x01\x02\x03" and letter.key == b"u\x00"
    assert (letter.topic, letter.partition, letter.offset) == ("playback-events", 2, 1234)
    assert letter.error_kind == "not_a_map" and "list [1, 2, 3]" in letter.reason
    data = letter.to_bytes(fmt)
    assert DeadLetter.from_bytes(data) == letter
    no_key = DeadLetter(None, None, "t", 0, 0, "oversized", "too big", 5)
    assert DeadLetter.from_bytes(no_key.to_bytes(fmt), fmt) == no_key


def test_dead_letter_json_carries_base64_bytes() -> None:
    letter = make_dead_letter()
    wire = orjson.loads(letter.to_bytes(WireFormat.JSON))
    assert base64.b64decode(wire["value"]) == letter.value
    wire["value"] = "not base64!"
    with pytest.raises(SchemaError, match="'value'") as info:
        DeadLetter.from_bytes(orjson.dumps(wire))
    assert info.value.kind == ErrorKind.WRONG_TYPE


def test_dead_letter_validation_and_long_reason_truncated() -> None:
    with pytest.raises(SchemaError, match="'partition'"):
        DeadLetter(b"x", None, "t", -1, 0, "undecodable", "r", 0)
    with pytest.raises(SchemaError, match="'value'"):
        DeadLetter("x", None, "t", 0, 0, "undecodable", "r", 0)  # type: ignore[arg-type]
    long = RejectedRecord(RawRecord(b"\xc1", (), "t", 0, 0), ErrorKind.UNDECODABLE, "x" * 10_000)
    letter = DeadLetter.from_rejected(long, failed_at_ms=1)
    assert len(letter.reason) == 4096 and letter.reason.endswith("…")
