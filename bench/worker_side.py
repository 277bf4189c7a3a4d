"""The worker side of bench/worker_bench.py: one ``App`` in the bench's process, or a fleet
of worker processes sharing the machine (and its one GPU) in one consumer group.

Issue 13 item 3: one Python process did not keep the H200 busy (its event loop and engine
thread share one GIL), so the bench measures the process model the issue names, "several
processes sharing one GPU", with the same phases and the same event-to-publish clock as
the one-process run: ``--processes N`` spawns N children that each load the model, preload
every user's history into their own memory store (only the users of their partitions are
ever read) and run ``App`` in the bench's group. The parent keeps the broker, the producer
process and the bookkeeping; it reads the children's counters (a shared array, polled like
the in-process counter) and, between phases, their acks and per-stage timings over a pipe.

Both sides answer the same questions (``WorkerSide``), so the phases do not know which
one they measure.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from bench.engine_bench import _model, _preload
from bench.gc_pauses import GcPauses
from bench.loop_profiler import CallbackTime, LoopProfiler, busy_share, merge, summary
from bench.null_model import null_checkpoint_parts
from bench.reference_config import ReferenceWorkload
from streamrec.cache.history_backends import open_history_store
from streamrec.errors import BrokerError
from streamrec.models.checkpoint import Checkpoint, load_checkpoint
from streamrec.worker import config as wc
from streamrec.worker.app import App
from streamrec.worker.model_loader import LoadedModel, load_serving_model

Row = dict[str, Any]
T = TypeVar("T")
AckRow = tuple[str, int, float, float]  # user, version, ack wall time s, enqueue->ack s
STAGES = (
    "transit", "queue_wait", "batch_wait", "step", "encode", "publish", "produce_ack", "commit"
)  # fmt: skip


def loaded_model(
    w: ReferenceWorkload, device: str, host_ceiling: bool = False, aoti: bool = False
) -> LoadedModel:
    if host_ceiling:  # the host path alone: a model that does nothing, on the CPU
        module, null, vocab = null_checkpoint_parts(w.num_items, w.max_seq_len, torch.device("cpu"))
        checkpoint = Checkpoint(module, vocab, "null", Path("null"), {"model_name": "null"})
        return LoadedModel(checkpoint, null, "null", torch.device("cpu"))
    if aoti:  # the reference model directory and its AOTI packages (compiled if missing)
        return aoti_loaded_model(w, device)
    model, vocab = _model(w, device)  # random init; bf16 for the reference workloads
    checkpoint = Checkpoint(model, vocab, "random-init", Path(w.name), {"model_name": w.name})
    return LoadedModel(checkpoint, model, "eager", torch.device(device))


def aoti_loaded_model(w: ReferenceWorkload, device: str) -> LoadedModel:
    # (imported here: the "before" tree worker_bench also drives has none of them)
    from bench.aoti_packages import CACHE_DIR as AOTI_CACHE_DIR
    from bench.aoti_packages import reference_model_dir
    from streamrec.models.aoti_export import ENTRY_POINTS, ExportConfig, export_model
    from streamrec.pipeline.scoring_config import ScoringConfig

    model_dir = reference_model_dir(w)
    export_model(model_dir, device, AOTI_CACHE_DIR, config=ExportConfig(), jobs=len(ENTRY_POINTS))
    checkpoint = load_checkpoint(model_dir, device)
    cfg = wc.ModelConfig(
        model_dir=model_dir, aoti_cache_dir=AOTI_CACHE_DIR, device=device, backend="aoti"
    )
    scoring = ScoringConfig(num_candidates=w.num_candidates, top_k=20)
    model, backend = load_serving_model(cfg, checkpoint, torch.device(device), scoring)
    return LoadedModel(checkpoint, model, backend, torch.device(device))


def serving_app(config: Any, loaded: LoadedModel, store: Any, acks: AckLog) -> App:
    """The bench's worker as ``streamrec run`` serves: its heap frozen once started (a tree
    from before ``App(freeze_heap=...)``, which this bench also drives, without)."""
    if "freeze_heap" in inspect.signature(App).parameters:
        return App(config, model=loaded, store=store, on_published=acks, freeze_heap=True)
    return App(config, model=loaded, store=store, on_published=acks)


class AckLog:
    """Every acknowledged recommendation (``AckRow``). The hook runs on the worker's event
    loop, so it only appends."""

    def __init__(self) -> None:
        self.rows: list[AckRow] = []

    def __call__(self, published: Any, latency_s: float | None = None) -> None:
        # ``Published`` now; ``(Recommendation, latency)`` from the worker before issue 13,
        # which this bench also drives for the before/after ratio (``--before`` tree).
        latency = published.latency_s if latency_s is None else latency_s
        self.rows.append((published.user_id, published.version, time.time(), latency))


def latency_stages(app: App, start: float, end: float) -> dict[str, np.ndarray]:
    """Per event, ms spent in each stage (``BatchTrace``) by the batches released in
    ``[start, end)`` (monotonic, the same clock in every process of the machine): queue
    wait (batcher enqueue to release), batch wait (release to the engine thread: the store
    append and the previous step), step, encode, publish (step done to handed to the
    producer, encode included), produce-ack, commit (acknowledged to the next commit)."""
    pipeline = getattr(app, "pipeline", None)
    checkpoint = getattr(app, "checkpoint", None)
    if pipeline is None or checkpoint is None:
        return {}  # the worker before issue 13 records no traces
    traces = [t for t in pipeline.stats.traces if start <= t.released < end and t.acked]
    if not traces:
        return {}
    commits = np.array(sorted(checkpoint.commit_times))
    weights = np.array([t.n_events for t in traces])

    def per_event(values: Sequence[float]) -> np.ndarray:
        return np.repeat(np.asarray(values, dtype=np.float64), weights)

    after_ack = np.searchsorted(commits, [t.acked for t in traces])
    committed = [
        commits[i] - t.acked if i < len(commits) else np.nan
        for i, t in zip(after_ack, traces, strict=True)
    ]
    stages = {
        "queue_wait": np.concatenate([t.queue_waits for t in traces]),
        "batch_wait": per_event([t.taken - t.released for t in traces]),
        "step": per_event([t.executed - t.taken for t in traces]),
        "encode": per_event([t.encode_s for t in traces]),
        "publish": per_event([t.handed - t.executed for t in traces]),
        "produce_ack": per_event([t.acked - t.handed for t in traces]),
        "commit": per_event(committed),
    }
    return {name: values[np.isfinite(values)] * 1000.0 for name, values in stages.items()}


def split_percentiles(stages: dict[str, np.ndarray]) -> Row:
    """p50/p99 ms of each stage, as the rows report them."""
    if not stages:
        return {}
    split: Row = {}
    for name in STAGES:
        values = stages.get(name, np.zeros(0))
        for q in (50, 99):
            split[f"{name}_p{q}_ms"] = (
                round(float(np.percentile(values, q)), 2) if len(values) else 0.0
            )
    return {"split_ms": split}


class FetchProbe:
    """Per fetched record, wall ms from its Kafka timestamp (the bench producer's append)
    to the worker's fetch handing it over: the broker, the fetch cadence and any wait in
    aiokafka's buffer for the loop. Wraps ``app.input.fetch`` of a bench worker only."""

    def __init__(self, app: App) -> None:
        self.chunks: list[tuple[float, np.ndarray]] = []  # (monotonic s, ages ms [R])
        self._fetch = app.input.fetch
        app.input.fetch = self  # type: ignore[method-assign]

    async def __call__(self, timeout_ms: int) -> Any:
        got = await self._fetch(timeout_ms)
        if got:
            now_ms, mono = time.time() * 1000.0, time.monotonic()
            # aiokafka's ConsumerRecord: its timestamp is the producer's append (CreateTime)
            stamps = [r.timestamp for records in got.values() for r in records]  # type: ignore[attr-defined]
            self.chunks.append((mono, now_ms - np.asarray(stamps, dtype=np.float64)))
        return got

    def ages(self, start: float, end: float) -> np.ndarray:
        parts = [ages for mono, ages in self.chunks if start <= mono < end]
        return np.concatenate(parts) if parts else np.zeros(0)


def gc_summary(stages: dict[str, np.ndarray]) -> Row:
    """How many full collections every worker process ran in the phase, and the longest."""
    full = stages.get("gc_full")
    if full is None:
        return {}
    return {
        "gc_full": {"count": len(full), "max_ms": round(float(full.max()), 1) if len(full) else 0.0}
    }


class WorkerSide(Protocol):
    """What the phases ask of the worker(s) they measure."""

    processes: int

    def completed(self) -> int: ...

    def snap(self) -> Row: ...

    def ack_rows(self, a: Row, b: Row) -> list[AckRow]: ...

    def stages(self, start: float, end: float) -> dict[str, np.ndarray]: ...

    def check_alive(self) -> None: ...

    def start_loop_profile(self) -> None: ...

    def stop_loop_profile(self) -> list[tuple[dict[str, CallbackTime], float]]: ...


async def loop_profile(side: WorkerSide, seconds: float) -> Row:
    """Every worker loop's callbacks for ``seconds`` (bench/loop_profiler.py): the busy
    share of each process and the top callbacks of all of them together."""
    side.start_loop_profile()
    try:
        await asyncio.sleep(seconds)
    finally:
        parts = side.stop_loop_profile()
    walls = [wall for _, wall in parts]
    row = summary(merge([times for times, _ in parts]), sum(walls))
    row["busy_share_per_process"] = [round(busy_share(t, w), 3) for t, w in parts]
    return row


class LocalWorker:
    """``App`` running on this process's event loop (the one-process model)."""

    processes = 1

    def __init__(self, app: App, task: asyncio.Task[int], acks: AckLog) -> None:
        self.app, self.task, self.acks = app, task, acks
        self.loop_profiler = LoopProfiler()
        self.fetch_probe = FetchProbe(app)
        self.gc_pauses = GcPauses()

    def completed(self) -> int:
        return self.app.tracker.stats().completed  # not app.stats(): polled every few ms

    def snap(self) -> Row:
        """Counters now (a phase's figures are differences of two snaps)."""
        assert self.app.engine is not None
        e, s = self.app.engine.stats(), self.app.stats()
        # The engine thread's busy time; before issue 13 the phase sum was the closest.
        busy = getattr(e, "step_seconds", None)
        return dict(
            cpu_s=time.process_time(), completed=s.tracker.completed, published=s.published,
            acks=len(self.acks.rows), batches=e.batches, users=e.users, gpu_hits=e.gpu_hits,
            looked_up=e.gpu_hits + e.host_hits + e.misses, phase_s=dict(e.phase_seconds),
            busy_s=sum(e.phase_seconds.values()) if busy is None else busy,
        )  # fmt: skip

    def ack_rows(self, a: Row, b: Row) -> list[AckRow]:
        return self.acks.rows[a["acks"] : b["acks"]]

    def stages(self, start: float, end: float) -> dict[str, np.ndarray]:
        stages = latency_stages(self.app, start, end)
        if not stages:
            return {}
        stages["transit"] = self.fetch_probe.ages(start, end)
        stages["gc_full"] = self.gc_pauses.durations(start, end)
        return stages

    def check_alive(self) -> None:
        if self.task.done():
            raise BrokerError("the bench worker stopped (see its log)")

    def start_loop_profile(self) -> None:
        self.loop_profiler.start()

    def stop_loop_profile(self) -> list[tuple[dict[str, CallbackTime], float]]:
        times = self.loop_profiler.stop()
        return [(times, self.loop_profiler.wall_s)]


@dataclass(frozen=True)
class FleetMember:
    """Everything a worker child needs (picklable: it crosses a spawn)."""

    index: int
    config: wc.WorkerConfig
    workload: ReferenceWorkload
    device: str
    host_ceiling: bool
    aoti: bool
    lengths: np.ndarray  # [U] preloaded tokens per user (every user: the owner is not known)
    seed: int
    threads: int
    event_loop: str = "asyncio"  # or "uvloop", the product's (``streamrec run``)


def run_loop(event_loop: str, main: Coroutine[Any, Any, T]) -> T:
    """``main`` on the named event loop: ``uvloop`` as ``streamrec run`` serves, or the
    standard library's ``asyncio`` (which ``bench.loop_profiler`` can see into)."""
    if event_loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def child_main(spec: FleetMember, conn: Connection, counters: Any) -> None:
    """A spawned worker process: model, preloaded store, ``App``; answers the parent."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    run_loop(spec.event_loop, _child(spec, conn, counters))


async def _child(spec: FleetMember, conn: Connection, counters: Any) -> None:
    loaded = loaded_model(spec.workload, spec.device, spec.host_ceiling, spec.aoti)
    known = len(loaded.checkpoint.vocab.items)
    store = open_history_store("memory://", spec.workload.max_seq_len)
    await _preload(store, spec.lengths, known, np.random.default_rng(spec.seed))
    acks = AckLog()
    app = serving_app(spec.config, loaded, store, acks)
    task = asyncio.create_task(app.run())
    local = LocalWorker(app, task, acks)

    def answer(request: tuple[Any, ...]) -> Any:
        kind = request[0]
        if kind == "state":
            parts = sorted({partition for _, partition in app.owned})  # either input topic
            return {"ready": app.ready, "partitions": parts, "known": known}
        if kind == "snap":
            return local.snap()
        if kind == "acks":
            return acks.rows[request[1] : request[2]]
        if kind == "stages":
            return local.stages(request[1], request[2])
        if kind == "switch":
            sys.setswitchinterval(request[1] / 1000.0)
            return None
        if kind == "loop_start":
            local.start_loop_profile()
            return None
        if kind == "loop_stop":
            return local.stop_loop_profile()[0]
        app.stop()  # "stop"
        return None

    def on_request() -> None:
        while conn.poll():
            try:
                request = conn.recv()
            except EOFError:  # the parent is gone
                app.stop()
                return
            conn.send(answer(request))

    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), on_request)
    # uvloop makes a watched descriptor non-blocking; a large reply (acks, stages) would
    # then fail with EAGAIN mid-write. The answers are meant to block until sent.
    os.set_blocking(conn.fileno(), True)
    try:
        while not task.done():  # the parent polls this like the in-process counter
            counters[spec.index] = local.completed()
            await asyncio.sleep(0.005)  # the parent polls every 10 ms
    finally:
        loop.remove_reader(conn.fileno())
        status = await task
        await store.close()
    if status != 0:
        raise SystemExit(status)


class Fleet:
    """N worker processes in the bench's group (the several-processes model)."""

    def __init__(self, specs: Sequence[FleetMember]) -> None:
        ctx = mp.get_context("spawn")
        self.processes = len(specs)
        self._counters = ctx.Array("q", self.processes, lock=False)
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        for spec in specs:
            here, there = ctx.Pipe()
            proc = ctx.Process(target=child_main, args=(spec, there, self._counters))
            proc.start()
            self._conns.append(here)
            self._procs.append(proc)

    def _ask(self, *request: Any) -> list[Any]:
        for conn in self._conns:
            conn.send(request)
        return [conn.recv() for conn in self._conns]

    async def ready(self, partitions: int, timeout_s: float) -> int:
        """Until every child is ready and the partitions are spread over all of them;
        returns the item count the served model knows."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            states = self._ask("state")
            owned = [s["partitions"] for s in states]
            spread = all(owned) and sorted(p for o in owned for p in o) == list(range(partitions))
            if all(s["ready"] for s in states) and spread:
                return int(states[0]["known"])
            if time.monotonic() > deadline:
                raise BrokerError(f"the bench workers were not ready in {timeout_s} s: {states}")
            await asyncio.sleep(0.2)

    def set_switch_interval(self, ms: float) -> None:
        self._ask("switch", ms)

    def completed(self) -> int:
        return int(sum(self._counters))

    def snap(self) -> Row:
        snaps = self._ask("snap")
        out: Row = {k: sum(s[k] for s in snaps) for k in snaps[0] if k not in ("acks", "phase_s")}
        out["acks"] = [s["acks"] for s in snaps]
        phase: dict[str, float] = {}
        for s in snaps:
            for name, seconds in s["phase_s"].items():
                phase[name] = phase.get(name, 0.0) + seconds
        return out | {"phase_s": phase}

    def ack_rows(self, a: Row, b: Row) -> list[AckRow]:
        for conn, lo, hi in zip(self._conns, a["acks"], b["acks"], strict=True):
            conn.send(("acks", lo, hi))
        rows = [row for conn in self._conns for row in conn.recv()]
        return sorted(rows, key=lambda r: r[2])

    def stages(self, start: float, end: float) -> dict[str, np.ndarray]:
        parts = [p for p in self._ask("stages", start, end) if p]
        return (
            {n: np.concatenate([p[n] for p in parts]) for n in (*STAGES, "gc_full")}
            if parts
            else {}
        )

    def start_loop_profile(self) -> None:
        self._ask("loop_start")

    def stop_loop_profile(self) -> list[tuple[dict[str, CallbackTime], float]]:
        return self._ask("loop_stop")

    def check_alive(self) -> None:
        dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
        if dead:
            raise BrokerError(f"bench worker process(es) {dead} stopped (see their log)")

    def stop(self, timeout_s: float) -> int:
        """Graceful stop of every child; the worst exit status."""
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if proc.is_alive():
                try:
                    conn.send(("stop",))
                    conn.recv()
                except (OSError, EOFError):
                    pass
        for proc in self._procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
        return max(abs(p.exitcode or 0) for p in self._procs)
