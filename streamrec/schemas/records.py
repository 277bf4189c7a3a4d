"""Output records: the recommendation a home-feed service reads, and the dead letter.

Both are produced at most a few thousand times a second, so unlike input events they are
validated on construction (``__post_init__``): a malformed output is a bug in the producer
and should fail where it is made, not in a downstream consumer.
"""

from __future__ import annotations

import base64
import binascii
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from streamrec.errors import SchemaError
from streamrec.schemas.codec import RejectedRecord
from streamrec.schemas.validation import (
    MAX_TS_MS,
    ErrorKind,
    check_float,
    check_int,
    check_map,
    check_str,
    optional_map,
    require,
    require_int,
    require_list,
    require_map,
    require_str,
    show,
)
from streamrec.schemas.wire import WireFormat, detect_format, dumps, loads

MAX_VERSION: Final = 2**63 - 1
MAX_NAME_LEN: Final = 128  # model names/versions, task names, error kinds
MAX_REASON_LEN: Final = 4096


class CacheOutcome(enum.StrEnum):
    """Where the user's KV cache was found when the recommendation was computed."""

    GPU_HIT = "gpu_hit"
    HOST_HIT = "host_hit"
    DISK_HIT = "disk_hit"  # read back from the disk tier
    MISS = "miss"  # prefilled from the history store


@dataclass(frozen=True, slots=True)
class Recommendation:
    """Ranked items for one user (DESIGN §6). Keyed by user_id on the output topic.

    ``version`` increases per user with every recommendation the worker emits, so a
    consumer keeps the highest version it has seen and ignores redelivered duplicates.
    ``task_scores`` maps a ranking head (e.g. "complete", "skip", "like") to one score per
    item, aligned with ``items``. ``generated`` (when generation is on) is the predicted
    continuation: the next items in play order, each with the model's retrieval score at
    its position; it is independent of ``items`` and may repeat some of them.
    """

    user_id: str
    items: tuple[tuple[str, float], ...]  # best first
    model_name: str
    model_version: str
    version: int
    last_event_ts_ms: int  # timestamp of the newest event the recommendation reflects
    generated_at_ms: int
    cache_outcome: CacheOutcome
    task_scores: Mapping[str, tuple[float, ...]] | None = None
    timings_ms: Mapping[str, float] | None = None  # e.g. {"queue": 1.2, "model": 3.4}
    generated: tuple[tuple[str, float], ...] | None = None  # in generation order

    def __post_init__(self) -> None:
        check_str(self.user_id, "user_id")
        items = _check_items(self.items, "items")
        object.__setattr__(self, "items", items)
        if self.generated is not None:
            object.__setattr__(self, "generated", _check_items(self.generated, "generated"))
        check_str(self.model_name, "model_name", MAX_NAME_LEN)
        check_str(self.model_version, "model_version", MAX_NAME_LEN)
        check_int(self.version, "version", 0, MAX_VERSION)
        check_int(self.last_event_ts_ms, "last_event_ts_ms", 0, MAX_TS_MS)
        check_int(self.generated_at_ms, "generated_at_ms", 0, MAX_TS_MS)
        try:
            outcome = CacheOutcome(self.cache_outcome)
        except ValueError:
            raise SchemaError(
                ErrorKind.OUT_OF_RANGE,
                f"field 'cache_outcome': {show(self.cache_outcome)} is not one of "
                f"{[o.value for o in CacheOutcome]}",
            ) from None
        object.__setattr__(self, "cache_outcome", outcome)
        if self.task_scores is not None:
            object.__setattr__(self, "task_scores", _check_task_scores(self.task_scores, items))
        if self.timings_ms is not None:
            timings = {
                check_str(name, "timings_ms key", MAX_NAME_LEN): check_float(
                    ms, f"timings_ms.{name}"
                )
                for name, ms in check_map(self.timings_ms, "timings_ms").items()
            }
            object.__setattr__(self, "timings_ms", timings)

    @property
    def item_ids(self) -> list[str]:
        return [item_id for item_id, _ in self.items]

    def to_wire(self) -> dict[str, object]:
        fields: dict[str, object] = {
            "user_id": self.user_id,
            "items": [[item_id, score] for item_id, score in self.items],
            "model_name": self.model_name,
            "model_version": self.model_version,
            "version": self.version,
            "last_event_ts_ms": self.last_event_ts_ms,
            "generated_at_ms": self.generated_at_ms,
            "cache_outcome": self.cache_outcome.value,
        }
        if self.task_scores is not None:
            fields["task_scores"] = {name: list(s) for name, s in self.task_scores.items()}
        if self.timings_ms is not None:
            fields["timings_ms"] = dict(self.timings_ms)
        if self.generated is not None:
            fields["generated"] = [[item_id, score] for item_id, score in self.generated]
        return fields

    @classmethod
    def from_wire(cls, obj: object) -> Recommendation:
        fields = require_map(obj)
        task_scores = optional_map(fields, "task_scores")
        generated = fields.get("generated")
        return cls(
            user_id=require_str(fields, "user_id"),
            items=require_list(fields, "items"),  # type: ignore[arg-type]  # checked in __post_init__
            model_name=require_str(fields, "model_name", MAX_NAME_LEN),
            model_version=require_str(fields, "model_version", MAX_NAME_LEN),
            version=require_int(fields, "version", 0, MAX_VERSION),
            last_event_ts_ms=require_int(fields, "last_event_ts_ms", 0, MAX_TS_MS),
            generated_at_ms=require_int(fields, "generated_at_ms", 0, MAX_TS_MS),
            cache_outcome=require(fields, "cache_outcome"),  # type: ignore[arg-type]
            task_scores=task_scores,  # type: ignore[arg-type]
            timings_ms=optional_map(fields, "timings_ms"),  # type: ignore[arg-type]
            generated=generated,  # type: ignore[arg-type]  # checked in __post_init__
        )

    def to_bytes(self, fmt: WireFormat = WireFormat.MSGPACK) -> bytes:
        return dumps(self.to_wire(), fmt)

    @classmethod
    def from_bytes(cls, data: bytes, fmt: WireFormat | None = None) -> Recommendation:
        """Decode (format sniffed unless given); raises SchemaError naming field and value."""
        return cls.from_wire(loads(data, fmt or detect_format(data)))


def _as_seq(value: object, name: str) -> Sequence[object]:
    if not isinstance(value, list | tuple):
        raise SchemaError(
            ErrorKind.WRONG_TYPE, f"field {name!r}: expected a list, got {show(value)}"
        )
    return value


def _check_items(items: object, field: str) -> tuple[tuple[str, float], ...]:
    return tuple(_check_item(item, f"{field}[{i}]") for i, item in enumerate(_as_seq(items, field)))


def _check_item(item: object, name: str) -> tuple[str, float]:
    pair = _as_seq(item, name)
    if len(pair) != 2:
        raise SchemaError(
            ErrorKind.WRONG_TYPE, f"field {name!r}: expected [item_id, score], got {show(item)}"
        )
    return (check_str(pair[0], f"{name}.item_id"), check_float(pair[1], f"{name}.score"))


def _check_task_scores(
    task_scores: Mapping[str, object], items: tuple[tuple[str, float], ...]
) -> dict[str, tuple[float, ...]]:
    checked: dict[str, tuple[float, ...]] = {}
    for task, scores in check_map(task_scores, "task_scores").items():
        name = f"task_scores.{task}"
        check_str(task, "task_scores key", MAX_NAME_LEN)
        values = tuple(check_float(s, f"{name}[{i}]") for i, s in enumerate(_as_seq(scores, name)))
        if len(values) != len(items):
            raise SchemaError(
                ErrorKind.OUT_OF_RANGE,
                f"field {name!r}: {len(values)} scores for {len(items)} items",
            )
        checked[task] = values
    return checked


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record the worker could not use, with everything needed to find and replay it.

    On the wire ``value`` and ``key`` are msgpack bin; JSON has no bytes, so there they are
    base64 strings (standard alphabet, padded) under the same field names.
    """

    value: bytes | None
    key: bytes | None
    topic: str
    partition: int
    offset: int
    error_kind: str  # an ErrorKind value for records that failed to decode
    reason: str
    failed_at_ms: int

    def __post_init__(self) -> None:
        for name in ("value", "key"):
            raw = getattr(self, name)
            if raw is not None and not isinstance(raw, bytes):
                raise SchemaError(
                    ErrorKind.WRONG_TYPE, f"field {name!r}: expected bytes, got {show(raw)}"
                )
        check_str(self.topic, "topic")
        check_int(self.partition, "partition", 0, 2**31 - 1)
        check_int(self.offset, "offset", -1, MAX_VERSION)
        check_str(self.error_kind, "error_kind", MAX_NAME_LEN)
        check_str(self.reason, "reason", MAX_REASON_LEN)
        check_int(self.failed_at_ms, "failed_at_ms", 0, MAX_TS_MS)

    @classmethod
    def from_rejected(cls, rejected: RejectedRecord, failed_at_ms: int) -> DeadLetter:
        record = rejected.record
        reason = rejected.reason
        if len(reason) > MAX_REASON_LEN:
            reason = reason[: MAX_REASON_LEN - 1] + "…"
        return cls(
            value=record.value,
            key=record.key,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            error_kind=rejected.kind.value,
            reason=reason,
            failed_at_ms=failed_at_ms,
        )

    def to_wire(self, fmt: WireFormat = WireFormat.MSGPACK) -> dict[str, object]:
        def raw(data: bytes | None) -> bytes | str | None:
            if data is None or fmt is WireFormat.MSGPACK:
                return data
            return base64.b64encode(data).decode("ascii")

        return {
            "value": raw(self.value),
            "key": raw(self.key),
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "error_kind": self.error_kind,
            "reason": self.reason,
            "failed_at_ms": self.failed_at_ms,
        }

    @classmethod
    def from_wire(cls, obj: object, fmt: WireFormat) -> DeadLetter:
        fields = require_map(obj)
        return cls(
            value=_wire_bytes(fields.get("value"), "value", fmt),
            key=_wire_bytes(fields.get("key"), "key", fmt),
            topic=require_str(fields, "topic"),
            partition=require_int(fields, "partition", 0, 2**31 - 1),
            offset=require_int(fields, "offset", -1, MAX_VERSION),
            error_kind=require_str(fields, "error_kind", MAX_NAME_LEN),
            reason=require_str(fields, "reason", MAX_REASON_LEN),
            failed_at_ms=require_int(fields, "failed_at_ms", 0, MAX_TS_MS),
        )

    def to_bytes(self, fmt: WireFormat = WireFormat.MSGPACK) -> bytes:
        return dumps(self.to_wire(fmt), fmt)

    @classmethod
    def from_bytes(cls, data: bytes, fmt: WireFormat | None = None) -> DeadLetter:
        """Decode (format sniffed unless given); raises SchemaError naming field and value."""
        fmt = fmt or detect_format(data)
        return cls.from_wire(loads(data, fmt), fmt)


def _wire_bytes(value: object, name: str, fmt: WireFormat) -> bytes | None:
    if value is None or (fmt is WireFormat.MSGPACK and type(value) is bytes):
        return value
    if fmt is WireFormat.JSON and type(value) is str:
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise SchemaError(
                ErrorKind.WRONG_TYPE, f"field {name!r}: not valid base64: {show(value)}"
            ) from None
    expected = "bytes" if fmt is WireFormat.MSGPACK else "a base64 string"
    raise SchemaError(
        ErrorKind.WRONG_TYPE, f"field {name!r}: expected {expected}, got {show(value)}"
    )
