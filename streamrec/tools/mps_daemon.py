"""NVIDIA MPS for the worker processes that share one GPU (``--workers-per-gpu`` > 1).

Without MPS the GPU time-slices between the CUDA contexts of several processes: one
process's kernels never run beside another's, and each switch costs. With MPS the
processes' kernels go through one server context and run concurrently. On the H200 (three
AOTI workers, HSTU-8L, 2026-12-04, BENCHMARKS.md issue 13) that turned 10,000 events/s
from not sustained (9,596/s, the workers' own p99 203 ms) into sustained (9,751/s, p99
57 ms).

``MpsDaemon`` starts ``nvidia-cuda-mps-control -d`` with a private pipe and log directory
(never the system's ``/tmp/nvidia-mps``, so it cannot collide with or stop another user's
daemon), gives the children the two ``CUDA_MPS_*`` variables that make them its clients,
and sends ``quit`` when the supervisor ends. Where the environment already names a
daemon (``CUDA_MPS_PIPE_DIRECTORY`` set, e.g. the Kubernetes device plugin's MPS sharing)
the children inherit it and nothing is started.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Final

from streamrec.errors import SupervisorError

log = logging.getLogger(__name__)

CONTROL_BINARY: Final = "nvidia-cuda-mps-control"
PIPE_ENV: Final = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV: Final = "CUDA_MPS_LOG_DIRECTORY"
MPS_MODES: Final = ("auto", "on", "off")
START_TIMEOUT_S: Final = 10.0


def wants_mps(mode: str, workers_per_gpu: int, binary: str | None) -> bool:
    """Whether the supervisor starts a daemon: ``on`` always (a missing binary is an
    error), ``auto`` when GPUs are shared (N > 1) and the binary is on PATH, ``off`` never."""
    if mode not in MPS_MODES:
        raise SupervisorError(f"--mps {mode!r}: must be one of {', '.join(MPS_MODES)}")
    if mode == "on" and binary is None:
        raise SupervisorError(
            f"--mps on: {CONTROL_BINARY} is not on PATH (the NVIDIA driver's utilities; "
            "in a container, NVIDIA_DRIVER_CAPABILITIES must include compute)"
        )
    return mode == "on" or (mode == "auto" and workers_per_gpu > 1 and binary is not None)


class MpsDaemon:
    """One MPS control daemon for the supervisor's lifetime (a context manager).

    ``environ()`` is what the children add to their environment. The daemon is started by
    ``__enter__`` and told to quit by ``__exit__``; its directories are removed then.
    """

    def __init__(self, binary: str, root: Path | None = None) -> None:
        self._binary = binary
        self._root = root
        self._dir: Path | None = None

    @classmethod
    def for_mode(
        cls, mode: str, workers_per_gpu: int, parent: Mapping[str, str]
    ) -> MpsDaemon | None:
        """The daemon ``mode`` asks for, or None (off, not wanted, or one already named
        by ``parent``'s environment, which the children then inherit)."""
        binary = shutil.which(CONTROL_BINARY, path=parent.get("PATH"))
        if not wants_mps(mode, workers_per_gpu, binary):
            if mode == "auto" and workers_per_gpu > 1:
                log.info("no MPS: %s not on PATH; the GPU time-slices its workers", CONTROL_BINARY)
            return None
        if parent.get(PIPE_ENV):
            log.info("MPS: using the daemon at %s=%s", PIPE_ENV, parent[PIPE_ENV])
            return None
        assert binary is not None
        return cls(binary)

    def environ(self) -> dict[str, str]:
        if self._dir is None:
            raise SupervisorError("MpsDaemon.environ() before the daemon was started")
        return {PIPE_ENV: str(self._dir / "pipe"), LOG_ENV: str(self._dir / "log")}

    def __enter__(self) -> MpsDaemon:
        self._dir = Path(tempfile.mkdtemp(prefix="streamrec-mps-", dir=self._root))
        env = self.environ()
        for path in env.values():
            Path(path).mkdir()
        done = subprocess.run(
            [self._binary, "-d"],
            check=False,
            env=os.environ | env,
            capture_output=True,
            timeout=30,
        )
        if done.returncode != 0:
            self._cleanup()
            raise SupervisorError(
                f"{self._binary} -d exited {done.returncode}: "
                f"{done.stderr.decode(errors='replace').strip() or 'no message'}"
            )
        control = Path(env[PIPE_ENV]) / "control"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not control.exists():
            if time.monotonic() > deadline:
                self._quit()
                self._cleanup()
                raise SupervisorError(f"MPS control daemon: no {control} after {START_TIMEOUT_S} s")
            time.sleep(0.02)
        log.info("MPS daemon started", extra={"mps_pipe": env[PIPE_ENV]})
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._quit()
        self._cleanup()

    def _quit(self) -> None:
        """``quit`` on the control pipe: the daemon and its server exit once their
        clients have (the children are gone by now)."""
        if self._dir is None:
            return
        try:
            done = subprocess.run(
                [self._binary], check=False, input=b"quit\n",
                env=os.environ | self.environ(), capture_output=True, timeout=30,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("MPS daemon did not take quit: %s", exc)
            return
        if done.returncode != 0:
            log.warning("MPS daemon quit exited %d", done.returncode)
        else:
            log.info("MPS daemon stopped")

    def _cleanup(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
