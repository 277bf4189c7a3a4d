"""The state a worker bench run shares across its phases (``Bench``: the running
worker(s), the producer process's pipe, the counters; ``EventBook``: when each event was
produced) and the two kinds of phase, ``waves`` and ``paced``; bench/worker_bench.py
composes them, bench/multi_gpu_bench.py reuses the book."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.event_producer import Job, job_result
from bench.gpu_trace import gpu_trace
from bench.worker_side import WorkerSide, gc_summary, loop_profile, split_percentiles
from streamrec.errors import BrokerError

IntArray = npt.NDArray[np.int64]
Row = dict[str, Any]
_SUSTAINED_LAG_S = 0.25  # backlog at the schedule's end that still counts as keeping up


class EventBook:
    """Per user, the time (ms) of each produced event in produce order (-1: not timed).
    Version v of user u covers its first ``v - preloaded[u]`` events (the preload counts)."""

    def __init__(self, preloaded: IntArray) -> None:
        self.preloaded = preloaded
        self.events: dict[int, list[int]] = defaultdict(list)
        self.covered: dict[int, int] = defaultdict(int)

    def add(self, job: Job) -> None:
        times = [-1] * len(job.users) if job.ts_ms is None else job.ts_ms.tolist()
        for user, ts in zip(job.users.tolist(), times, strict=True):
            self.events[user].append(ts)

    def latencies_ms(self, acks: Sequence[tuple[str, int, float, float]]) -> list[float]:
        """Ack time minus event time of every timed event first covered by ``acks``."""
        out: list[float] = []
        for user_id, version, at, _ in acks:
            user = int(user_id[1:])
            seen, upto = self.covered[user], version - int(self.preloaded[user])
            out.extend(at * 1000.0 - ts for ts in self.events[user][seen:upto] if ts >= 0)
            self.covered[user] = max(seen, upto)
        return out


def pct(values: Sequence[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 2) if len(values) else 0.0


@dataclass
class Bench:
    """The running worker(s), the producer, and what the phases have produced so far."""

    side: WorkerSide
    conn: Connection
    book: EventBook
    timeout_s: float
    produced: int = 0
    samples: list[tuple[float, int]] = field(default_factory=list)  # (wall s, completed)

    def snap(self) -> Row:
        """Counters now (a phase's figures are differences of two snaps)."""
        return self.side.snap() | {"wall": time.time(), "mono": time.monotonic()}

    def send(self, job: Job) -> None:
        self.book.add(job)
        self.produced += len(job.users)
        self.conn.send(job)

    async def connected(self) -> float:
        """Seconds until the producer process answers an empty job: its start-up (the
        spawn re-imports the bench's main module, torch with it) stays out of the warm
        phase's wall time."""
        began = time.perf_counter()
        self.send(Job(np.zeros(0, dtype=np.int64)))
        await self.result()
        return round(time.perf_counter() - began, 2)

    async def result(self) -> dict[str, float]:
        return await job_result(self.conn, self.timeout_s)

    async def watch(self, timeout_s: float, until: float = 0.0) -> bool:
        """Sample the completed count every 10 ms until wall time ``until`` or, without it,
        until every produced event is completed; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            done = self.side.completed()
            if not self.samples or done != self.samples[-1][1]:
                self.samples.append((time.time(), done))
            if (time.time() >= until) if until else (done >= self.produced):
                return True
            self.side.check_alive()
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)

    def row(self, phase: str, a: Row, b: Row, producer: dict[str, float]) -> Row:
        acks = self.side.ack_rows(a, b)
        wall = (acks[-1][2] if acks else b["wall"]) - a["wall"]
        d = {k: b[k] - a[k] for k in ("cpu_s", "completed", "published", "batches", "users")}
        batches, hits = max(d["batches"], 1), b["gpu_hits"] - a["gpu_hits"]
        moved = [(t, c) for t, c in self.samples if t >= a["wall"] and c > a["completed"]]
        span = moved[-1][0] - moved[0][0] if moved else 0.0
        phase_ms = {k: (v - a["phase_s"].get(k, 0.0)) * 1000.0 for k, v in b["phase_s"].items()}
        worker_ms = [x[3] * 1000.0 for x in acks]
        elapsed = max(b["wall"] - a["wall"], 1e-9)
        busy = (b["busy_s"] - a["busy_s"]) / self.side.processes  # per engine thread
        row: Row = {
            "phase": phase,
            "processes": self.side.processes,
            "events": int(producer["events"]),
            "completed": d["completed"],
            "wall_s": round(wall, 3),
            "events_per_s": d["completed"] / wall if wall > 0 else 0.0,
            "completion_span_s": round(span, 3),
            "sustained_events_per_s": (moved[-1][1] - moved[0][1]) / span if span else None,
            "published": d["published"],
            "batches": d["batches"],
            "users_per_batch": round(d["users"] / batches, 1),
            "gpu_hit_rate": round(hits / max(b["looked_up"] - a["looked_up"], 1), 4),
            "worker_p50_ms": pct(worker_ms, 50),
            "worker_p99_ms": pct(worker_ms, 99),
            "cpu_pct": round(100.0 * d["cpu_s"] / elapsed, 1),
            "engine_busy_pct": round(100.0 * busy / elapsed, 1),
            "ms_per_batch": {k: round(v / batches, 3) for k, v in phase_ms.items()},
        }
        if "events_per_s" in producer:
            row["producer_events_per_s"] = producer["events_per_s"]
            row["producer_max_lag_ms"] = round(producer["max_lag_ms"], 1)
            row["producer_gc_full"] = {
                "count": int(producer.get("gc_full_count", 0)),
                "max_ms": round(producer.get("gc_full_max_ms", 0.0), 1),
            }
            row["producer_ms"] = {
                k: round(v, 2) for k, v in producer.items() if k.startswith("append_")
            }
        stages = self.side.stages(a["mono"], b["mono"])
        row |= split_percentiles(stages) | gc_summary(stages)
        e2p = self.book.latencies_ms(acks)
        if e2p:
            row |= {"e2p_events": len(e2p), "e2p_p50_ms": pct(e2p, 50)}
            row |= {"e2p_p99_ms": pct(e2p, 99), "e2p_max_ms": round(max(e2p), 2)}
        return row


async def waves(bench: Bench, phase: str, groups: Sequence[IntArray]) -> Row:
    """Each group of events in turn, the next sent once the last is completed."""
    a, events, got = bench.snap(), 0, {}
    for users in groups:
        bench.send(Job(users))
        if not await bench.watch(bench.timeout_s):
            raise BrokerError(f"{phase}: {len(users)} events not done in {bench.timeout_s} s")
        got = await bench.result()
        events += len(users)
    # Between several waves the producer waits for the worker: it has no rate of its own.
    return bench.row(phase, a, bench.snap(), got if len(groups) == 1 else {"events": events})


async def paced(
    bench: Bench,
    rate: float,
    users: IntArray,
    drain: float,
    trace: Path | None = None,
    profile_s: float = 0.0,
) -> Row:
    start_ms = (time.time() + 0.5) * 1000.0
    ts = (start_ms + np.arange(len(users)) * (1000.0 / rate)).astype(np.int64)
    a = bench.snap() | {"wall": start_ms / 1000.0}  # the schedule's start
    bench.send(Job(users, ts))
    traced = None
    if trace is not None:  # 2 s into the schedule, 1.5 s of GPU activity
        await asyncio.sleep(2.5)
        try:
            traced = await asyncio.to_thread(gpu_trace, 1.5, trace)
        except Exception as exc:  # a bench aid: report, never end the run
            traced = {"error": repr(exc)}
        print(f"gpu trace @ {rate:g}/s: {traced}", flush=True)
    profiled = None
    if profile_s > 0:  # 1.5 s into the schedule (after any trace)
        await asyncio.sleep(max(0.0, start_ms / 1000.0 + 1.5 - time.time()))
        profiled = await loop_profile(bench.side, profile_s)
        top = ", ".join(f"{c['name']} {c['share']:.1%}" for c in profiled["callbacks"][:5])
        print(f"loop @ {rate:g}/s: busy {profiled['busy_share_per_process']}; {top}", flush=True)
    await bench.watch(bench.timeout_s, until=float(ts[-1]) / 1000.0)
    lag = bench.produced - bench.samples[-1][1]
    complete = await bench.watch(drain)
    row = bench.row(f"latency @ {rate:g}/s", a, bench.snap(), await bench.result())
    kept_up = row["producer_events_per_s"] >= 0.95 * rate
    sustained = complete and kept_up and lag <= _SUSTAINED_LAG_S * rate
    row |= {"rate": rate, "lag_at_end": lag, "lag_at_end_s": round(lag / rate, 3)}
    if traced is not None:
        row["gpu_trace"] = traced
    if profiled is not None:
        row["loop_profile"] = profiled
    return row | {"complete": complete, "sustained": sustained}
