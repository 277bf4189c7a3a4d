"""Field checks shared by every wire schema, and the fixed set of error kinds.

These are the authoritative (slow-path) checks: the event codec accepts the common case
with inline checks and falls back to these to reject a record with a precise message, so
both paths must accept exactly the same records.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Final

from streamrec.errors import SchemaError


class ErrorKind(enum.StrEnum):
    """Machine-readable reason a record was rejected; a small fixed set, safe as a metric label."""

    UNDECODABLE = "undecodable"  # not valid msgpack / JSON (or an empty value)
    UNSUPPORTED_FORMAT = "unsupported_format"  # content-type header names another format
    NOT_A_MAP = "not_a_map"  # decoded, but the top level is not a map / object
    MISSING_FIELD = "missing_field"
    WRONG_TYPE = "wrong_type"
    OUT_OF_RANGE = "out_of_range"  # negative, too large, empty or too long
    OVERSIZED = "oversized"  # the record exceeds the configured byte bound
    UNKNOWN_ACTION = "unknown_action"  # interaction action outside the vocabulary
    MISSING_KEY = "missing_key"  # the Kafka record has no key (it must be the user_id)
    KEY_MISMATCH = "key_mismatch"  # the key is not the event's user_id


MAX_ID_LEN: Final = 256  # characters of a user or item id
MAX_TS_MS: Final = 7_258_118_400_000  # 2200-01-01T00:00:00Z; anything later is a unit bug
MAX_PLAYBACK_MS: Final = 2**31 - 1  # ~24.8 days of playback / duration
MAX_SHOWN_CHARS: Final = 64  # how much of an offending value an error message quotes


def check_key(key: bytes | None, user_id: str) -> None:
    """A record's Kafka key must be its event's ``user_id`` (UTF-8): co-partitioning puts
    one user's events, cache and history on one worker only if every producer keys so."""
    if key is None:
        raise SchemaError(
            ErrorKind.MISSING_KEY, f"record has no key; expected the user_id {show(user_id)}"
        )
    if key != user_id.encode():
        raise SchemaError(
            ErrorKind.KEY_MISMATCH, f"record key {show(key)} is not the user_id {show(user_id)}"
        )


def show(value: object) -> str:
    """Type and (truncated) repr of a value, for error messages."""
    text = repr(value)
    if len(text) > MAX_SHOWN_CHARS:
        text = text[: MAX_SHOWN_CHARS - 1] + "…"
    return f"{type(value).__name__} {text}"


def require_map(obj: object, what: str = "record") -> Mapping[str, object]:
    if not isinstance(obj, dict):
        raise SchemaError(ErrorKind.NOT_A_MAP, f"{what} is not a map: got {show(obj)}")
    return obj


def require(obj: Mapping[str, object], name: str) -> object:
    """The field's value; absent and explicit null both count as missing."""
    value = obj.get(name)
    if value is None:
        raise SchemaError(ErrorKind.MISSING_FIELD, f"missing field {name!r}")
    return value


def require_str(obj: Mapping[str, object], name: str, max_len: int = MAX_ID_LEN) -> str:
    return check_str(require(obj, name), name, max_len)


def require_int(obj: Mapping[str, object], name: str, lo: int, hi: int) -> int:
    return check_int(require(obj, name), name, lo, hi)


def require_list(obj: Mapping[str, object], name: str) -> list[object]:
    value = require(obj, name)
    if type(value) is not list:
        raise SchemaError(
            ErrorKind.WRONG_TYPE, f"field {name!r}: expected a list, got {show(value)}"
        )
    return value


def optional_map(obj: Mapping[str, object], name: str) -> dict[str, object] | None:
    """A nested map with string keys, or None when absent or null."""
    value = obj.get(name)
    return None if value is None else check_map(value, name)


def check_str(value: object, name: str, max_len: int = MAX_ID_LEN) -> str:
    """A non-empty str of at most ``max_len`` characters."""
    if type(value) is not str:
        raise SchemaError(ErrorKind.WRONG_TYPE, f"field {name!r}: expected str, got {show(value)}")
    if not 0 < len(value) <= max_len:
        raise SchemaError(
            ErrorKind.OUT_OF_RANGE,
            f"field {name!r}: length {len(value)} not in [1, {max_len}]: {show(value)}",
        )
    return value


def check_int(value: object, name: str, lo: int, hi: int) -> int:
    """An integer in [lo, hi]; bool and float are rejected (True is not 1, 1.0 is not 1)."""
    if type(value) is not int:
        raise SchemaError(ErrorKind.WRONG_TYPE, f"field {name!r}: expected int, got {show(value)}")
    if not lo <= value <= hi:
        raise SchemaError(ErrorKind.OUT_OF_RANGE, f"field {name!r}: {value} not in [{lo}, {hi}]")
    return value


def check_float(value: object, name: str) -> float:
    """A finite number (int or float, not bool), returned as float."""
    if type(value) is not float and type(value) is not int:
        raise SchemaError(
            ErrorKind.WRONG_TYPE, f"field {name!r}: expected a number, got {show(value)}"
        )
    if not math.isfinite(value):
        raise SchemaError(ErrorKind.OUT_OF_RANGE, f"field {name!r}: {value} is not finite")
    return float(value)


def check_map(value: object, name: str) -> dict[str, object]:
    """A map whose keys are all str (values unchecked)."""
    if type(value) is not dict:
        raise SchemaError(
            ErrorKind.WRONG_TYPE, f"field {name!r}: expected a map, got {show(value)}"
        )
    for key in value:
        if type(key) is not str:
            raise SchemaError(
                ErrorKind.WRONG_TYPE, f"field {name!r}: map key must be str, got {show(key)}"
            )
    return value
