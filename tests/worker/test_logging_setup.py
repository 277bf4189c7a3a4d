from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from streamrec.worker.config import LogConfig
from streamrec.worker.logging_setup import configure_logging, resolve_format


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
