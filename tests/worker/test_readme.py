"""The README's configuration reference, wire examples and quick start match the code."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

import pytest

from streamrec.schemas.codec import decode_event
from streamrec.schemas.events import EventKind, InteractionEvent, PlaybackEvent
from streamrec.schemas.records import DeadLetter, Recommendation
from streamrec.schemas.wire import WireFormat
from streamrec.tools.devbroker import free_port
from streamrec.worker.config import config_fields

README = Path(__file__).resolve().parents[2] / "README.md"


def json_blocks(text: str) -> list[bytes]:
    return [block.encode() for block in re.findall(r"```json\n(.*?)```", text, re.S)]


def test_every_config_field_is_documented_with_its_env_var() -> None:
    text = README.read_text()
    missing = [f.env_var for f in config_fields() if f"`{f.env_var}`" not in text]
    assert missing == []


def test_wire_examples_decode_with_the_schemas() -> None:
    playback, interaction, recommendation, dead_letter = json_blocks(README.read_text())
    assert isinstance(decode_event(playback, EventKind.PLAYBACK), PlaybackEvent)
    assert decode_event(interaction, EventKind.INTERACTION) == InteractionEvent(
        "u1", "i9", 1764529201000, "like"
    )
    rec = Recommendation.from_bytes(recommendation, WireFormat.JSON)
    assert rec.item_ids == ["i42", "i7", "i9"]
    letter = DeadLetter.from_bytes(dead_letter, WireFormat.JSON)
    assert letter.value == b'{"user_id":"u1","item_id":"i9","ts_ms":-5,"action":"like"}'
    assert (letter.topic, letter.partition, letter.offset) == ("interaction-events", 3, 1207)


# ---------------------------------------------------------------------- the quick start

QUICKSTART = "<!-- quickstart:"
EXAMPLES = README.parent / "examples"


def quickstart_commands(text: str) -> list[str]:
    """The commands of the README's quick-start block, comments stripped."""
    block = re.search(r"```sh\n(.*?)```", text.split(QUICKSTART, 1)[1], re.S)
    assert block is not None, "no ```sh block after the quick-start marker"
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


@pytest.mark.broker
@pytest.mark.slow
def test_the_quick_start_works_as_written(tmp_path: Path) -> None:
    """Broker -> train -> worker -> produce -> consume -> stop, command by command as the
    README has them (`&` starts a background job, `kill %N` stops it with SIGTERM). The
    environment moves the broker and the HTTP port to free ones: it beats the file."""
    commands = quickstart_commands(README.read_text())
    assert commands[0] == "streamrec broker &" and commands[-1].startswith("kill %")
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    bin_dir = Path(sys.executable).parent
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("STREAMREC_")},
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "STREAMREC_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
        "STREAMREC_HTTP__PORT": "0",
        "OMP_NUM_THREADS": "1",
    }
    jobs: list[subprocess.Popen[str]] = []
    logs: list[TextIO] = []
    outputs: dict[str, str] = {}
    try:
        for line in commands:
            argv = shlex.split(line.removesuffix("&"))
            if line.endswith("&"):
                log = (tmp_path / f"job{len(jobs) + 1}.log").open("w")
                logs.append(log)
                jobs.append(
                    subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=log, text=True)
                )
                if argv[1] == "broker":  # as a person would: wait for its address line
                    wait_for_line(tmp_path / "job1.log", "dev broker at", jobs[-1])
            elif argv[0] == "kill":
                for spec in argv[1:]:
                    job = jobs[int(spec.removeprefix("%")) - 1]
                    job.send_signal(signal.SIGTERM)
                    assert job.wait(timeout=60) == 0, (tmp_path / f"job{spec[1:]}.log").read_text()
            else:
                done = subprocess.run(
                    argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
                    check=False,
                )  # fmt: skip
                assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
                outputs[argv[1]] = done.stdout
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait()
        for log in logs:
            log.close()
    recs = [Recommendation.from_bytes(line.encode(), WireFormat.JSON)
            for line in outputs["consume"].splitlines()]  # fmt: skip
    assert len(recs) == 3
    assert {r.user_id for r in recs} <= {"u1", "u2", "u3"}
    assert all(len(r.items) > 0 and r.model_version for r in recs)
    assert "dev broker stopped" in (tmp_path / "job1.log").read_text()


def wait_for_line(path: Path, needle: str, job: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while needle not in path.read_text():
        assert job.poll() is None, path.read_text()
        assert time.monotonic() < deadline, f"no {needle!r} in {path}"
        time.sleep(0.1)
