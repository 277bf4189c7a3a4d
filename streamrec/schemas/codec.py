"""Batch decoding of input records into events, and encoding events for producers.

The worker hands over everything one poll returned; one bad record must never cost the
others, so :func:`decode_batch` turns every record into either an event (with its source
coordinates, which the offset tracker needs) or a :class:`RejectedRecord` (which becomes a
dead letter). Nothing about a record's content raises out of it.

Speed: the worker decodes every event it consumes on the event-loop thread, so the common
case is a single pass of inline ``type(x) is T`` checks (:func:`_quick_playback`); only a
record that fails them goes through the field-by-field checks of ``validation``, which are
the authoritative definition and produce the error message. Both must accept the same set.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final, NamedTuple, Protocol

from msgpack import unpackb
from orjson import loads as json_loads

from streamrec.errors import ConfigError, SchemaError
from streamrec.schemas.events import (
    INTERACTION_ACTIONS,
    Event,
    EventKind,
    InteractionEvent,
    PlaybackEvent,
    trusted_interaction,
    trusted_playback,
)
from streamrec.schemas.validation import (
    MAX_ID_LEN,
    MAX_PLAYBACK_MS,
    MAX_TS_MS,
    ErrorKind,
    optional_map,
    require_int,
    require_map,
    require_str,
    show,
)
from streamrec.schemas.wire import (
    CONTENT_TYPE_HEADER,
    DECODE_ERRORS,
    SNIFF_TABLE,
    Headers,
    WireFormat,
    dumps,
    header_format,
    undecodable_reason,
)

DEFAULT_MAX_RECORD_BYTES: Final = 64 * 1024


class ConsumedRecord(Protocol):
    """What decoding and dead-lettering read of a consumed record: ``RawRecord`` and
    aiokafka's ``ConsumerRecord`` both have it, so the worker hands aiokafka's records
    over as they are (no copy per record)."""

    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Headers: ...
    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...


@dataclass(frozen=True, slots=True)
class RawRecord:
    """One consumed Kafka record, as much of it as decoding and dead-lettering need."""

    value: bytes | None
    headers: Headers
    topic: str
    partition: int
    offset: int
    key: bytes | None = None


class DecodedEvent(NamedTuple):
    """A valid event and where it came from (the offset completes once it is processed).

    A NamedTuple rather than a frozen dataclass: one is built per consumed event and tuple
    construction costs about half as much.
    """

    event: Event
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class RejectedRecord:
    """A record that is not a valid event; ``reason`` names the field and the value."""

    record: ConsumedRecord
    kind: ErrorKind
    reason: str


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """Every input record lands in exactly one of the two lists, in input order."""

    events: list[DecodedEvent]
    errors: list[RejectedRecord]

    def error_counts(self) -> dict[ErrorKind, int]:
        return dict(Counter(error.kind for error in self.errors))


# --- playback ------------------------------------------------------------------------


def _quick_playback(obj: object) -> PlaybackEvent | None:
    """The valid common case in one pass, or None (then _strict_playback decides)."""
    if type(obj) is not dict:
        return None
    get = obj.get
    user_id = get("user_id")
    item_id = get("item_id")
    ts_ms = get("ts_ms")
    ms_played = get("ms_played")
    duration_ms = get("duration_ms")
    context = get("context")
    if (
        type(user_id) is str
        and 0 < len(user_id) <= MAX_ID_LEN
        and type(item_id) is str
        and 0 < len(item_id) <= MAX_ID_LEN
        and type(ts_ms) is int
        and 0 <= ts_ms <= MAX_TS_MS
        and type(ms_played) is int
        and 0 <= ms_played <= MAX_PLAYBACK_MS
        and type(duration_ms) is int
        and 0 <= duration_ms <= MAX_PLAYBACK_MS
        and (context is None or _is_str_keyed_map(context))
    ):
        return trusted_playback(user_id, item_id, ts_ms, ms_played, duration_ms, context)
    return None


def _strict_playback(obj: object) -> PlaybackEvent:
    fields = require_map(obj)
    return PlaybackEvent(
        user_id=require_str(fields, "user_id"),
        item_id=require_str(fields, "item_id"),
        ts_ms=require_int(fields, "ts_ms", 0, MAX_TS_MS),
        ms_played=require_int(fields, "ms_played", 0, MAX_PLAYBACK_MS),
        duration_ms=require_int(fields, "duration_ms", 0, MAX_PLAYBACK_MS),
        context=optional_map(fields, "context"),
    )


def _is_str_keyed_map(value: object) -> bool:
    return type(value) is dict and all(type(key) is str for key in value)


# --- interaction ---------------------------------------------------------------------


def _quick_interaction(obj: object) -> InteractionEvent | None:
    """As _quick_playback. The shared id/ts checks are repeated on purpose: a helper call per
    event would cost ~10% of the decoder's throughput."""
    if type(obj) is not dict:
        return None
    get = obj.get
    user_id = get("user_id")
    item_id = get("item_id")
    ts_ms = get("ts_ms")
    action = get("action")
    if (
        type(user_id) is str
        and 0 < len(user_id) <= MAX_ID_LEN
        and type(item_id) is str
        and 0 < len(item_id) <= MAX_ID_LEN
        and type(ts_ms) is int
        and 0 <= ts_ms <= MAX_TS_MS
        and type(action) is str
        and action in INTERACTION_ACTIONS
    ):
        return trusted_interaction(user_id, item_id, ts_ms, action)
    return None


def _strict_interaction(obj: object) -> InteractionEvent:
    fields = require_map(obj)
    user_id = require_str(fields, "user_id")
    item_id = require_str(fields, "item_id")
    ts_ms = require_int(fields, "ts_ms", 0, MAX_TS_MS)
    action = require_str(fields, "action")
    if action not in INTERACTION_ACTIONS:
        raise SchemaError(
            ErrorKind.UNKNOWN_ACTION,
            f"field 'action': unknown action {show(action)} "
            f"(expected one of {sorted(INTERACTION_ACTIONS)})",
        )
    return InteractionEvent(user_id, item_id, ts_ms, action)


_Builder = tuple[Callable[[object], Event | None], Callable[[object], Event]]
_BUILDERS: Final[dict[EventKind, _Builder]] = {
    EventKind.PLAYBACK: (_quick_playback, _strict_playback),
    EventKind.INTERACTION: (_quick_interaction, _strict_interaction),
}


# --- decoding ------------------------------------------------------------------------


def _builder_for(kind: EventKind, max_record_bytes: int) -> _Builder:
    """Argument checks (a caller's bug, so these do raise, unlike bad records)."""
    if type(max_record_bytes) is not int or max_record_bytes <= 0:
        raise ConfigError(f"max_record_bytes must be a positive int, got {max_record_bytes!r}")
    builder = _BUILDERS.get(kind)
    if builder is None:
        raise ConfigError(f"kind must be an EventKind, got {kind!r}")
    return builder


def decode_batch(
    records: Iterable[ConsumedRecord],
    kind: EventKind,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> DecodedBatch:
    """Decode records of one event kind; never raises because of a record's content.

    Only a wrong ``kind`` or a non-positive ``max_record_bytes`` raise (ConfigError).
    """
    quick, strict = _builder_for(kind, max_record_bytes)
    msgpack_format = WireFormat.MSGPACK
    events: list[DecodedEvent] = []
    errors: list[RejectedRecord] = []
    append_event = events.append
    # A producer sends the same headers on every record: parse each distinct tuple once.
    formats: dict[object, WireFormat | None] = {}
    # One flat loop body, no helper calls on the valid path: this runs once per consumed event.
    for record in records:
        try:
            value = record.value
            if value is None:
                raise SchemaError(ErrorKind.UNDECODABLE, "record has no value (a tombstone)")
            size = len(value)
            if size > max_record_bytes:
                raise SchemaError(
                    ErrorKind.OVERSIZED,
                    f"record is {size} bytes, more than max_record_bytes={max_record_bytes}",
                )
            if size == 0:
                raise SchemaError(ErrorKind.UNDECODABLE, "empty record value")
            headers = record.headers
            if not headers:
                fmt = None
            else:
                key = tuple(headers)
                if key in formats:
                    fmt = formats[key]
                else:
                    fmt = formats[key] = header_format(headers)
            if fmt is None:
                fmt = SNIFF_TABLE[value[0]]
            try:
                obj = unpackb(value, raw=False) if fmt is msgpack_format else json_loads(value)
            except DECODE_ERRORS as exc:
                raise SchemaError(ErrorKind.UNDECODABLE, undecodable_reason(fmt, exc)) from exc
            event = quick(obj)
            if event is None:
                event = strict(obj)  # raises SchemaError naming the field and the value
            append_event(DecodedEvent(event, record.topic, record.partition, record.offset))
        except SchemaError as exc:
            error_kind = exc.kind if isinstance(exc.kind, ErrorKind) else ErrorKind.UNDECODABLE
            errors.append(RejectedRecord(record, error_kind, str(exc)))
        except Exception as exc:  # last line of defence: one record must not sink the batch
            reason = f"unexpected {type(exc).__name__} while decoding: {exc}"
            errors.append(RejectedRecord(record, ErrorKind.UNDECODABLE, reason))
    return DecodedBatch(events, errors)


def decode_event(
    data: bytes,
    kind: EventKind,
    fmt: WireFormat | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Event:
    """Decode one record value (format sniffed unless given); raises SchemaError."""
    headers: Headers = () if fmt is None else ((CONTENT_TYPE_HEADER, fmt.content_type.encode()),)
    batch = decode_batch([RawRecord(data, headers, "", 0, -1)], kind, max_record_bytes)
    if batch.errors:
        raise SchemaError(batch.errors[0].kind, batch.errors[0].reason)
    return batch.events[0].event


# --- encoding ------------------------------------------------------------------------


def event_to_wire(event: Event) -> dict[str, object]:
    """The event as the plain map that goes on the wire (context omitted when None)."""
    fields: dict[str, object] = {
        "user_id": event.user_id,
        "item_id": event.item_id,
        "ts_ms": event.ts_ms,
    }
    if isinstance(event, PlaybackEvent):
        fields["ms_played"] = event.ms_played
        fields["duration_ms"] = event.duration_ms
        if event.context is not None:
            fields["context"] = event.context
    else:
        fields["action"] = event.action
    return fields


def encode_event(event: Event, fmt: WireFormat = WireFormat.MSGPACK) -> bytes:
    """Serialise an event; pair it with header ``content-type: fmt.content_type``."""
    return dumps(event_to_wire(event), fmt)
