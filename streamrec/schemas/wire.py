"""The two wire formats (msgpack, JSON) and how a record's format is recognised.

A producer says which format it wrote in a ``content-type`` header; producers that set no
headers are common, so without one the first byte decides: every event and output record
is a map, and a msgpack map starts with 0x80-0x8f/0xde/0xdf while a JSON object starts with
``{`` (possibly after whitespace). Anything else is tried as msgpack, the default, whose
decoder then names the problem.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Final

import msgpack
import orjson

from streamrec.errors import SchemaError
from streamrec.schemas.validation import ErrorKind, show


class WireFormat(enum.Enum):
    """A wire format; the value is the canonical content-type a producer should set."""

    MSGPACK = "application/msgpack"
    JSON = "application/json"

    @property
    def content_type(self) -> str:
        return self.value


CONTENT_TYPE_HEADER: Final = "content-type"

Headers = Sequence[tuple[str, bytes | None]]  # as aiokafka hands them over

_BY_CONTENT_TYPE: Final = {
    "application/msgpack": WireFormat.MSGPACK,
    "application/x-msgpack": WireFormat.MSGPACK,
    "application/vnd.msgpack": WireFormat.MSGPACK,
    "application/json": WireFormat.JSON,
}

_BY_CONTENT_TYPE_BYTES: Final = {name.encode(): fmt for name, fmt in _BY_CONTENT_TYPE.items()}

_JSON_FIRST_BYTES: Final = frozenset(b"{[ \t\r\n")
_MSGPACK_MAP_FIRST_BYTES: Final = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
# First byte -> format, so sniffing is one tuple index on the hot path.
SNIFF_TABLE: Final = tuple(
    WireFormat.JSON
    if b in _JSON_FIRST_BYTES and b not in _MSGPACK_MAP_FIRST_BYTES
    else WireFormat.MSGPACK
    for b in range(256)
)

# What the decoders raise on malformed input (msgpack's own errors mostly derive from
# ValueError; orjson.JSONDecodeError does). Deep nesting may surface as RecursionError.
DECODE_ERRORS: Final = (
    ValueError,
    TypeError,
    OverflowError,
    RecursionError,
    msgpack.UnpackException,
)


def format_from_content_type(value: bytes | str | None) -> WireFormat:
    """Parse a content-type header value (parameters such as ``; charset=utf-8`` ignored)."""
    exact = _BY_CONTENT_TYPE_BYTES.get(value) if isinstance(value, bytes) else None
    if exact is not None:  # the usual case: a canonical value, no parsing needed
        return exact
    if isinstance(value, bytes):
        text = value.decode("latin-1")
    elif isinstance(value, str):
        text = value
    else:
        raise SchemaError(
            ErrorKind.UNSUPPORTED_FORMAT, f"header {CONTENT_TYPE_HEADER!r} has no value"
        )
    fmt = _BY_CONTENT_TYPE.get(text.split(";", 1)[0].strip().lower())
    if fmt is None:
        raise SchemaError(
            ErrorKind.UNSUPPORTED_FORMAT,
            f"header {CONTENT_TYPE_HEADER!r}: unsupported content type {show(value)} "
            f"(expected one of {sorted(_BY_CONTENT_TYPE)})",
        )
    return fmt


def header_format(headers: Headers) -> WireFormat | None:
    """The format named by a content-type header; None when the record has no such header."""
    for key, value in headers:
        if key == CONTENT_TYPE_HEADER or (
            isinstance(key, str) and key.lower() == CONTENT_TYPE_HEADER
        ):
            return format_from_content_type(value)
    return None


def sniff_format(data: bytes) -> WireFormat:
    """Guess the format from the first byte (see the module docstring)."""
    return SNIFF_TABLE[data[0]] if data else WireFormat.MSGPACK


def detect_format(data: bytes, headers: Headers = ()) -> WireFormat:
    """The header's format when there is one, else the sniffed one."""
    fmt = header_format(headers) if headers else None
    return sniff_format(data) if fmt is None else fmt


def loads(data: bytes, fmt: WireFormat) -> object:
    """Parse bytes of a known format; malformed input raises SchemaError(undecodable)."""
    if not data:
        raise SchemaError(ErrorKind.UNDECODABLE, "empty record value")
    try:
        if fmt is WireFormat.MSGPACK:
            return msgpack.unpackb(data, raw=False)
        return orjson.loads(data)
    except DECODE_ERRORS as exc:
        raise SchemaError(ErrorKind.UNDECODABLE, undecodable_reason(fmt, exc)) from exc


def undecodable_reason(fmt: WireFormat, exc: BaseException) -> str:
    text = str(exc)
    if len(text) > 200:
        text = text[:199] + "…"
    return f"not valid {fmt.name.lower()}: {type(exc).__name__}: {text}"


def dumps(obj: object, fmt: WireFormat) -> bytes:
    """Serialise plain data (dicts, lists, str, int, float, bool, None; bytes for msgpack)."""
    try:
        if fmt is WireFormat.MSGPACK:
            return msgpack.packb(obj, use_bin_type=True)
        return orjson.dumps(obj)
    except (TypeError, ValueError, OverflowError) as exc:
        raise SchemaError(
            ErrorKind.WRONG_TYPE, f"cannot encode as {fmt.name.lower()}: {exc}"
        ) from exc
