"""``streamrec run --gpus``: worker processes for the GPUs of this host, under a supervisor.

One process per GPU (DESIGN §1) and not one process driving several GPUs: each worker
keeps its own event loop, GIL, engine thread and CUDA context, so the host work of one GPU
never queues behind another's. ``--workers-per-gpu N`` runs N processes per GPU, for when
one process's host path (event loop and engine thread under one GIL) saturates its core
before its GPU is busy (issue 13). The children are members of one consumer group exactly
as pods are (Kafka assigns each its partitions; each keeps the KV cache of its own
partitions' users), and the supervisor only does what Kubernetes would otherwise do:

- **Static membership.** Each child gets ``group.group_instance_id = <base>-<name>``, the
  name being ``gpu<N>`` (N the GPU index; ``gpu<N>-w<j>`` for worker j of the GPU with
  ``--workers-per-gpu`` > 1) or ``cpu<i>`` for CPU children, and ``<base>`` the configured
  ``group.group_instance_id`` (the pod name in deploy/) or else the host name. A child
  restarted within ``kafka.session_timeout_ms`` rejoins as the same member and gets its
  partitions back without a group-wide rebalance; past it, the others take them over
  until it returns.
  ``--dynamic-members`` leaves the ids unset: the dev broker (Tansu 0.6 with aiokafka
  0.14) answers a static member's heartbeat with "member id not recognized" every few
  seconds, so a group of static members there rebalances over and over.
- **Pinning.** ``CUDA_VISIBLE_DEVICES`` names the child's one GPU (translated through the
  supervisor's own ``CUDA_VISIBLE_DEVICES`` when that is set) and ``model.device = cuda``;
  CPU children see no GPU and get ``model.device = cpu``.
- **Ports.** Child ``i`` (counted over all children, a GPU's workers next to each other)
  serves ``/metrics``, ``/healthz`` and ``/readyz`` on ``http.port + i`` (0 stays 0: any
  free port). No aggregating endpoint: a probe or a scrape of one child says what that
  child does (deploy/README.md, "Several GPUs per node").
- **Sharing a GPU.** The config says what one GPU gets, and a GPU's N workers split it
  (``share_of_gpu``): ``cache.kv_budget_bytes`` / N when it is set, else
  ``cache.kv_budget_fraction`` / N. That fraction is of the GPU memory a worker sees free
  after its model loads: N workers starting at once each take fraction / N of what they
  see, so together never more than the fraction of the free memory. They take less when
  one measures after a sibling's pool exists (a staggered start, and always a restarted
  child, whose pool then comes out smaller than its siblings'); ``kv_budget_bytes`` gives
  equal, fixed shares. Split too (at least 1 each, 0 stays 0): ``cache.host_tier_bytes``
  (pinned host memory), ``cache.disk_tier_bytes``, and ``model.host_threads``, torch's
  per-process thread count sized for one worker per GPU, which N processes would each
  spin on N times the cores (its default 0 stays: one thread per CUDA worker already).
  Not split, as every process holds its own: the model weights, the CUDA context and
  graphs, the embedding cache's device rows and ``cache.disk_tier_device_slots``.
- **MPS.** With ``--workers-per-gpu`` > 1 the children are clients of one NVIDIA MPS
  daemon the supervisor starts (``--mps auto``, the default, when the control binary is on
  PATH; ``mps_daemon.py``), so a GPU runs its workers' kernels side by side instead of
  time-slicing their contexts.
- **Disk tier directories.** With more than one child, each gets its own
  ``cache.disk_tier_dir / <name>``: the disk tier wipes its directory at start and exit,
  and every child sees its one GPU as ``cuda:0``, so the worker's own ``cuda<index>``
  subdirectory would be the same for all of them.
- **Restarts.** A child that exits while the supervisor is not stopping is started again
  after a ``Backoff`` delay (full jitter). A child that dies within ``min_uptime_s`` of its
  start counts as a crash loop; after ``max_restarts`` of those in a row the supervisor
  stops the others and exits 1 naming the child (a broken GPU or a bad config does not
  spin forever). A child that ran longer resets its count and its backoff.
- **Signals.** SIGTERM or SIGINT is forwarded as SIGTERM to every child (each drains,
  flushes, commits: ``App``'s shutdown); children still running ``group.drain_timeout_s +
  kill_grace_s`` later are killed. The exit status is the worst child status (a child
  ended by signal N counts as 128 + N; one that the forwarded SIGTERM ended before it had
  installed its handler was still importing and held nothing, so it counts as 0).
- **No orphans.** Children run in their own process group (a terminal's Ctrl-C reaches only
  the supervisor, which forwards one SIGTERM) and, on Linux, receive SIGTERM if the
  supervisor dies (``PR_SET_PDEATHSIG``), so a killed supervisor leaves no member behind.

Children inherit stdout and stderr. The supervisor's own JSON log lines name the child
(``child started``: ``child``, ``pid``, ``gpu``, ``group_instance_id``, ``http_port``,
``restarts``); ``parse_child_start`` reads them back (tests, bench/multi_gpu_bench.py).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Final

from streamrec.backoff import Backoff
from streamrec.errors import ConfigError, SupervisorError
from streamrec.tools.mps_daemon import MPS_MODES, MpsDaemon
from streamrec.worker.config import ENV_PREFIX, WorkerConfig, env_var_name
from streamrec.worker.logging_setup import configure_logging

log = logging.getLogger(__name__)

CHILD_STARTED: Final = "child started"
WORKER_COMMAND: Final = (sys.executable, "-m", "streamrec.tools.cli", "run")
_POLL_S: Final = 0.05
_PR_SET_PDEATHSIG: Final = 1


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead child is started again, and when the supervisor gives up."""

    max_restarts: int = 5  # crash-loop deaths in a row tolerated before giving up
    min_uptime_s: float = 60.0  # a child that ran this long was not crash-looping
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    kill_grace_s: float = 10.0  # after group.drain_timeout_s, before SIGKILL

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts = {self.max_restarts}: must be >= 0")
        for name in ("min_uptime_s", "kill_grace_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} = {getattr(self, name)}: must be > 0")
        Backoff(self.backoff_initial_s, self.backoff_max_s)  # validates the pair


@dataclass(frozen=True)
class ChildSpec:
    """One supervised worker: its name, the GPU it sees, and its whole config."""

    name: str  # "gpu0", "gpu0-w1" (--workers-per-gpu > 1), "cpu1"
    gpu: str | None  # the child's CUDA_VISIBLE_DEVICES value; None: a CPU child
    config: WorkerConfig

    def environ(self, parent: Mapping[str, str]) -> dict[str, str]:
        """The parent's environment without its streamrec settings, plus this child's
        complete config as ``STREAMREC_*`` variables (the child reads no file)."""
        # $STREAMREC_CONFIG goes too: the child's config is complete without a file
        env = {k: v for k, v in parent.items() if not k.startswith(ENV_PREFIX)}
        env.update(config_environ(self.config))
        env["CUDA_VISIBLE_DEVICES"] = self.gpu if self.gpu is not None else ""
        return env


def config_environ(config: WorkerConfig) -> dict[str, str]:
    """Every loadable field as its environment variable; ``load_config`` in the child
    reads it back to an equal config (an unset optional field travels as '')."""
    out: dict[str, str] = {}
    for section, values in config.to_dict(mask_secrets=False).items():
        for name, value in values.items():
            if value is None:
                text = ""
            elif isinstance(value, bool):
                text = "true" if value else "false"
            else:
                text = str(value)
            out[env_var_name(section, name)] = text
    return out


def cuda_device_count() -> int:
    import torch  # here only: `streamrec --help` must not pay for importing torch

    return int(torch.cuda.device_count())


def select_gpus(spec: str, device_count: int, visible: str | None) -> list[tuple[int, str]]:
    """``--gpus all|N|LIST`` -> (index as torch counts it, CUDA_VISIBLE_DEVICES value).

    A bare number is a count (the first N GPUs); indices are a comma-separated list, one
    index alone with a trailing comma (``3,``).
    ``visible`` is the supervisor's own CUDA_VISIBLE_DEVICES: index i is its i-th entry
    (an id, a UUID or a MIG name), so a child sees the GPU the supervisor calls i.
    """
    text = spec.strip().lower()
    if device_count <= 0:
        raise ConfigError(
            f"--gpus {spec!r}: no CUDA device is visible (torch.cuda.device_count() = 0); "
            "on a machine without GPUs, --cpu-children N runs N CPU workers (tests, development)"
        )
    if text == "all":
        indices = list(range(device_count))
    elif text.isdigit():
        count = int(text)
        if not 1 <= count <= device_count:
            raise ConfigError(
                f"--gpus {spec!r}: a count must be 1..{device_count} (GPUs visible); "
                f"GPU {count} alone is --gpus {count},"
            )
        indices = list(range(count))
    else:
        try:
            indices = [int(part) for part in text.rstrip(",").split(",")]
        except ValueError:
            raise ConfigError(
                f"--gpus {spec!r}: expected all, a count, or comma-separated GPU indices"
            ) from None
        bad = [i for i in indices if not 0 <= i < device_count]
        if bad or len(set(indices)) != len(indices):
            raise ConfigError(
                f"--gpus {spec!r}: indices must be distinct and in 0..{device_count - 1}"
            )
    entries = [e.strip() for e in visible.split(",")] if visible else None
    if entries is not None and len(entries) < device_count:
        entries = None  # torch saw more than the list names: it did not apply it; use ids
    return [(i, entries[i] if entries is not None else str(i)) for i in indices]


def check_workers_per_gpu(workers_per_gpu: int, gpus: bool) -> None:
    """``--workers-per-gpu`` is a count >= 1, and only ``--gpus`` multiplies by it:
    ``--cpu-children N`` already is the number of workers."""
    if workers_per_gpu < 1:
        raise ConfigError(f"--workers-per-gpu {workers_per_gpu}: must be >= 1")
    if workers_per_gpu > 1 and not gpus:
        raise ConfigError(
            f"--workers-per-gpu {workers_per_gpu}: only with --gpus "
            "(--cpu-children N already is the number of workers)"
        )


def _split(amount: int, workers: int) -> int:
    """One worker's share of a per-GPU amount; 0 (none, or automatic) stays 0."""
    return max(1, amount // workers) if amount else 0


def share_of_gpu(config: WorkerConfig, workers: int) -> WorkerConfig:
    """The config of one of ``workers`` processes on one GPU (the module docstring,
    "Sharing a GPU", says what is split and why)."""
    if workers == 1:
        return config
    c = config.cache
    # the fraction is unused while kv_budget_bytes is set: then it stays as configured
    fraction = c.kv_budget_fraction if c.kv_budget_bytes else c.kv_budget_fraction / workers
    cache = dataclasses.replace(
        c,
        kv_budget_bytes=_split(c.kv_budget_bytes, workers),
        kv_budget_fraction=fraction,
        host_tier_bytes=_split(c.host_tier_bytes, workers),
        disk_tier_bytes=_split(c.disk_tier_bytes, workers),
    )
    model = dataclasses.replace(
        config.model, host_threads=_split(config.model.host_threads, workers)
    )
    return dataclasses.replace(config, cache=cache, model=model)


def child_specs(
    config: WorkerConfig,
    gpus: Sequence[tuple[int, str]] | None,
    cpu_children: int,
    host: str,
    *,
    static: bool = True,
    workers_per_gpu: int = 1,
) -> list[ChildSpec]:
    """``workers_per_gpu`` specs per GPU (or one per CPU child): member id, port, device,
    resource share and disk tier directory set per child; ``static=False``: no member ids
    at all (dynamic members)."""
    check_workers_per_gpu(workers_per_gpu, gpus is not None)
    base = config.group.group_instance_id or host
    slots: list[tuple[str, str | None, str]]
    if gpus is None:
        slots = [(f"cpu{i}", None, "cpu") for i in range(cpu_children)]
    elif workers_per_gpu == 1:  # the names of one process per GPU, as before the option
        slots = [(f"gpu{i}", value, "cuda") for i, value in gpus]
    else:
        slots = [
            (f"gpu{i}-w{j}", value, "cuda") for i, value in gpus for j in range(workers_per_gpu)
        ]
    if not slots:
        raise ConfigError("--cpu-children 0: at least one child is needed")
    port = config.http.port
    if port and port + len(slots) - 1 > 65535:
        raise ConfigError(f"http.port = {port}: {len(slots)} children need ports up to 65535")
    shared = share_of_gpu(config, workers_per_gpu)
    specs = []
    for i, (name, gpu, device) in enumerate(slots):
        cache = shared.cache
        if len(slots) > 1:
            cache = dataclasses.replace(cache, disk_tier_dir=cache.disk_tier_dir / name)
        child = dataclasses.replace(
            shared,
            group=dataclasses.replace(
                shared.group, group_instance_id=f"{base}-{name}" if static else None
            ),
            http=dataclasses.replace(shared.http, port=port + i if port else 0),
            model=dataclasses.replace(shared.model, device=device),
            cache=cache,
        )
        specs.append(ChildSpec(name, gpu, child))
    return specs


@dataclass
class _Slot:
    """One child position: its process now, its history of deaths."""

    spec: ChildSpec
    backoff: Backoff
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    status: int = 0  # the last process's exit status
    restarts: int = 0
    crash_loops: int = 0  # quick deaths in a row
    restart_at: float | None = None
    terminated: bool = False  # SIGTERM forwarded to the current process


class Supervisor:
    """Runs the children until a signal (or a crash loop); ``run()`` returns the status."""

    def __init__(
        self,
        children: Sequence[ChildSpec],
        policy: RestartPolicy,
        *,
        command: Sequence[str] = WORKER_COMMAND,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._policy = policy
        self._command = list(command)
        self._environ = dict(os.environ if environ is None else environ)
        self._slots = [
            _Slot(spec, Backoff(policy.backoff_initial_s, policy.backoff_max_s))
            for spec in children
        ]
        self._drain_s = max(spec.config.group.drain_timeout_s for spec in children)
        self._stop_reason: str | None = None
        self._gave_up: str | None = None
        self._prctl = _pdeathsig_setter()

    def stop(self, reason: str = "stop") -> None:
        """Ask every child to drain (safe from a signal handler: it only sets a field)."""
        if self._stop_reason is None:
            self._stop_reason = reason

    def run(self) -> int:
        signals = (signal.SIGTERM, signal.SIGINT)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}
        try:
            for slot in self._slots:
                self._start(slot)
            self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._kill_remaining()
        if self._gave_up is not None:
            raise SupervisorError(self._gave_up)
        return max(slot.status for slot in self._slots)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop(signal.Signals(signum).name)

    def _loop(self) -> None:
        deadline: float | None = None
        killed = False
        while True:
            now = time.monotonic()
            if self._stop_reason is not None and deadline is None:
                deadline = now + self._drain_s + self._policy.kill_grace_s
                self._forward_sigterm()
            for slot in self._slots:
                if slot.proc is not None and (code := slot.proc.poll()) is not None:
                    self._exited(slot, code, now)
            if deadline is not None:
                if all(slot.proc is None for slot in self._slots):
                    return
                if now > deadline and not killed:
                    killed = True
                    for slot in self._slots:
                        if slot.proc is not None:
                            log.warning(
                                "child still running after the drain bound, killing it",
                                extra={"child": slot.spec.name, "pid": slot.proc.pid},
                            )
                            slot.proc.kill()
            else:
                for slot in self._slots:
                    if slot.restart_at is not None and slot.restart_at <= now:
                        self._start(slot)
            time.sleep(_POLL_S)

    def _forward_sigterm(self) -> None:
        alive = [slot for slot in self._slots if slot.proc is not None]
        log.info(
            "stopping children",
            extra={"reason": self._stop_reason, "children": [s.spec.name for s in alive]},
        )
        for slot in alive:
            assert slot.proc is not None
            slot.terminated = True
            slot.proc.send_signal(signal.SIGTERM)
        for slot in self._slots:
            slot.restart_at = None

    def _start(self, slot: _Slot) -> None:
        spec = slot.spec
        try:
            slot.proc = subprocess.Popen(
                self._command,
                env=spec.environ(self._environ),
                process_group=0,
                preexec_fn=self._prctl,  # noqa: PLW1509 - the supervisor runs no threads
            )
        except OSError as exc:
            raise SupervisorError(
                f"cannot start child {spec.name} ({' '.join(self._command)}): {exc}"
            ) from None
        slot.started_at = time.monotonic()
        slot.restart_at = None
        slot.terminated = False
        log.info(
            CHILD_STARTED,
            extra={
                "child": spec.name,
                "pid": slot.proc.pid,
                "gpu": spec.gpu,
                "group_instance_id": spec.config.group.group_instance_id,
                "http_port": spec.config.http.port,
                "restarts": slot.restarts,
            },
        )

    def _exited(self, slot: _Slot, code: int, now: float) -> None:
        assert slot.proc is not None
        pid, terminated = slot.proc.pid, slot.terminated
        slot.proc = None
        if code >= 0:
            slot.status = code
        elif terminated and -code == signal.SIGTERM:
            slot.status = 0  # ended before its handler existed: it held no partitions
        else:
            slot.status = 128 - code
        uptime = now - slot.started_at
        fields = {"child": slot.spec.name, "pid": pid, "status": slot.status}
        fields["uptime_s"] = round(uptime, 1)
        if self._stop_reason is not None:
            log.info("child stopped", extra=fields)
            return
        if uptime >= self._policy.min_uptime_s:
            slot.crash_loops = 0
            slot.backoff.reset()
        else:
            slot.crash_loops += 1
        if slot.crash_loops > self._policy.max_restarts:
            self._gave_up = (
                f"child {slot.spec.name} died {slot.crash_loops} times in a row within "
                f"{self._policy.min_uptime_s:g} s of its start (last exit status "
                f"{slot.status}); giving up (its log above says why)"
            )
            log.error("crash loop, giving up", extra=fields)
            self.stop("crash loop")
            return
        delay = slot.backoff.next_delay()
        slot.restarts += 1
        slot.restart_at = now + delay
        log.warning("child died, restarting", extra=fields | {"restart_in_s": round(delay, 2)})

    def _kill_remaining(self) -> None:
        """Only on the way out of an error: no child outlives ``run()``."""
        for slot in self._slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.kill()
                slot.proc.wait()


def _pdeathsig_setter() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux to SIGTERM the child when the supervisor dies.
    libc is loaded here, in the parent; the forked child only makes the one call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_pdeathsig() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the supervisor died before the call took effect
            os._exit(1)

    return set_pdeathsig


def add_supervisor_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("one worker process per GPU (deploy/README.md)")
    which = group.add_mutually_exclusive_group()
    which.add_argument(
        "--gpus",
        metavar="all|N|LIST",
        help="supervise one worker per GPU (all, the first N, or indices like 0,2 or 3,); "
        "member ids <group_instance_id or host>-gpu<N>, HTTP ports http.port + i",
    )
    which.add_argument(
        "--cpu-children",
        type=int,
        metavar="N",
        help="supervise N CPU workers the same way (tests, development)",
    )
    group.add_argument(
        "--workers-per-gpu",
        type=int,
        default=1,
        metavar="N",
        help="with --gpus: N worker processes per GPU (default %(default)s), members "
        "<...>-gpu<i>-w<j> when N > 1; the KV budget, host and disk tiers and an explicit "
        "model.host_threads are split among a GPU's workers",
    )
    group.add_argument(
        "--mps",
        choices=MPS_MODES,
        default="auto",
        help="run the GPU's workers as clients of an NVIDIA MPS daemon the supervisor "
        "starts, so their kernels run concurrently instead of time-sliced; auto: "
        "with --workers-per-gpu > 1 when nvidia-cuda-mps-control is on PATH and "
        "CUDA_MPS_PIPE_DIRECTORY names no daemon already",
    )
    group.add_argument(
        "--dynamic-members",
        action="store_true",
        help="no static member ids (the dev broker, Tansu 0.6, keeps rebalancing groups of "
        "static members: tests and bench/multi_gpu_bench.py use this)",
    )
    group.add_argument(
        "--max-restarts",
        type=int,
        default=RestartPolicy.max_restarts,
        metavar="N",
        help="crash-loop restarts of one child before giving up (default %(default)s)",
    )


def supervising(args: argparse.Namespace) -> bool:
    """Whether the arguments ask for a supervisor; ``--workers-per-gpu`` without ``--gpus``
    is an error here rather than ignored by a single worker."""
    check_workers_per_gpu(args.workers_per_gpu, args.gpus is not None)
    return args.gpus is not None or args.cpu_children is not None


def run_supervised(
    config: WorkerConfig,
    args: argparse.Namespace,
    device_count: Callable[[], int] = cuda_device_count,
) -> int:
    """``streamrec run --gpus/--cpu-children``: the children until SIGTERM/SIGINT."""
    configure_logging(config.log)
    policy = RestartPolicy(max_restarts=args.max_restarts)
    gpus = None
    if args.gpus is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = select_gpus(args.gpus, device_count(), visible)
    elif args.cpu_children < 1:
        raise ConfigError(f"--cpu-children {args.cpu_children}: must be >= 1")
    specs = child_specs(
        config,
        gpus,
        args.cpu_children or 0,
        socket.gethostname(),
        static=not args.dynamic_members,
        workers_per_gpu=args.workers_per_gpu,
    )
    daemon = None
    if gpus is not None:
        daemon = MpsDaemon.for_mode(args.mps, args.workers_per_gpu, os.environ)
    if daemon is None:
        return Supervisor(specs, policy).run()
    with daemon:
        return Supervisor(specs, policy, environ=os.environ | daemon.environ()).run()


@dataclass(frozen=True)
class ChildStart:
    """A ``child started`` line of the supervisor's JSON log."""

    child: str
    pid: int
    http_port: int
    group_instance_id: str | None
    restarts: int


def parse_child_start(line: str) -> ChildStart | None:
    """The child start a JSON log line records, or None for any other line."""
    if not line.startswith("{"):
        return None
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    if doc.get("logger") != __name__ or doc.get("msg") != CHILD_STARTED:
        return None
    return ChildStart(
        doc["child"], int(doc["pid"]), int(doc["http_port"]), doc["group_instance_id"],
        int(doc["restarts"]),
    )  # fmt: skip
