from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from streamrec.worker.config import LogConfig
from streamrec.worker.logging_setup import RepeatFilter, configure_logging, resolve_format


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    aiokafka_level = logging.getLogger("aiokafka").level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("aiokafka").setLevel(aiokafka_level)


def test_auto_is_text_on_a_tty_and_json_otherwise() -> None:
    auto = LogConfig(format="auto")
    assert resolve_format(auto, FakeTty()) == "text"
    assert resolve_format(auto, io.StringIO()) == "json"
    assert resolve_format(LogConfig(format="json"), FakeTty()) == "json"
    assert resolve_format(LogConfig(format="text"), io.StringIO()) == "text"


@pytest.mark.usefixtures("restore_root_logger")
def test_json_lines_carry_extras_and_exceptions() -> None:
    stream = io.StringIO()
    configure_logging(LogConfig(format="auto", level="debug"), stream)
    log = logging.getLogger("streamrec.test")
    log.debug("assigned %d partitions", 3, extra={"topic": "pb", "generation": 7})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["msg"] == "assigned 3 partitions"
    assert (first["level"], first["logger"]) == ("DEBUG", "streamrec.test")
    assert (first["topic"], first["generation"]) == ("pb", 7)
    assert isinstance(first["ts"], float)
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exc"]


@pytest.mark.usefixtures("restore_root_logger")
def test_text_format_and_level_filtering() -> None:
    stream = FakeTty()
    configure_logging(LogConfig(format="auto", level="WARNING"), stream)
    log = logging.getLogger("streamrec.test")
    log.info("hidden")
    log.warning("shown %s", "here")
    out = stream.getvalue()
    assert "hidden" not in out
    assert "WARNING" in out and "streamrec.test: shown here" in out
    assert not out.lstrip().startswith("{")


@pytest.mark.usefixtures("restore_root_logger")
def test_text_lines_show_the_extra_fields_before_the_traceback() -> None:
    stream = FakeTty()
    configure_logging(LogConfig(format="auto", level="INFO"), stream)
    log = logging.getLogger("streamrec.test")
    log.info("http listening", extra={"host": "0.0.0.0", "port": 9400})
    log.info("partitions assigned", extra={"partitions": [["pb", 0]], "why": "a b"})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed", extra={"offset": 7})
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("streamrec.test: http listening host=0.0.0.0 port=9400")
    assert lines[1].endswith('partitions assigned partitions=[["pb",0]] why="a b"')
    assert lines[2].endswith("failed offset=7")
    assert lines[3] == "Traceback (most recent call last):"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_repeat_filter_passes_one_line_per_interval_with_the_count() -> None:
    clock = FakeClock()
    limiter = RepeatFilter(10.0, clock=clock)

    def record(name: str, msg: str, level: int = logging.ERROR) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, msg, ("node 0",), None)

    template = "Unable connect to node with id %s"
    assert limiter.filter(record("aiokafka.conn", template))
    passed = []
    for n in range(40):  # ~40 a second, as seen with the broker stopped
        clock.now = 0.025 * (n + 1)
        passed.append(limiter.filter(record("aiokafka.conn", template)))
    assert not any(passed)
    # other templates, other loggers and lower levels are not held back meanwhile
    assert limiter.filter(record("aiokafka.client", "Unable to update metadata"))
    assert limiter.filter(record("streamrec.worker", template))
    assert limiter.filter(record("aiokafka.conn", template, logging.INFO))
    clock.now = 10.5
    nxt = record("aiokafka.conn", template)
    assert limiter.filter(nxt)
    assert (nxt.suppressed, nxt.interval_s) == (40, 10.0)  # type: ignore[attr-defined]


@pytest.mark.usefixtures("restore_root_logger")
def test_configured_handler_rate_limits_aiokafka() -> None:
    stream = io.StringIO()
    configure_logging(LogConfig(format="json", level="INFO"), stream, repeat_interval_s=60.0)
    conn = logging.getLogger("aiokafka.conn")
    for _ in range(50):
        conn.error("Unable connect to node with id %s: %s", 0, "refused")
    logging.getLogger("streamrec.test").warning("still here")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["logger"] for line in lines] == ["aiokafka.conn", "streamrec.test"]
