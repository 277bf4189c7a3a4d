"""``streamrec produce``: all or nothing by default, ``--skip-invalid``, ``--dry-run``
(issue 17, item 8)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from streamrec.schemas.codec import decode_batch
from streamrec.schemas.events import EventKind, PlaybackEvent
from streamrec.tools.cli import main
from streamrec.tools.devbroker import DevBroker, free_port
from tests.tools.topic_reader import as_raw, consume

LINES = [
    '{"user_id":"u1","item_id":"a","ts_ms":5,"ms_played":900,"duration_ms":1000}',
    "",
    '{"user_id":"u2","item_id":"b","ts_ms":-1,"ms_played":1,"duration_ms":2}',
    "not json",
    '{"user_id":"u2","item_id":"c","ts_ms":7,"ms_played":1,"duration_ms":2,"x":1}',
]


def events_file(tmp_path: Path, lines: list[str]) -> Path:
    source = tmp_path / "events.jsonl"
    source.write_text("\n".join(lines) + "\n")
    return source


def produce(topic: str, source: Path, bootstrap: str, *extra: str) -> int:
    return main(
        [
            "produce",
            "--topic",
            topic,
            "--kind",
            "playback",
            "--format",
            "json",
            "--file",
            str(source),
            "--bootstrap-servers",
            bootstrap,
            *extra,
        ]
    )


def assert_reports_lines_3_and_4(err: str) -> None:
    assert "line 3:" in err and "ts_ms" in err and "-1" in err
    assert "line 4:" in err
    assert "line 1:" not in err and "line 5:" not in err


@pytest.mark.broker
def test_invalid_lines_mean_nothing_is_sent_then_the_fixed_file_goes_once(
    broker: DevBroker,
    unique_topic: Callable[[str], str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = unique_topic("pb")
    broker.create_topics({topic: 2})
    assert produce(topic, events_file(tmp_path, LINES), broker.bootstrap_servers) == 1
    err = capsys.readouterr().err
    assert_reports_lines_3_and_4(err)
    assert "sent 0" in err and "2 invalid" in err and "nothing was sent" in err
    assert "--skip-invalid" in err
    assert asyncio.run(consume(broker.bootstrap_servers, topic, 1, timeout_s=2.0)) == []

    fixed = [LINES[0], LINES[4]]
    assert produce(topic, events_file(tmp_path, fixed), broker.bootstrap_servers) == 0
    assert "sent 2" in capsys.readouterr().err
    records = asyncio.run(consume(broker.bootstrap_servers, topic, 3, timeout_s=3.0))
    assert len(records) == 2  # the first attempt sent nothing, so no duplicates
    assert sorted(r.key for r in records) == [b"u1", b"u2"]


@pytest.mark.broker
def test_skip_invalid_sends_the_valid_lines(
    broker: DevBroker,
    unique_topic: Callable[[str], str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = unique_topic("pb")
    broker.create_topics({topic: 2})
    source = events_file(tmp_path, LINES)
    assert produce(topic, source, broker.bootstrap_servers, "--skip-invalid") == 0
    err = capsys.readouterr().err
    assert_reports_lines_3_and_4(err)
    assert "sent 2" in err and "2 invalid" in err and "1 blank" in err

    records = asyncio.run(consume(broker.bootstrap_servers, topic, 2))
    assert sorted(r.key for r in records) == [b"u1", b"u2"]
    assert {dict(r.headers)["content-type"] for r in records} == {b"application/json"}
    events = decode_batch([as_raw(r) for r in records], EventKind.PLAYBACK).events
    assert sorted(e.event.item_id for e in events) == ["a", "c"]
    assert all(isinstance(e.event, PlaybackEvent) for e in events)
    assert json.loads(next(r.value for r in records if r.key == b"u1")) == {
        "user_id": "u1",
        "item_id": "a",
        "ts_ms": 5,
        "ms_played": 900,
        "duration_ms": 1000,
    }


def test_dry_run_validates_without_a_broker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens: a dry run never connects
    assert produce("t", events_file(tmp_path, LINES), nobody, "--dry-run") == 1
    err = capsys.readouterr().err
    assert_reports_lines_3_and_4(err)
    assert "dry run: 2 valid lines would be sent" in err
    fixed = events_file(tmp_path, [LINES[0], LINES[4]])
    assert produce("t", fixed, nobody, "--dry-run") == 0
    assert "dry run: 2 valid lines would be sent" in capsys.readouterr().err
