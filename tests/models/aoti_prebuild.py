"""The tests' CPU packages compiled in processes of their own, alongside the session.

An AOTInductor compile of the tiny model runs on one core (the serving package's four
entry points one after the other took 119 s of a cold run on the 2-core machine, the FP8
``extend`` 60 s), so the first AOTI test module starts the packages that later modules load, and
they compile side by side with the compiles that the export tests do in the pytest
process and its children. Only the builds that a collected test waits for start (its
fixture ``<name>_prebuilt``, tests/models/conftest.py). A fixture that needs one waits
for its process and then opens the package with ``compile_if_missing=True`` as before:
whatever a background build leaves undone (it failed, or no earlier module started it)
is compiled there, so the tests assert the same package either way.

``python -m tests.models.aoti_prebuild NAME MODEL_DIR`` builds one of ``BUILDS``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path

from streamrec.models.aoti_export import ExportConfig, export_model
from tests.models.aoti_fixtures import CACHE_DIR, EXPORT, FP8_EXPORT, REPO

# name -> (export settings, entry points compiled at once: one process each)
BUILDS: dict[str, tuple[ExportConfig, int]] = {
    "serving": (EXPORT, 2),  # test_aoti_runtime, then the pipeline and worker tests
    "fp8": (FP8_EXPORT, 1),  # test_quantization
}
WAIT_S = 900.0  # a cold build takes 1-3 min; past this it is stuck and the test compiles


class Prebuilds:
    """One process per named package of ``BUILDS``, started at once; ``wait`` joins one."""

    def __init__(self, names: Collection[str], model_dir: Path, log_dir: Path) -> None:
        self.logs = {name: log_dir / f"prebuild-{name}.log" for name in BUILDS if name in names}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name, log in self.logs.items():
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


def main(argv: list[str]) -> int:
    name, model_dir = argv
    config, jobs = BUILDS[name]
    export_model(model_dir, "cpu", CACHE_DIR, config=config, progress=print, jobs=jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
