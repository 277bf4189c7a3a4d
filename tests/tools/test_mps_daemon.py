"""The supervisor's MPS daemon: when it is wanted, and its start/quit protocol.

The CI machine has no GPU and no ``nvidia-cuda-mps-control``; a stand-in script plays the
control binary's part of the protocol (``-d`` creates the control pipe in
``CUDA_MPS_PIPE_DIRECTORY`` and returns; ``quit`` on stdin removes it). The H200 run with
the real daemon is in BENCHMARKS.md (issue 13).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from streamrec.errors import SupervisorError
from streamrec.tools.mps_daemon import LOG_ENV, PIPE_ENV, MpsDaemon, wants_mps

FAKE_CONTROL = """#!/bin/sh
echo "$0 $* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "{calls}"
if [ "$1" = "-d" ]; then
  [ -n "{fail}" ] && {{ echo "{fail}" >&2; exit 3; }}
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
fi
read cmd; echo "stdin $cmd" >> "{calls}"
[ "$cmd" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
"""


def fake_control(tmp_path: Path, fail: str = "") -> tuple[str, Path]:
    calls = tmp_path / "calls.log"
    binary = tmp_path / "bin" / "nvidia-cuda-mps-control"
    binary.parent.mkdir()
    binary.write_text(FAKE_CONTROL.format(calls=calls, fail=fail))
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return str(binary), calls


@pytest.mark.parametrize(
    ("mode", "workers", "binary", "want"),
    [
        ("auto", 1, "/x/mps", False),  # one process per GPU: nothing to share
        ("auto", 3, "/x/mps", True),
        ("auto", 3, None, False),  # no binary: time-sliced, as before
        ("on", 1, "/x/mps", True),
        ("off", 3, "/x/mps", False),
    ],
)
def test_when_a_daemon_is_wanted(mode: str, workers: int, binary: str | None, want: bool) -> None:
    assert wants_mps(mode, workers, binary) is want


def test_on_without_the_binary_and_a_bad_mode_are_one_line_errors() -> None:
    with pytest.raises(SupervisorError, match="nvidia-cuda-mps-control is not on PATH"):
        wants_mps("on", 3, None)
    with pytest.raises(SupervisorError, match="--mps 'sometimes'"):
        wants_mps("sometimes", 3, "/x/mps")


def test_daemon_starts_with_private_directories_and_quits(tmp_path: Path) -> None:
    binary, calls = fake_control(tmp_path)
    with MpsDaemon(binary, root=tmp_path) as daemon:
        env = daemon.environ()
        pipe, logs = Path(env[PIPE_ENV]), Path(env[LOG_ENV])
        assert (pipe / "control").exists() and logs.is_dir()
        assert pipe.parent.parent == tmp_path  # never the system's /tmp/nvidia-mps
        started = calls.read_text().splitlines()
        assert started == [f"{binary} -d pipe={pipe} log={logs}"]
    lines = calls.read_text().splitlines()
    assert lines[1:] == [f"{binary}  pipe={pipe} log={logs}", "stdin quit"]
    assert not pipe.parent.exists()  # directories removed
    with pytest.raises(SupervisorError, match="before the daemon was started"):
        daemon.environ()


def test_a_failing_daemon_names_its_message(tmp_path: Path) -> None:
    binary, _ = fake_control(tmp_path, fail="An instance of this daemon is already running")
    with pytest.raises(SupervisorError, match="exited 3: An instance of this daemon"):
        MpsDaemon(binary, root=tmp_path).__enter__()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "calls.log"]  # nothing left


def test_for_mode_finds_the_binary_and_respects_an_external_daemon(tmp_path: Path) -> None:
    binary, _ = fake_control(tmp_path)
    path = {"PATH": str(Path(binary).parent) + os.pathsep + os.environ.get("PATH", "")}
    assert isinstance(MpsDaemon.for_mode("auto", 3, path), MpsDaemon)
    assert MpsDaemon.for_mode("auto", 1, path) is None
    assert MpsDaemon.for_mode("auto", 3, {"PATH": str(tmp_path)}) is None  # not on PATH
    # a daemon the environment already names (the device plugin's MPS sharing) is used
    assert MpsDaemon.for_mode("on", 3, path | {PIPE_ENV: "/run/mps"}) is None


def test_run_supervised_wraps_the_gpu_children_in_the_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``streamrec run --gpus all --workers-per-gpu 3``: the daemon is up while the
    children run, they get its variables, and it is told to quit after them. (The
    children are not started here: a recording stand-in for ``Supervisor`` sees what
    they would get; the CI machine has no GPU.)"""
    import argparse

    from streamrec.tools import supervisor
    from streamrec.worker.config import WorkerConfig

    binary, calls = fake_control(tmp_path)
    monkeypatch.setenv("PATH", str(Path(binary).parent) + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv(PIPE_ENV, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen: dict[str, object] = {}

    class Recording:
        def __init__(self, children, policy, *, environ=None) -> None:  # type: ignore[no-untyped-def]
            seen["children"] = [spec.name for spec in children]
            seen["environ"] = dict(environ or {})

        def run(self) -> int:
            pipe = seen["environ"].get(PIPE_ENV)  # type: ignore[attr-defined]
            seen["control_while_running"] = pipe is not None and (Path(pipe) / "control").exists()
            return 0

    monkeypatch.setattr(supervisor, "Supervisor", Recording)
    args = argparse.Namespace(
        gpus="all", cpu_children=None, workers_per_gpu=3, dynamic_members=True,
        max_restarts=5, mps="auto",
    )  # fmt: skip
    assert supervisor.run_supervised(WorkerConfig(), args, device_count=lambda: 1) == 0
    assert seen["children"] == ["gpu0-w0", "gpu0-w1", "gpu0-w2"]
    assert seen["control_while_running"] is True
    assert calls.read_text().splitlines()[-1] == "stdin quit"
    # one worker per GPU: no daemon, the children inherit the environment as it is
    seen.clear()
    args.workers_per_gpu = 1
    assert supervisor.run_supervised(WorkerConfig(), args, device_count=lambda: 1) == 0
    assert PIPE_ENV not in seen["environ"]  # type: ignore[operator]
    assert seen["control_while_running"] is False
