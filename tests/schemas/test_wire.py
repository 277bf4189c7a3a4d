import msgpack
import orjson
import pytest

from streamrec.errors import SchemaError
from streamrec.schemas.validation import ErrorKind
from streamrec.schemas.wire import (
    WireFormat,
    detect_format,
    dumps,
    format_from_content_type,
    loads,
    sniff_format,
)

MSGPACK_MAP = msgpack.packb({"a": 1})
JSON_MAP = orjson.dumps({"a": 1})


@pytest.mark.parametrize(
    ("value", "fmt"),
    [
        (b"application/msgpack", WireFormat.MSGPACK),
        (b"application/x-msgpack", WireFormat.MSGPACK),
        ("Application/X-MsgPack", WireFormat.MSGPACK),
        (b"application/json", WireFormat.JSON),
        (b"application/json; charset=utf-8", WireFormat.JSON),
        (b" APPLICATION/JSON ", WireFormat.JSON),
    ],
)
def test_content_type_header_values(value: bytes | str, fmt: WireFormat) -> None:
    assert format_from_content_type(value) is fmt


@pytest.mark.parametrize("value", [b"text/plain", b"", None, b"\xff\xfe"])
def test_unsupported_content_type_names_the_value(value: bytes | None) -> None:
    with pytest.raises(SchemaError) as info:
        format_from_content_type(value)
    assert info.value.kind == ErrorKind.UNSUPPORTED_FORMAT
    assert "content-type" in str(info.value)
    if value:
        assert repr(value)[:8] in str(info.value)


def test_sniffing_first_byte() -> None:
    assert sniff_format(MSGPACK_MAP) is WireFormat.MSGPACK
    assert (
        sniff_format(msgpack.packb({str(i): i for i in range(20)})) is WireFormat.MSGPACK
    )  # map16
    assert sniff_format(JSON_MAP) is WireFormat.JSON
    assert sniff_format(b' \n\t{"a": 1}') is WireFormat.JSON
    assert sniff_format(b"[1]") is WireFormat.JSON
    assert sniff_format(b"hello") is WireFormat.MSGPACK  # the default decoder names the problem
    assert sniff_format(b"") is WireFormat.MSGPACK


def test_header_wins_over_sniffing_and_key_is_case_insensitive() -> None:
    assert detect_format(JSON_MAP, [("Content-Type", b"application/msgpack")]) is WireFormat.MSGPACK
    assert detect_format(MSGPACK_MAP, [("trace", b"x"), ("content-type", b"application/json")]) is (
        WireFormat.JSON
    )
    assert detect_format(JSON_MAP, [("trace", b"x")]) is WireFormat.JSON
    assert detect_format(MSGPACK_MAP) is WireFormat.MSGPACK


@pytest.mark.parametrize("fmt", list(WireFormat))
def test_loads_dumps_round_trip_and_undecodable(fmt: WireFormat) -> None:
    obj = {"a": [1, 2.5, "x", None, True], "b": {"c": -3}}
    assert loads(dumps(obj, fmt), fmt) == obj
    for bad in (b"", dumps(obj, fmt)[:-3]):
        with pytest.raises(SchemaError) as info:
            loads(bad, fmt)
        assert info.value.kind == ErrorKind.UNDECODABLE


def test_dumps_unserialisable_is_a_schema_error() -> None:
    with pytest.raises(SchemaError) as info:
        dumps({"a": object()}, WireFormat.JSON)
    assert info.value.kind == ErrorKind.WRONG_TYPE
