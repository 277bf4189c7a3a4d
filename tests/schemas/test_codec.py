from pathlib import Path

import msgpack
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamrec.errors import ConfigError, SchemaError
from streamrec.schemas.codec import (
    DEFAULT_MAX_RECORD_BYTES,
    DecodedEvent,
    RawRecord,
    _quick_interaction,
    _quick_playback,
    _strict_interaction,
    _strict_playback,
    decode_batch,
    decode_event,
    encode_event,
)
from streamrec.schemas.events import EventKind, InteractionEvent, PlaybackEvent
from streamrec.schemas.validation import MAX_ID_LEN, MAX_PLAYBACK_MS, MAX_TS_MS, ErrorKind
from streamrec.schemas.wire import WireFormat

PLAYBACK = {"user_id": "u1", "item_id": "i9", "ts_ms": 1, "ms_played": 800, "duration_ms": 1000}
INTERACTION = {"user_id": "u1", "item_id": "i9", "ts_ms": 1, "action": "like"}


def record(
    value: bytes | None, headers=(), offset: int = 0, key: bytes | None = b"u1"
) -> RawRecord:
    return RawRecord(value, headers, "events", 3, offset, key=key)


def decode_one(obj: object, kind: EventKind, fmt: WireFormat = WireFormat.MSGPACK, **kw):
    data = msgpack.packb(obj) if fmt is WireFormat.MSGPACK else orjson.dumps(obj)
    batch = decode_batch([record(data)], kind, **kw)
    assert len(batch.events) + len(batch.errors) == 1
    return batch


@pytest.mark.parametrize("fmt", list(WireFormat))
@pytest.mark.parametrize(
    "event",
    [
        PlaybackEvent("u1", "i9", 1_700_000_000_000, 1234, 200_000),
        PlaybackEvent("ü" * MAX_ID_LEN, "i", MAX_TS_MS, 0, 0, {"device": "tv", "n": [1, 2]}),
        InteractionEvent("u1", "i9", 0, "add_to_playlist"),
    ],
)
def test_round_trip(event: PlaybackEvent | InteractionEvent, fmt: WireFormat) -> None:
    data = encode_event(event, fmt)
    assert data[:1] == (b"{" if fmt is WireFormat.JSON else data[:1])
    assert decode_event(data, event.kind) == event
    assert decode_event(data, event.kind, fmt) == event
    header = [("content-type", fmt.content_type.encode())]
    batch = decode_batch([record(data, header, 41, event.user_id.encode())], event.kind)
    assert batch.events == [DecodedEvent(event, "events", 3, 41)]
    assert batch.errors == []


def test_acceptance_json_interaction() -> None:
    data = b'{"user_id":"u1","item_id":"i9","ts_ms":1,"action":"like"}'
    assert decode_event(data, EventKind.INTERACTION) == InteractionEvent("u1", "i9", 1, "like")


def test_batch_keeps_order_and_coordinates_and_splits_errors() -> None:
    good = [encode_event(PlaybackEvent(f"u{i}", "i", i, 1, 2)) for i in range(4)]
    values = [good[0], b"\xc1", good[1], None, good[2], b"", good[3]]
    keys = [b"u0", b"u1", b"u1", b"u1", b"u2", b"u1", b"u3"]
    records = [record(v, offset=i, key=k) for i, (v, k) in enumerate(zip(values, keys))]
    batch = decode_batch(records, EventKind.PLAYBACK)
    assert [e.offset for e in batch.events] == [0, 2, 4, 6]
    assert [e.event.user_id for e in batch.events] == ["u0", "u1", "u2", "u3"]
    assert [e.record.offset for e in batch.errors] == [1, 3, 5]
    assert all(e.kind is ErrorKind.UNDECODABLE for e in batch.errors)
    assert batch.error_counts() == {ErrorKind.UNDECODABLE: 3}
    assert "tombstone" in batch.errors[1].reason
    assert batch.errors[0].record.key == b"u1"


def test_unknown_fields_are_ignored_and_null_context_is_absent() -> None:
    obj = {**PLAYBACK, "extra": {"nested": [1]}, "context": None, "schema": 2}
    for fmt in WireFormat:
        (decoded,) = decode_one(obj, EventKind.PLAYBACK, fmt).events
        assert decoded.event == PlaybackEvent("u1", "i9", 1, 800, 1000, None)


# (kind, mutation of the valid record, error kind, substrings the reason must contain)
ERROR_CASES = [
    (EventKind.PLAYBACK, {"user_id": None}, ErrorKind.MISSING_FIELD, ["'user_id'"]),
    (EventKind.PLAYBACK, {"duration_ms": None}, ErrorKind.MISSING_FIELD, ["'duration_ms'"]),
    (EventKind.PLAYBACK, {"ts_ms": True}, ErrorKind.WRONG_TYPE, ["'ts_ms'", "bool True"]),
    (EventKind.PLAYBACK, {"ts_ms": 1.0}, ErrorKind.WRONG_TYPE, ["'ts_ms'", "float 1.0"]),
    (EventKind.PLAYBACK, {"ts_ms": "17"}, ErrorKind.WRONG_TYPE, ["'ts_ms'", "str '17'"]),
    (EventKind.PLAYBACK, {"item_id": 9}, ErrorKind.WRONG_TYPE, ["'item_id'", "int 9"]),
    (EventKind.PLAYBACK, {"context": [1]}, ErrorKind.WRONG_TYPE, ["'context'", "[1]"]),
    (EventKind.PLAYBACK, {"ts_ms": -1}, ErrorKind.OUT_OF_RANGE, ["'ts_ms'", "-1"]),
    (EventKind.PLAYBACK, {"ts_ms": MAX_TS_MS + 1}, ErrorKind.OUT_OF_RANGE, [str(MAX_TS_MS + 1)]),
    (EventKind.PLAYBACK, {"ms_played": -5}, ErrorKind.OUT_OF_RANGE, ["'ms_played'", "-5"]),
    (EventKind.PLAYBACK, {"duration_ms": -2}, ErrorKind.OUT_OF_RANGE, ["'duration_ms'", "-2"]),
    (EventKind.PLAYBACK, {"user_id": ""}, ErrorKind.OUT_OF_RANGE, ["'user_id'", "length 0"]),
    (EventKind.PLAYBACK, {"item_id": "x" * 300}, ErrorKind.OUT_OF_RANGE, ["'item_id'", "xxxx"]),
    (EventKind.INTERACTION, {"action": "lik"}, ErrorKind.UNKNOWN_ACTION, ["'action'", "'lik'"]),
    (EventKind.INTERACTION, {"action": "LIKE"}, ErrorKind.UNKNOWN_ACTION, ["'LIKE'"]),
    (EventKind.INTERACTION, {"action": 4}, ErrorKind.WRONG_TYPE, ["'action'", "int 4"]),
    (EventKind.INTERACTION, {"action": None}, ErrorKind.MISSING_FIELD, ["'action'"]),
]


@pytest.mark.parametrize("fmt", list(WireFormat))
@pytest.mark.parametrize(("kind", "change", "error_kind", "needles"), ERROR_CASES)
def test_error_kind_and_reason_name_field_and_value(
    kind: EventKind, change: dict, error_kind: ErrorKind, needles: list[str], fmt: WireFormat
) -> None:
    base = PLAYBACK if kind is EventKind.PLAYBACK else INTERACTION
    obj = {k: v for k, v in {**base, **change}.items() if v is not None}  # None: drop it
    batch = decode_one(obj, kind, fmt)
    (error,) = batch.errors
    assert error.kind is error_kind
    for needle in needles:
        assert needle in error.reason
    assert len(error.reason) < 400  # long values are truncated
    with pytest.raises(SchemaError) as info:
        decode_event(msgpack.packb(obj), kind)
    assert info.value.kind == error_kind


@pytest.mark.parametrize(
    ("value", "error_kind", "needle"),
    [
        (msgpack.packb([1, 2]), ErrorKind.NOT_A_MAP, "list [1, 2]"),
        (b'"just a string"', ErrorKind.UNDECODABLE, "msgpack"),  # sniffed as msgpack
        (b' ["a"]', ErrorKind.NOT_A_MAP, "list ['a']"),
        (b"{not json", ErrorKind.UNDECODABLE, "json"),
        (msgpack.packb(PLAYBACK)[:-2], ErrorKind.UNDECODABLE, "msgpack"),
        (msgpack.packb(PLAYBACK) + b"\x00", ErrorKind.UNDECODABLE, "ExtraData"),
        (msgpack.packb({**PLAYBACK, "context": {b"k": 1}}), ErrorKind.WRONG_TYPE, "b'k'"),
        (msgpack.packb({1: 2}), ErrorKind.UNDECODABLE, "msgpack"),  # non-str map key
    ],
)
def test_malformed_values(value: bytes, error_kind: ErrorKind, needle: str) -> None:
    (error,) = decode_batch([record(value)], EventKind.PLAYBACK).errors
    assert error.kind is error_kind
    assert needle in error.reason


def test_header_selects_the_decoder() -> None:
    as_json = orjson.dumps(PLAYBACK)
    batch = decode_batch(
        [
            record(as_json, [("content-type", b"application/json")]),
            record(as_json, [("content-type", b"application/msgpack")]),
            record(as_json, [("content-type", b"text/csv")]),
        ],
        EventKind.PLAYBACK,
    )
    assert len(batch.events) == 1
    assert [e.kind for e in batch.errors] == [ErrorKind.UNDECODABLE, ErrorKind.UNSUPPORTED_FORMAT]
    assert "text/csv" in batch.errors[1].reason


def test_oversized_checked_before_parsing() -> None:
    padded = msgpack.packb({**PLAYBACK, "pad": "x" * 200})
    batch = decode_batch([record(padded)], EventKind.PLAYBACK, max_record_bytes=100)
    (error,) = batch.errors
    assert error.kind is ErrorKind.OVERSIZED
    assert str(len(padded)) in error.reason and "100" in error.reason
    big = msgpack.packb({**PLAYBACK, "pad": "x" * DEFAULT_MAX_RECORD_BYTES})
    assert decode_batch([record(big)], EventKind.PLAYBACK).errors[0].kind is ErrorKind.OVERSIZED
    assert len(decode_batch([record(padded)], EventKind.PLAYBACK).events) == 1


def test_bad_arguments_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="max_record_bytes"):
        decode_batch([], EventKind.PLAYBACK, max_record_bytes=0)
    with pytest.raises(ConfigError, match="'playback'"):
        decode_batch([], "playback")  # type: ignore[arg-type]


def test_unexpected_failure_of_one_record_is_contained() -> None:
    class Weird(bytes):
        def __len__(self) -> int:
            raise RuntimeError("boom")

    good = record(encode_event(InteractionEvent("u1", "i", 1, "hide")))
    batch = decode_batch([record(Weird(b"x")), good], EventKind.INTERACTION)
    assert len(batch.events) == 1
    (error,) = batch.errors
    assert (
        error.kind is ErrorKind.UNDECODABLE and "RuntimeError while decoding: boom" in error.reason
    )


@pytest.mark.parametrize("kind", list(EventKind))
def test_key_must_be_the_user_id(kind: EventKind) -> None:
    """One user, one partition: a record keyed u6 carrying user u5, or keyed by nothing,
    is dead-lettered with a reason naming both (issue 17, item 7)."""
    base = PLAYBACK if kind is EventKind.PLAYBACK else INTERACTION
    value = msgpack.packb({**base, "user_id": "u5"})
    batch = decode_batch(
        [record(value, key=b"u5"), record(value, (), 1, b"u6"), record(value, (), 2, None)], kind
    )
    assert [e.offset for e in batch.events] == [0]
    mismatch, missing = batch.errors
    assert (mismatch.kind, missing.kind) == (ErrorKind.KEY_MISMATCH, ErrorKind.MISSING_KEY)
    assert "b'u6'" in mismatch.reason and "'u5'" in mismatch.reason
    assert "no key" in missing.reason and "'u5'" in missing.reason
    assert batch.error_counts() == {ErrorKind.KEY_MISMATCH: 1, ErrorKind.MISSING_KEY: 1}
    # a bad value is reported as such, whatever the key
    (bad,) = decode_batch([record(b"\xc1", key=None)], kind).errors
    assert bad.kind is ErrorKind.UNDECODABLE
    # decoding a bare value (produce, replays) has no key to check
    assert decode_batch([record(value, key=None)], kind, require_key=False).errors == []
    assert decode_event(value, kind).user_id == "u5"


# --- property test: arbitrary and corrupted input never escapes decode_batch -----------

FUZZ_RECORDS = 10_000
FUZZ_EXAMPLES = 100
BATCH = FUZZ_RECORDS // FUZZ_EXAMPLES

small_ints = st.integers(-(2**63), 2**64 - 1)
wild_values = st.one_of(
    st.none(),
    st.booleans(),
    small_ints,
    st.sampled_from([-1, 0, 2**31, MAX_TS_MS, MAX_TS_MS + 1]),
    st.floats(),
    st.text(max_size=6),
    st.sampled_from(["", "like", "skip", "x" * 300]),
    st.binary(max_size=6),
    st.lists(small_ints, max_size=2),
    st.dictionaries(st.text(max_size=3), small_ints, max_size=2),
)
valid_playback = st.fixed_dictionaries(
    {
        "user_id": st.text(min_size=1, max_size=10),
        "item_id": st.text(min_size=1, max_size=10),
        "ts_ms": st.integers(0, MAX_TS_MS),
        "ms_played": st.integers(0, MAX_PLAYBACK_MS),
        "duration_ms": st.integers(0, MAX_PLAYBACK_MS),
    },
    optional={"context": st.dictionaries(st.text(max_size=4), small_ints, max_size=2)},
)
valid_interaction = st.fixed_dictionaries(
    {
        "user_id": st.text(min_size=1, max_size=10),
        "item_id": st.text(min_size=1, max_size=10),
        "ts_ms": st.integers(0, MAX_TS_MS),
        "action": st.sampled_from(["like", "unlike", "save", "share", "skip", "click", "hide"]),
    }
)
FIELDS = ["user_id", "item_id", "ts_ms", "ms_played", "duration_ms", "action", "context", "x"]
field_mutation = st.tuples(
    st.sampled_from(["drop", "replace"]), st.sampled_from(FIELDS), wild_values
)
headers = st.sampled_from(
    [
        (),
        (("content-type", b"application/msgpack"),),
        (("content-type", b"application/json"),),
        (("content-type", b"text/plain"),),
        (("content-type", None),),
    ]
)


@st.composite
def mutated_record(draw: st.DrawFn) -> tuple[object, bytes, tuple]:
    """A valid event map with field mutations, encoded, then possibly corrupted as bytes."""
    obj = dict(draw(st.one_of(valid_playback, valid_interaction)))
    for op, name, value in draw(st.lists(field_mutation, max_size=3)):
        if op == "drop":
            obj.pop(name, None)
        else:
            obj[name] = value
    fmt = draw(st.sampled_from(list(WireFormat)))
    # orjson has no bytes: default=repr keeps such a record a (mutated) map
    data = msgpack.packb(obj) if fmt is WireFormat.MSGPACK else orjson.dumps(obj, default=repr)
    header = draw(st.sampled_from(["none", "none", "own", "own", "any"]))
    hdrs = {"none": (), "own": (("content-type", fmt.content_type.encode()),)}.get(header)
    corruption = draw(st.sampled_from(["none", "none", "truncate", "flip"]))
    if corruption == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif corruption == "flip" and data:
        flipped = bytearray(data)
        for _ in range(draw(st.integers(1, 3))):
            flipped[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
        data = bytes(flipped)
    return obj, data, draw(headers) if hdrs is None else hdrs


random_record = st.tuples(
    st.none(),
    st.one_of(
        st.binary(max_size=100),
        st.builds(
            lambda p, b: p + b, st.sampled_from([b"{", b"\x85", b"\xde\x00\x05"]), st.binary()
        ),
    ),
    headers,
)


def test_fuzzed_records_all_come_back_as_event_or_error() -> None:
    fed = 0

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        batch=st.lists(st.one_of(mutated_record(), random_record), min_size=BATCH, max_size=BATCH),
        kind=st.sampled_from(list(EventKind)),
    )
    def check(batch: list[tuple[object, bytes, tuple]], kind: EventKind) -> None:
        nonlocal fed
        records = [RawRecord(data, hdrs, "t", 0, i) for i, (_, data, hdrs) in enumerate(batch)]
        decoded = decode_batch(records, kind, max_record_bytes=120, require_key=False)
        fed += len(records)
        assert len(decoded.events) + len(decoded.errors) == len(records)
        offsets = sorted(
            [e.offset for e in decoded.events] + [e.record.offset for e in decoded.errors]
        )
        assert offsets == list(range(len(records)))
        for error in decoded.errors:
            assert isinstance(error.kind, ErrorKind)
            assert error.reason
        for item in decoded.events:  # anything accepted survives a re-encode unchanged
            assert decode_event(encode_event(item.event), kind) == item.event
        # The inline fast path must accept exactly what the strict checks accept.
        quick, strict = (
            (_quick_playback, _strict_playback)
            if kind is EventKind.PLAYBACK
            else (_quick_interaction, _strict_interaction)
        )
        for obj, _, _ in batch:
            fast = quick(obj)
            try:
                slow = strict(obj)
            except SchemaError:
                assert fast is None
            else:
                assert fast == slow

    check()
    assert fed >= FUZZ_RECORDS


def test_every_error_kind_is_documented_in_the_contracts() -> None:
    contracts = Path(__file__).resolve().parents[2] / "docs" / "contracts.md"
    text = contracts.read_text()
    assert [k.value for k in ErrorKind if f"| `{k.value}` |" not in text] == []
