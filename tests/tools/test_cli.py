from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord

from streamrec.schemas.codec import RawRecord, decode_batch
from streamrec.schemas.events import EventKind, InteractionEvent, PlaybackEvent
from streamrec.tools.cli import main
from streamrec.tools.devbroker import DevBroker

STREAMREC = Path(sys.executable).with_name("streamrec")  # the installed console script


async def consume(
    bootstrap: str, topic: str, count: int, timeout_s: float = 10.0
) -> list[ConsumerRecord[bytes, bytes]]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    records: list[ConsumerRecord[bytes, bytes]] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(records) < count and loop.time() < deadline:
            batches = await consumer.getmany(timeout_ms=200)
            for batch in batches.values():
                records.extend(batch)
    finally:
        await consumer.stop()
    return records


def as_raw(record: ConsumerRecord[bytes, bytes]) -> RawRecord:
    return RawRecord(
        value=record.value,
        headers=tuple(record.headers),
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key,
    )


@pytest.mark.broker
async def test_acceptance_produce_console_script_to_interaction_events() -> None:
    """Issue 2, acceptance 2: stdin -> `streamrec produce` -> interaction-events -> decode.

    Its own broker, so the fixed topic name cannot clash with other tests' topics.
    """
    async with DevBroker() as broker:
        await broker.create_topics_async({"interaction-events": 4})
        await _produce_and_decode_one(broker)


async def _produce_and_decode_one(broker: DevBroker) -> None:
    line = b'{"user_id":"u1","item_id":"i9","ts_ms":1,"action":"like"}\n'
    proc = await asyncio.create_subprocess_exec(
        str(STREAMREC),
        "produce",
        "--topic",
        "interaction-events",
        "--bootstrap-servers",
        broker.bootstrap_servers,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _out, err = await asyncio.wait_for(proc.communicate(line), timeout=60)
    assert proc.returncode == 0, err.decode()
    assert b"sent 1" in err

    records = await consume(broker.bootstrap_servers, "interaction-events", 1)
    assert len(records) == 1
    record = records[0]
    assert record.key == b"u1"
    assert dict(record.headers)["content-type"] == b"application/msgpack"
    decoded = decode_batch([as_raw(record)], EventKind.INTERACTION)
    assert decoded.errors == []
    assert [d.event for d in decoded.events] == [
        InteractionEvent(user_id="u1", item_id="i9", ts_ms=1, action="like")
    ]


@pytest.mark.broker
def test_produce_reports_invalid_lines_and_sends_valid_ones(
    broker: DevBroker,
    unique_topic: Callable[[str], str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = unique_topic("pb")
    broker.create_topics({topic: 2})
    lines = [
        '{"user_id":"u1","item_id":"a","ts_ms":5,"ms_played":900,"duration_ms":1000}',
        "",
        '{"user_id":"u2","item_id":"b","ts_ms":-1,"ms_played":1,"duration_ms":2}',
        "not json",
        '{"user_id":"u2","item_id":"c","ts_ms":7,"ms_played":1,"duration_ms":2,"x":1}',
    ]
    source = tmp_path / "events.jsonl"
    source.write_text("\n".join(lines) + "\n")
    status = main(
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
            broker.bootstrap_servers,
        ]
    )
    err = capsys.readouterr().err
    assert status == 1
    assert "line 3:" in err and "ts_ms" in err and "-1" in err
    assert "line 4:" in err
    assert "line 1:" not in err and "line 5:" not in err
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


def test_produce_needs_kind_for_unknown_topic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "e.jsonl"
    source.write_text("")
    status = main(["produce", "--topic", "mystery", "--file", str(source)])
    err = capsys.readouterr().err
    assert status == 1
    assert "'mystery'" in err and "--kind" in err


def test_produce_missing_file_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["produce", "--topic", "playback-events", "--file", str(tmp_path / "nope")])
    assert status == 1
    assert "nope" in capsys.readouterr().err


def test_produce_unreachable_broker_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamrec.tools.devbroker import free_port

    source = tmp_path / "e.jsonl"
    source.write_text('{"user_id":"u1","item_id":"i9","ts_ms":1,"action":"like"}\n')
    args = ["produce", "--topic", "interaction-events", "--file", str(source)]
    status = main([*args, "--bootstrap-servers", f"127.0.0.1:{free_port()}"])
    assert status == 1
    assert "cannot reach Kafka" in capsys.readouterr().err


def test_export_of_a_missing_model_dir_fails_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-model"
    status = main(["export", "--model-dir", str(missing), "--cache-dir", str(tmp_path / "c")])
    assert status == 1
    assert str(missing) in capsys.readouterr().err


def test_bench_names_are_checked_and_need_a_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as usage:
        main(["bench", "no-such-bench"])
    assert usage.value.code == 2
    monkeypatch.chdir(tmp_path)  # no bench/ here
    assert main(["bench", "engine"]) == 1
    assert "source checkout" in capsys.readouterr().err


def test_config_show_json_applies_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STREAMREC_GROUP__GROUP_ID", "from-env")
    monkeypatch.setenv("STREAMREC_HTTP__PORT", "1111")
    status = main(
        [
            "config",
            "show",
            "--format",
            "json",
            "--http-port",
            "2222",
            "--input-topics",
            "pb,ia",
            "--dlq-topic",
            "dead",
            "--require-aoti",
            "--set",
            "cache.block_size=32",
        ]
    )
    assert status == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["http"]["port"] == 2222
    assert shown["group"]["group_id"] == "from-env"
    assert (shown["topics"]["playback"], shown["topics"]["interaction"]) == ("pb", "ia")
    assert shown["topics"]["dead_letter"] == "dead"
    assert shown["model"]["require_aoti"] is True
    assert shown["cache"]["block_size"] == 32


def test_config_show_toml_round_trips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("STREAMREC_CONFIG", raising=False)
    assert main(["config", "show", "--store", "redis://h:1/0", "--model", "m/x"]) == 0
    rendered = capsys.readouterr().out
    assert "STREAMREC_STORE__URL" in rendered  # each line names its environment variable
    saved = tmp_path / "effective.toml"
    saved.write_text(rendered)
    assert main(["config", "show", "--format", "json", "--config", str(saved)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["store"]["url"] == "redis://h:1/0"
    assert shown["model"]["model_dir"] == "m/x"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["config", "show", "--http-port", "x"], "http.port = 'x'"),
        (["config", "show", "--input-topics", "only-one"], "--input-topics 'only-one'"),
        (["config", "show", "--set", "nokey"], "--set 'nokey'"),
        (["config", "show", "--set", "http.nope=1"], "'http.nope'"),
    ],
)
def test_config_errors_exit_1_with_message(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 1
    assert needle in capsys.readouterr().err


def test_unknown_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["config", "show", "--bogus"])
    assert exit_.value.code == 2
    assert "--bogus" in capsys.readouterr().err
