r"""Several GPUs of one host (issue 21): the same workload on one and on two GPUs, and a
child killed mid-run.

The worker runs as it would in production on a multi-GPU node: ``streamrec run --gpus 1``
and then ``--gpus 2`` (streamrec/tools/supervisor.py: one process per GPU, one consumer
group, static member ids), against the dev broker on this host, fed by
bench/worker_bench.py's producer process (complete playbacks keyed by user, sent in
per-partition batches off this process's loop). The children are other processes, so the
bench sees them from outside only:

- **completion and e2p** from a reader of the output topic: a recommendation of version v
  covers its user's first v events (``EventBook``; each child has its own ``memory://``
  history store, empty at start, unless ``--store-url`` names a shared Redis, which is then
  preloaded with skewed histories like worker_bench's); ``e2p`` = the output record's
  timestamp (set when the worker queues it, as bench/soak.py) minus the event's scheduled
  send time, so it omits the output's produce-ack (a few ms) that worker_bench counts;
- **ownership and readiness** from each child's ``/metrics`` (one ``streamrec_consumer_lag``
  series per owned partition) and ``/readyz``, on ``http.port + i``.

Phases per GPU count (``--counts``, default 1 2), each on fresh topics and a fresh group:
**warm** (one event per user), **throughput** (a backlog of ``--events``: events/s from the
first send to the last covering record), **latency @ R** for R = each of ``--rates-per-gpu``
times the GPU count (``--seconds`` each; ``sustained`` as in worker_bench: producer kept
up, at most 0.25 s of input left at the schedule's end, drained within ``--drain-s``).
Then, with two or more GPUs, **kill**: paced at ``--kill-rate-per-gpu`` times the count,
the last child gets SIGKILL ``--kill-after-s`` in; ``served_again_s`` is the time from the
kill until every partition it owned has an output record stamped after the kill (by the
restarted child or, past the session timeout, by a survivor), against the target
``session_timeout_s + 5``; ``restart_ready_s`` until the restarted child answers
``/readyz`` again. Row ``scaling_vs_one_gpu``: backlog events/s of N GPUs over one, and the
highest total rate each sustained with e2p p99 <= ``--p99-bound-ms``.

    .venv/bin/python -m bench.multi_gpu_bench --config small --cpu --users 40 \
        --events 600 --rates-per-gpu 100 --seconds 2      # this CPU machine, CPU children
    # nvidia-h200-x2 (bench/h200_session.sh multigpu):
    python3 -m bench.multi_gpu_bench --config hstu-8l --users 2000 --events 60000 \
        --rates-per-gpu 2000 5000 --seconds 6 --partitions 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from bench._report import RESULTS_DIR, print_table, write_results
from bench.bench_plan import IntArray, Plan, geometry, kv_budget
from bench.engine_bench import WORKLOADS, _model, _preload
from bench.event_producer import Job, job_result, producer_process
from bench.reference_config import ReferenceWorkload
from bench.soak import ProcessSampler
from bench.worker_phases import EventBook, Row, pct
from streamrec.cache.history_backends import open_history_store
from streamrec.errors import BrokerError
from streamrec.models.checkpoint import META, save_checkpoint
from streamrec.schemas.records import Recommendation
from streamrec.tools.cli import render_toml
from streamrec.tools.devbroker import DevBroker, free_port_block
from streamrec.tools.supervisor import ChildStart, parse_child_start
from streamrec.worker import config as wc

REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = Path(".streamrec-cache/bench-models")
BLOCK_SIZE = 16
_SUSTAINED_LAG_S = 0.25


def model_dir_for(w: ReferenceWorkload, root: Path = MODELS_DIR) -> Path:
    """``w`` as a model directory (random init, seed 0, built on the CPU), saved once. Its
    item names are the producer's (``i<n>``), unlike bench/aoti_packages.py's."""
    path = root / f"multi-gpu-{w.name}"
    if (path / META).is_file():
        return path
    if path.exists():
        shutil.rmtree(path)
    model, vocab = _model(w, "cpu")
    tmp = root / f".tmp-multi-gpu-{w.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(tmp, model, vocab, {"model_name": w.name})
    tmp.rename(path)
    return path


class OutputReader:
    """Every record of the output topic as (user_id, version, record time s, partition)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.rows: list[tuple[str, int, float, int]] = []
        self._bootstrap, self._topic = bootstrap, topic
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer
        from aiokafka.structs import TopicPartition

        consumer = AIOKafkaConsumer(
            bootstrap_servers=self._bootstrap, enable_auto_commit=False, fetch_max_wait_ms=20
        )
        await consumer.start()
        await consumer.topics()
        parts = sorted(consumer.partitions_for_topic(self._topic) or ())
        tps = [TopicPartition(self._topic, p) for p in parts]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        self._task = asyncio.create_task(self._read(consumer))

    async def _read(self, consumer: Any) -> None:
        try:
            while True:
                for tp, records in (await consumer.getmany(timeout_ms=100)).items():
                    for r in records:
                        rec = Recommendation.from_bytes(r.value)
                        row = (rec.user_id, rec.version, r.timestamp / 1e3, tp.partition)
                        self.rows.append(row)
        finally:
            await consumer.stop()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def get(port: int, path: str) -> tuple[int, str]:
    """(HTTP status, body) of a child's endpoint; (0, '') while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


def owned_partitions(metrics: str, topic: str) -> set[int]:
    """Partitions of ``topic`` in a child's lag gauge (one series per owned partition)."""
    out = set()
    for line in metrics.splitlines():
        if line.startswith("streamrec_consumer_lag{") and f'topic="{topic}"' in line:
            out.add(int(line.split('partition="', 1)[1].split('"', 1)[0]))
    return out


@dataclass
class Fleet:
    """One supervisor run: its process, log, children's ports, and what was sent."""

    proc: subprocess.Popen[bytes]
    log: Path
    ports: list[int]
    conn: Connection
    reader: OutputReader
    book: EventBook
    timeout_s: float
    broker: ProcessSampler | None = None  # the dev broker's CPU: is a row broker-bound?
    produced: int = 0
    seen: int = 0  # reader rows already given to the book
    samples: list[tuple[float, int]] = field(default_factory=list)  # (wall s, completed)

    def starts(self) -> list[ChildStart]:
        lines = self.log.read_text(errors="replace").splitlines()
        return [s for line in lines if (s := parse_child_start(line)) is not None]

    def completed(self) -> int:
        return sum(min(self.book.covered[u], len(ev)) for u, ev in self.book.events.items())

    def take(self) -> list[float]:
        """e2p (ms) of the events the records read since the last call first cover."""
        rows = self.reader.rows[self.seen :]
        self.seen += len(rows)
        return self.book.latencies_ms([(u, v, t, 0.0) for u, v, t, _ in rows])

    def send(self, job: Job) -> None:
        self.book.add(job)
        self.produced += len(job.users)
        self.conn.send(job)

    async def result(self) -> dict[str, float]:
        return await job_result(self.conn, self.timeout_s)

    async def watch(self, timeout_s: float, e2p: list[float], until: float = 0.0) -> bool:
        """Collect e2p until wall time ``until`` or, without it, until every produced event
        is covered; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            e2p.extend(self.take())
            done = self.completed()
            if not self.samples or done != self.samples[-1][1]:
                self.samples.append((time.time(), done))
            if (time.time() >= until) if until else (done >= self.produced):
                return True
            if self.proc.poll() is not None:
                raise BrokerError(f"the supervisor exited ({self.proc.returncode}): {self.log}")
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)

    def broker_cpu_s(self) -> float:
        return self.broker.cpu_seconds() if self.broker is not None else 0.0

    def row(
        self, phase: str, start_wall: float, done_at: int, e2p: list[float], cpu_s: float
    ) -> Row:
        moved = [(t, c) for t, c in self.samples if t >= start_wall and c > done_at]
        last = moved[-1] if moved else (start_wall, done_at)
        wall = last[0] - start_wall
        row: Row = {"phase": phase, "completed": last[1] - done_at, "wall_s": round(wall, 3)}
        row["events_per_s"] = round(row["completed"] / wall, 1) if wall > 0 else 0.0
        elapsed = max(time.time() - start_wall, 1e-9)
        row["broker_cpu_pct"] = round(100.0 * (self.broker_cpu_s() - cpu_s) / elapsed, 1)
        if e2p:
            row |= {"e2p_events": len(e2p), "e2p_p50_ms": pct(e2p, 50)}
            row |= {"e2p_p99_ms": pct(e2p, 99), "e2p_max_ms": round(max(e2p), 2)}
        return row


async def backlog(fleet: Fleet, phase: str, users: IntArray) -> Row:
    start, done, cpu = time.time(), fleet.completed(), fleet.broker_cpu_s()
    fleet.send(Job(users))
    if not await fleet.watch(fleet.timeout_s, []):
        raise BrokerError(f"{phase}: {len(users)} events not done in {fleet.timeout_s} s")
    got = await fleet.result()
    row = fleet.row(phase, start, done, [], cpu) | {"events": len(users)}
    return row | {"producer_events_per_s": round(got["events_per_s"], 1)}


async def paced(fleet: Fleet, phase: str, rate: float, users: IntArray, drain_s: float) -> Row:
    start_ms = (time.time() + 0.5) * 1000.0
    ts = (start_ms + np.arange(len(users)) * (1000.0 / rate)).astype(np.int64)
    done, e2p, cpu = fleet.completed(), list[float](), fleet.broker_cpu_s()
    fleet.send(Job(users, ts))
    await fleet.watch(fleet.timeout_s, e2p, until=float(ts[-1]) / 1000.0)
    lag = fleet.produced - fleet.completed()
    complete = await fleet.watch(drain_s, e2p)
    got = await fleet.result()
    row = fleet.row(phase, start_ms / 1000.0, done, e2p, cpu)
    row |= {"events": len(users), "rate": rate}
    kept_up = got["events_per_s"] >= 0.95 * rate
    sustained = complete and kept_up and lag <= _SUSTAINED_LAG_S * rate
    row |= {"producer_events_per_s": round(got["events_per_s"], 1), "lag_at_end": lag}
    return row | {"complete": complete, "sustained": sustained}


async def kill_phase(
    fleet: Fleet, ns: argparse.Namespace, n: int, topic: str, drawn: IntArray
) -> Row:
    """Paced input; the last child SIGKILLed ``kill_after_s`` in; when is it served again."""
    rate = ns.kill_rate_per_gpu * n
    session_s = ns.session_timeout_ms / 1000.0
    users = np.resize(drawn, int(rate * (ns.kill_after_s + kill_tail_s(ns))))
    start_ms = (time.time() + 0.5) * 1000.0
    ts = (start_ms + np.arange(len(users)) * (1000.0 / rate)).astype(np.int64)
    fleet.send(Job(users, ts))
    await fleet.watch(fleet.timeout_s, [], until=start_ms / 1000.0 + ns.kill_after_s)
    port = fleet.ports[-1]
    victim = [s for s in fleet.starts() if s.http_port == port][-1]
    status, metrics = await asyncio.to_thread(get, port, "/metrics")
    parts = owned_partitions(metrics, topic)
    first = len(fleet.reader.rows)
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.time()
    ready_at: float | None = None
    served: dict[int, float] = {}
    deadline = killed + session_s + 30.0
    while time.time() < deadline and (ready_at is None or len(served) < len(parts)):
        for _, _, t, p in fleet.reader.rows[first:]:
            if p in parts and t > killed and p not in served:
                served[p] = t - killed
        first = len(fleet.reader.rows)
        if ready_at is None and (await asyncio.to_thread(get, port, "/readyz"))[0] == 200:
            ready_at = time.time() - killed
        await asyncio.sleep(0.05)
    await fleet.watch(fleet.timeout_s, [], until=float(ts[-1]) / 1000.0)
    # Each child's own memory store lost the killed one's histories (versions restart), so
    # completion is only counted with a shared store.
    complete = await fleet.watch(ns.drain_s, []) if ns.store_url.startswith("redis") else None
    await fleet.result()
    after = (await asyncio.to_thread(get, port, "/metrics"))[1]
    served_again = max(served.values()) if len(served) == len(parts) and parts else None
    target = session_s + 5.0
    return {
        "phase": f"kill {victim.child} @ {rate:g}/s",
        "killed_child": victim.child,
        "killed_partitions": sorted(parts),
        "served_again_s": round(served_again, 2) if served_again is not None else None,
        "served_again_per_partition_s": {p: round(s, 2) for p, s in sorted(served.items())},
        "restart_ready_s": round(ready_at, 2) if ready_at is not None else None,
        "restarted_child_owns": sorted(owned_partitions(after, topic)),
        "target_s": target,
        "met": served_again is not None and served_again <= target,
        "complete": complete,  # only meaningful with a shared store (--store-url redis://)
        "metrics_status_before_kill": status,
    }


def kill_tail_s(ns: argparse.Namespace) -> float:
    """How long the kill phase's schedule goes on after the kill: past the session timeout
    and a rebalance, or nothing would be left to serve when the partitions come back."""
    return ns.kill_tail_s if ns.kill_tail_s else ns.session_timeout_ms / 1000.0 + 15.0


def worker_config(
    bootstrap: str, w: ReferenceWorkload, ns: argparse.Namespace, kv: int, n: int, port: int
) -> wc.WorkerConfig:
    from streamrec.pipeline.micro_batcher import BatcherConfig
    from streamrec.pipeline.scoring_config import ScoringConfig

    session = ns.session_timeout_ms
    return wc.WorkerConfig(
        kafka=wc.KafkaConfig(
            bootstrap,
            "streamrec-multi-gpu",
            fetch_max_wait_ms=ns.fetch_max_wait_ms,
            session_timeout_ms=session,
            heartbeat_interval_ms=min(1_000, session // 3),
            request_timeout_ms=session + 5_000,
            connect_retry_max_s=1.0,
        ),
        topics=wc.TopicsConfig(
            playback=f"mg{n}-playback",
            interaction=f"mg{n}-interaction",
            output=f"mg{n}-recommendations",
            dead_letter=f"mg{n}-dlq",
        ),
        group=wc.GroupConfig(group_id=f"streamrec-multi-gpu-{n}"),
        batching=BatcherConfig(max_batch_users=ns.max_batch_users, max_wait_ms=ns.max_wait_ms),
        scoring=ScoringConfig(num_candidates=w.num_candidates, top_k=20),
        cache=wc.CacheConfig(kv_budget_bytes=kv, block_size=BLOCK_SIZE, host_tier_bytes=0),
        # The gpu-eager overlay's path, eager + CUDA graphs: no packages to compile first
        # (deploy/'s gpu overlay serves AOTI packages in CUDA graphs, faster on the H200).
        model=wc.ModelConfig(
            model_dir=model_dir_for(w, ns.models_dir),
            backend="eager",
            cuda_graphs=not ns.no_cuda_graphs,
        ),
        store=wc.StoreConfig(url=ns.store_url),
        http=wc.HttpConfig(host="127.0.0.1", port=port),
        log=wc.LogConfig(format="json", level="INFO"),
    )


async def run_count(
    n: int, broker: Any, w: ReferenceWorkload, ns: argparse.Namespace, plan: Plan
) -> list[Row]:
    """Every phase with ``n`` children, on topics and a group of its own."""
    budget, _ = kv_budget(w, plan, geometry(w, False))
    port = free_port_block(n)
    config = worker_config(broker.bootstrap_servers, w, ns, budget, n, port)
    t, parts = config.topics, ns.partitions
    await broker.create_topics_async(
        {t.playback: parts, t.interaction: parts, t.output: parts, t.dead_letter: 1}
    )
    ns.log_dir.mkdir(parents=True, exist_ok=True)
    file, log = ns.log_dir / f"multi_gpu_{n}.toml", ns.log_dir / f"multi_gpu_{n}.log"
    file.write_text(render_toml(config.to_dict(mask_secrets=False)))
    which = ["--cpu-children" if ns.cpu else "--gpus", str(n)]  # the first n GPUs
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMREC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "streamrec.tools.cli", "run", "--config", str(file), *which]
    argv.append("--dynamic-members")  # static members keep rebalancing on the dev broker
    _preflight(env)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    producer = ctx.Process(
        target=producer_process,
        args=(broker.bootstrap_servers, t.playback, w.num_items, parts, child),
        daemon=True,
    )
    producer.start()
    reader = OutputReader(broker.bootstrap_servers, t.output)
    await reader.start()
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    ports = [port + i for i in range(n)]
    fleet = Fleet(proc, log, ports, conn, reader, EventBook(plan.lengths), ns.timeout_s)
    if broker.pid is not None:
        fleet.broker = ProcessSampler(broker.pid)
    rows: list[Row] = []
    try:
        started = time.monotonic()
        while not all([(await asyncio.to_thread(get, p, "/readyz"))[0] == 200 for p in ports]):
            if proc.poll() is not None or time.monotonic() - started > ns.timeout_s:
                raise BrokerError(f"{n} children not ready in {ns.timeout_s} s: see {log}")
            await asyncio.sleep(0.2)
        ready_s = round(time.monotonic() - started, 1)
        rows.append(await backlog(fleet, "warm", np.arange(ns.users, dtype=np.int64)))
        rows[-1]["ready_s"] = ready_s
        backends = [_backend((await asyncio.to_thread(get, p, "/metrics"))[1]) for p in ports]
        rows[-1]["backends"] = backends
        _progress(n, rows[-1])
        rows.append(await backlog(fleet, "throughput", plan.throughput))
        _progress(n, rows[-1])
        for rate, users in plan.rates:
            if rate < 0:  # the kill phase's users, drawn up front for the KV budget
                continue
            total = rate * n
            users_n = np.resize(users, int(total * ns.seconds))
            rows.append(await paced(fleet, f"latency @ {total:g}/s", total, users_n, ns.drain_s))
            _progress(n, rows[-1])
            if not rows[-1]["complete"]:
                print(f"{total:g}/s did not drain in {ns.drain_s} s: higher rates skipped")
                break
        if n >= 2 and not ns.no_kill:
            try:
                drawn = plan.rates[-1][1]
                rows.append(await kill_phase(fleet, ns, n, t.playback, drawn))
                _progress(n, rows[-1])
            except Exception as exc:  # the scaling rows above stand on their own
                print(f"kill phase failed: {exc!r}", flush=True)
                rows.append({"phase": "kill", "error": repr(exc)})
    finally:
        with contextlib.suppress(OSError):
            conn.send(None)
        await asyncio.to_thread(producer.join, 10.0)
        if producer.is_alive():
            producer.terminate()
        proc.send_signal(signal.SIGTERM)
        try:
            status = await asyncio.to_thread(proc.wait, config.group.drain_timeout_s + 20)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = proc.wait()
        await reader.stop()
    for row in rows:
        row["gpus"] = n
    rows[-1]["supervisor_exit_status"] = status
    return rows


def _preflight(env: dict[str, str]) -> None:
    """Fail in a second, not after a timeout, where `streamrec run` cannot start (e.g. a
    device machine whose Python lacks uvloop: its wheel goes into .whl/)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import uvloop, streamrec.tools.cli, streamrec.worker.app"],
        env=env, cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"`streamrec run` cannot start with {sys.executable}: {last}")


def _backend(metrics: str) -> str:
    for line in metrics.splitlines():
        if line.startswith("streamrec_model_backend{") and line.rstrip().endswith(" 1.0"):
            return line.split('backend="', 1)[1].split('"', 1)[0]
    return "unknown"


def _progress(n: int, row: Row) -> None:
    keys = ("phase", "completed", "events_per_s", "e2p_p50_ms", "e2p_p99_ms", "sustained",
            "served_again_s", "restart_ready_s", "met")  # fmt: skip
    print(f"[{n} gpu] " + "  ".join(f"{k}={row[k]}" for k in keys if k in row), flush=True)


def scaling(rows: list[Row], counts: list[int], bound_ms: float) -> Row:
    """N GPUs against one: backlog events/s, and the highest total paced rate sustained
    with e2p p99 within the bound (the paced rates are per GPU, so N GPUs are asked N
    times the load: a ratio of N means they held the bound at the same load per GPU)."""
    by = {n: [r for r in rows if r.get("gpus") == n] for n in counts}
    out: Row = {"phase": "scaling_vs_one_gpu", "p99_bound_ms": bound_ms, "target": 1.9}

    def throughput(n: int) -> float:
        return next((r["events_per_s"] for r in by[n] if r["phase"] == "throughput"), 0.0)

    def at_bound(n: int) -> float:
        ok = [
            r["rate"] for r in by[n] if r.get("sustained") and r.get("e2p_p99_ms", 1e9) <= bound_ms
        ]
        return max(ok, default=0.0)

    if 1 not in by:
        return out | {"error": "no one-GPU run"}
    for n in counts:
        if n == 1:
            continue
        ratio = throughput(n) / throughput(1) if throughput(1) else None
        rate_ratio = at_bound(n) / at_bound(1) if at_bound(1) else None
        out |= {
            f"throughput_ratio_{n}": round(ratio, 3) if ratio is not None else None,
            f"sustained_rate_at_bound_{n}": at_bound(n),
            f"rate_ratio_at_bound_{n}": round(rate_ratio, 3) if rate_ratio is not None else None,
        }
    out["sustained_rate_at_bound_1"] = at_bound(1)

    def reached(key: str) -> bool:
        got = [out.get(f"{key}_{n}") for n in counts if n != 1]
        return bool(got) and all(r is not None and r >= 1.9 for r in got)

    out["met_throughput"] = reached("throughput_ratio")
    out["met_at_bound"] = reached("rate_ratio_at_bound")  # same per-GPU load, same bound
    out["met"] = out["met_throughput"] and out["met_at_bound"]
    return out


async def _run(ns: argparse.Namespace) -> list[Row]:
    w: ReferenceWorkload = WORKLOADS[ns.config]
    rng = np.random.default_rng(ns.seed)
    shared = ns.store_url.startswith("redis")
    lengths = w.history_lengths(ns.users, seed=ns.seed) if shared else np.zeros(ns.users, np.int64)
    top = max(ns.counts)
    throughput = rng.integers(ns.users, size=ns.events).astype(np.int64)
    rates = [(float(r), rng.integers(ns.users, size=int(r * top * ns.seconds)).astype(np.int64))
             for r in ns.rates_per_gpu]  # fmt: skip
    kill_s = ns.kill_after_s + kill_tail_s(ns)
    kill = rng.integers(ns.users, size=int(ns.kill_rate_per_gpu * top * kill_s)).astype(np.int64)
    plan = Plan(lengths, [np.arange(ns.users, dtype=np.int64)], throughput, [*rates, (-1.0, kill)])
    t0 = time.perf_counter()
    model_dir_for(w, ns.models_dir)
    build_s = time.perf_counter() - t0
    rows: list[Row] = []
    async with DevBroker() as broker:
        for n in ns.counts:
            if shared:
                store = open_history_store(ns.store_url, w.max_seq_len)
                await _preload(store, lengths, w.num_items, np.random.default_rng(ns.seed))
                await store.close()
            rows.extend(await run_count(n, broker, w, ns, plan))
    rows.append(scaling(rows, ns.counts, ns.p99_bound_ms))
    rows[-1]["model_build_s"] = round(build_s, 1)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", choices=sorted(WORKLOADS), default="hstu-8l")
    parser.add_argument("--cpu", action="store_true", help="CPU children (--cpu-children)")
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2], help="GPU counts")
    parser.add_argument("--users", type=int, default=2_000)
    parser.add_argument("--events", type=int, default=60_000, help="throughput backlog")
    parser.add_argument("--rates-per-gpu", type=float, nargs="+", default=[2_000.0, 5_000.0])
    parser.add_argument("--seconds", type=float, default=6.0, help="per paced rate")
    parser.add_argument("--drain-s", type=float, default=20.0)
    parser.add_argument("--kill-rate-per-gpu", type=float, default=1_000.0)
    parser.add_argument("--kill-after-s", type=float, default=3.0)
    parser.add_argument("--kill-tail-s", type=float, default=0.0, help="0: session + 15 s")
    parser.add_argument("--no-kill", action="store_true")
    parser.add_argument("--p99-bound-ms", type=float, default=500.0)
    parser.add_argument("--session-timeout-ms", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--max-batch-users", type=int, default=256)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--fetch-max-wait-ms", type=int, default=5)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--store-url", default="memory://", help="redis://... = shared, preloaded")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="per wait")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--models-dir", type=Path, default=MODELS_DIR)
    parser.add_argument("--log-dir", type=Path, default=Path(".streamrec-cache/multi-gpu-logs"))
    ns = parser.parse_args(argv)
    if 1 not in ns.counts:
        parser.error("--counts must include 1 (the baseline)")
    rows = asyncio.run(_run(ns))
    meta: Row = {"argv": sys.argv[1:] if argv is None else argv, "config": ns.config}
    meta |= {"workload": dataclasses.asdict(WORKLOADS[ns.config]), "store_url": ns.store_url}
    table = ("gpus", "phase", "completed", "events_per_s", "e2p_p50_ms", "e2p_p99_ms",
             "sustained", "served_again_s", "restart_ready_s", "target_s", "met")  # fmt: skip
    print_table([{k: r.get(k, "") for k in table} for r in rows])
    path = write_results("worker_bench_multi_gpu", rows, meta, ns.results_dir)
    print(f"wrote {path}")
    if os.environ.get("OUT"):
        print(
            f"wrote {write_results('worker_bench_multi_gpu', rows, meta, Path(os.environ['OUT']))}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
