"""The tests' CPU packages compiled in processes of their own, alongside the session.

An AOTInductor compile of the tiny model runs on one core (the serving package's four
entry points one after the other took 119 s of a cold run on the 2-core machine, the FP8
``extend`` 60 s), so the packages that some tests load are built by background processes
while other tests run, on the cores those tests leave idle. ``Schedule`` (wired in
tests/conftest.py) decides when and next to what:

- Only the builds that a collected test waits for start (its fixture
  ``<name>_prebuilt``), and the modules with such a test run last in the session.
- The builds start with the first worker test (``START_AT``), or with the session when
  it has none: from there on the tests mostly wait on the broker (group joins, session
  timeouts, faults). In a clean-clone run of 721f3c6 on the 2-core machine the worker
  tests kept 20% of the two cores busy (160 s, 61 CPU-s), against 43% for the tools
  tests, 47% for the bench tests and 93% for the AOTI tests. The idle class does not
  keep a build from slowing the tests beside it there (their CPU-bound parts ran about
  half as fast), so where the builds start matters: with the session, they slowed the
  bench tests about as much as they saved (bench 49 -> 92 s, the AOTI modules 96 -> 59 s;
  the whole run 404 -> 430 s); with the tools tests, those took 57 -> 112 s.
- They run in the idle scheduling class (``SCHED_IDLE``, inherited by their compile
  processes and the compiler; nice 19 where there is none), so a waking test thread
  takes its core at once; a build that a test waits for goes back to the normal class
  where the system allows it.

A fixture that needs a package waits for its build and then opens the package with
``compile_if_missing=True`` as before: whatever a build leaves undone (it failed, or none
was started) is compiled there, so the tests assert the same package either way.

``python -m tests.models.aoti_prebuild NAME MODEL_DIR`` builds one of ``BUILDS``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path

import pytest

from streamrec.models.aoti_export import ExportConfig, export_model
from tests.models.aoti_fixtures import (
    CACHE_DIR,
    EXPORT,
    FP8_EXPORT,
    GENERATION,
    REPO,
    tiny_model_dir,
)

# name -> (export settings, entry points compiled at once: one process each)
BUILDS: dict[str, tuple[ExportConfig, int]] = {
    "serving": (EXPORT, 2),  # test_aoti_runtime, test_graphed_model, test_model_loader
    "fp8": (FP8_EXPORT, 1),  # test_quantization
    # test_aoti_extend_scratch; one process: the in-process path of a build (build_package)
    "generation": (GENERATION, 1),
}
WAIT_S = 900.0  # a cold build takes 1-3 min; past this it is stuck and the test compiles
START_AT = "tests/worker/"  # the builds start before the first test under this


class Schedule:
    """The session's builds: which, when they start, and its tests' order around them."""

    def __init__(self, items: list[pytest.Item]) -> None:
        """Reorders ``items`` in place: the modules with a test that waits for a build last."""

        def waits(item: pytest.Item) -> set[str]:
            used = set(getattr(item, "fixturenames", ()))
            return {name for name in BUILDS if f"{name}_prebuilt" in used}

        self.names = set().union(*map(waits, items)) if items else set()
        last = {item.path for item in items if waits(item)}
        items[:] = [i for i in items if i.path not in last] + [i for i in items if i.path in last]
        self.start_at = next((i for i in items if i.nodeid.startswith(START_AT)), None)
        if self.start_at is None or self.start_at.path in last:
            self.start_at = items[0] if items else None
        self.root: Path | None = None
        self.builds: Prebuilds | None = None

    def before(self, item: pytest.Item) -> None:
        """Called before each test's set-up: the builds start before ``start_at``."""
        if item is self.start_at:
            self.start()

    def start(self) -> Prebuilds:
        if self.builds is None:
            self.root = Path(tempfile.mkdtemp(prefix="streamrec-prebuild-"))
            self.builds = Prebuilds(self.names, self.root)
        return self.builds

    def wait(self, name: str) -> None:
        """Until ``name``'s build has ended (started now if it had not been)."""
        self.start().wait(name)

    def stop(self) -> None:
        """At the session's end: builds still running are ended, their files removed."""
        if self.builds is not None:
            self.builds.stop()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


class Prebuilds:
    """One process per named package of ``BUILDS``, started at once; ``wait`` joins one."""

    def __init__(self, names: Collection[str], root: Path) -> None:
        self.logs = {name: root / f"prebuild-{name}.log" for name in BUILDS if name in names}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name, log in self.logs.items():
            model_dir = root / f"{name}-model"  # written by the build (tiny_model_dir)
            with log.open("wb") as out:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "tests.models.aoti_prebuild", name, str(model_dir)],
                    stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                )  # fmt: skip

    def wait(self, name: str) -> None:
        """Until ``name``'s build (if started) has ended, or is ended after ``WAIT_S``;
        its log goes to the test's captured output."""
        if name not in self.procs:
            return
        proc = self.procs[name]
        _set_priority(_group_tasks(proc.pid), idle=False)  # nothing to leave room for now
        try:
            status = proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            status = _end(proc)
        print(f"background build {name!r} exited {status}:\n{self.logs[name].read_text()}")

    def stop(self) -> None:
        """End the builds still running (a module run alone needs only some of them)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                _end(proc)


def _end(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM, then SIGKILL, to the build and its compile processes (its own group),
    until none of them is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)  # raises once the whole group is gone
            except ProcessLookupError:
                return proc.wait()
            proc.poll()  # reap the build itself, so only its children keep the group
            time.sleep(0.1)
    return proc.wait()


def _group_tasks(pgid: int) -> list[int]:
    """The thread ids of every process in group ``pgid`` (a build and its compiles)."""
    tids = []
    for task in Path("/proc").glob("[0-9]*/task/[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            if os.getpgid(int(task.parent.parent.name)) == pgid:
                tids.append(int(task.name))
    return tids


def _set_priority(tids: list[int], idle: bool) -> None:
    """``SCHED_IDLE`` (nice 19 where there is none) for ``idle``, else ``SCHED_OTHER`` at
    nice 0 again: that step needs a privileged caller, so it is best effort."""
    policy = getattr(os, "SCHED_IDLE" if idle else "SCHED_OTHER", None)
    for tid in tids:
        placed = False
        if policy is not None:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(tid, policy, os.sched_param(0))
                placed = True
        if not idle or not placed:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, 19 if idle else 0)


def main(argv: list[str]) -> int:
    name, model_dir = argv
    config, jobs = BUILDS[name]
    _set_priority([int(t) for t in os.listdir("/proc/self/task")], idle=True)
    # the deterministic tiny model: the same package key as the tests' own directories
    tiny_model_dir(Path(model_dir))
    export_model(model_dir, "cpu", CACHE_DIR, config=config, progress=print, jobs=jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
