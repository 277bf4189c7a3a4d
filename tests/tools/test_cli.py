from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamrec.schemas.codec import decode_batch
from streamrec.schemas.events import EventKind, InteractionEvent
from streamrec.tools.cli import build_parser, effective_config, main
from streamrec.tools.devbroker import DevBroker
from tests.tools.topic_reader import as_raw, consume

STREAMREC = Path(sys.executable).with_name("streamrec")  # the installed console script


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
    status = main(["export", "--model", str(missing), "--cache-dir", str(tmp_path / "c")])
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
            "--backend",
            "aoti",
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
    assert shown["model"]["backend"] == "aoti"
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


# ---------------------------------------------------------------------- issue 17


def run_cli(*argv: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(STREAMREC), *argv], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_help_imports_neither_torch_nor_aiokafka() -> None:
    """``streamrec --help`` (and the Kafka-only commands' help) stays fast: measured in
    the issue's report, not here; here: the heavy modules are simply never imported."""
    probe = (
        "import sys\n"
        "from streamrec.tools.cli import build_parser, effective_config, main\n"
        "for argv in (['--help'], ['run', '--help'], ['produce', '--help'], ['broker', '-h']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'aiokafka') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["run"], ["(config default: 127.0.0.1:9092)", "model.device", "(config default: auto)"]),
        (["produce"], ["(default: msgpack)", "--dry-run", "--skip-invalid"]),
        (["train"], ["(default: 10)", "(default: auto)", "(default: 0)"]),
        (["eval"], ["(default: 10)", "(default: auto)"]),
        (["export"], ["(config default: .streamrec-cache/model)", "(config default: auto)"]),
        (["broker"], ["(default: 4)", "kafka.bootstrap_servers"]),
        (["demo"], ["(default: 1000.0)", "(default: 3000)", "--ratings"]),
    ],
)
def test_help_shows_the_defaults(
    argv: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for needle in needles:
        assert needle in text, needle
    assert "(default: None)" not in text


def test_device_defaults_agree() -> None:
    """train/eval default to auto like run/export (model.device)."""
    parser = build_parser()
    for argv in (["train", "--out", "x"], ["eval", "--model", "x"]):
        assert parser.parse_args(argv).device == "auto"
    assert effective_config(parser.parse_args(["run"])).model.device == "auto"
    assert effective_config(parser.parse_args(["export"])).model.device == "auto"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["train", "--synthetic", "--out", "{tmp}/m", "--device", "gpu"],
            "streamrec train: error: --device 'gpu': expected one of auto, cpu, cuda",
        ),
        (
            ["eval", "--model", "{tmp}/m", "--device", "gpu"],
            "streamrec eval: error: --device 'gpu': expected one of auto, cpu, cuda",
        ),
        (
            ["export", "--model", "{tmp}/m", "--device", "gpu"],
            "streamrec export: error: model.device = 'gpu': must be one of",
        ),
        (["run", "--device", "gpu"], "streamrec run: error: model.device = 'gpu': must be one of"),
    ],
)
def test_a_wrong_device_is_one_line_and_status_1(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
@pytest.mark.parametrize("command", ["train", "eval", "export"])
def test_cuda_on_a_cpu_only_torch_is_one_line_and_status_1(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = ["--out"] if command == "train" else ["--model"]
    assert main([command, *target, str(tmp_path / "m"), "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'cuda': no CUDA device (torch " in err, err
    assert not (tmp_path / "m").exists()  # stopped before any work


def test_run_on_a_taken_http_port_is_one_line_and_status_1(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli("run", "--http-port", str(port), "--model", str(tmp_path / "m"))
    assert done.returncode == 1
    assert done.stderr == (
        f"streamrec run: error: http.port = {port}: 0.0.0.0:{port} is already in use "
        "(pick another with --http-port, or 0 for any free port)\n"
    )


def test_model_dir_is_a_deprecated_alias_of_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "no-such-model")
    cache = ["--cache-dir", str(tmp_path / "c"), "--device", "cpu"]
    assert main(["export", "--model", missing, *cache]) == 1
    assert "is deprecated" not in capsys.readouterr().err
    assert main(["export", "--model-dir", missing, *cache]) == 1
    err = capsys.readouterr().err
    assert "--model-dir is deprecated; use --model" in err and missing in err
