"""Soak: the worker as a subprocess at a fixed input rate for minutes; memory and latency
must stay flat (issue 9).

The bench starts its own dev broker, a worker process (``streamrec run``) with a small
random-init HSTU, a producer that sends ``--rate`` events/s over a fixed population of
users (Zipf-skewed, so the KV pool churns: users are evicted and rebuilt all the time), and
a reader of the output topic. Every ``--window`` seconds it samples the worker's resident
memory (psutil if installed, else ``/proc/<pid>/status`` VmRSS) and CPU time, and the
event-to-publish latency of every recommendation in the window: the output record's
timestamp (stamped by the worker's producer when it queues the record) minus the event
time of the newest event the recommendation covers (the producer stamps ``ts_ms`` with the
wall clock at send). That figure includes the time records wait in the broker; the
worker's own share (batcher enqueue to the broker's ack, the ``event_to_publish``
histogram of ``/metrics``), the batcher's queue delay, the engine's busy share (step time
by phase, summed) and the consumer lag are scraped beside it, and the broker's
memory and CPU are sampled too: the dev broker keeps every record in memory with no
retention, so over minutes it is the part that slows down. Verdict: worker RSS growth
from the second window to the last (the first holds the warm-up: model load, pool fill,
first rebuilds) and the drift of the worker's p99 over the same span.

    python -m bench.soak                   # 10 minutes at 500 events/s
    python -m bench.soak --duration 180    # shorter
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from bench._report import print_table, write_results
from streamrec.cache.history_backends import open_history_store
from streamrec.cache.history_store import HistoryEvent, Token
from streamrec.models.checkpoint import save_checkpoint
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.pipeline.micro_batcher import BatcherConfig
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.schemas.codec import encode_event
from streamrec.schemas.events import InteractionEvent, PlaybackEvent
from streamrec.schemas.records import Recommendation
from streamrec.schemas.wire import CONTENT_TYPE_HEADER
from streamrec.tools.cli import render_toml
from streamrec.tools.devbroker import DevBroker, free_port
from streamrec.worker.config import (
    CacheConfig,
    GroupConfig,
    HttpConfig,
    KafkaConfig,
    LogConfig,
    ModelConfig,
    StoreConfig,
    TopicsConfig,
    WorkerConfig,
)

REPO = Path(__file__).resolve().parents[1]
PARTITIONS = 4
MAX_SEQ_LEN = 128
RSS_FLAT_FRACTION = 0.10  # growth from window 2 to the last that still counts as flat
P99_FLAT_RATIO = 1.5


@dataclass(frozen=True)
class SoakArgs:
    duration_s: float
    window_s: float
    rate: float
    users: int
    items: int
    store_url: str
    kv_budget_bytes: int
    preload: bool


@dataclass
class Window:
    """What happened in one window; latencies in ms."""

    produced: int = 0
    latencies: list[float] = field(default_factory=list)


def build_model(path: Path, items: int, seed: int = 0) -> Path:
    """A random-init HSTU: the worker's costs do not depend on trained weights."""
    torch.manual_seed(seed)
    vocab = ItemVocabulary([f"i{n}" for n in range(items)], num_oov_buckets=8)
    config = HSTUConfig(
        num_items=vocab.size,
        num_oov_buckets=8,
        d_model=32,
        num_layers=2,
        num_heads=2,
        head_dim=16,
        max_seq_len=MAX_SEQ_LEN,
        num_time_buckets=16,
        task_hidden=32,
    )
    save_checkpoint(path, HSTU(config).eval(), vocab, {"model_name": "soak"})
    return path


async def preload_histories(args: SoakArgs) -> None:
    """Give every user a full window of history before the clock starts, so that each
    cache miss rebuilds ``MAX_SEQ_LEN`` tokens from the first window to the last: with
    empty histories the work per miss would grow all through the run and hide (or fake)
    drift. The tokens come from a topic the soak never uses, so their watermarks are apart.
    """
    rng = np.random.default_rng(2)
    vocab = ItemVocabulary([f"i{n}" for n in range(args.items)], num_oov_buckets=8)
    store = open_history_store(args.store_url, MAX_SEQ_LEN)
    now_ms = int(time.time() * 1000)
    try:
        for first in range(0, args.users, 100):
            batch = [
                HistoryEvent(
                    f"u{user}",
                    "soak-preload",
                    0,
                    n,
                    Token(
                        vocab.index(f"i{rng.integers(args.items)}"),
                        1,
                        now_ms - 1000 * (MAX_SEQ_LEN - n),
                    ),
                )
                for user in range(first, min(first + 100, args.users))
                for n in range(MAX_SEQ_LEN)
            ]
            await store.append(batch)
    finally:
        await store.close()


def worker_config(bootstrap: str, model_dir: Path, args: SoakArgs, http_port: int) -> WorkerConfig:
    return WorkerConfig(
        kafka=KafkaConfig(bootstrap_servers=bootstrap, client_id="streamrec-soak"),
        topics=TopicsConfig(),
        group=GroupConfig(group_id="streamrec-soak", commit_interval_ms=1_000),
        batching=BatcherConfig(max_batch_users=64, max_wait_ms=5.0),
        scoring=ScoringConfig(num_candidates=64, top_k=10),
        cache=CacheConfig(kv_budget_bytes=args.kv_budget_bytes, host_tier_bytes=0),
        model=ModelConfig(model_dir=model_dir, device="cpu"),
        store=StoreConfig(url=args.store_url),
        http=HttpConfig(host="127.0.0.1", port=http_port),
        log=LogConfig(format="json", level="WARNING"),
    )


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition to ``{"name{labels}": value}`` (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def histogram_quantile(
    before: dict[str, float], after: dict[str, float], name: str, q: float
) -> float:
    """The q-quantile (ms) of a histogram's observations between two scrapes, linearly
    interpolated inside the bucket that holds it (as PromQL's histogram_quantile)."""
    prefix = f'{name}_bucket{{le="'
    bounds = sorted((float(key[len(prefix) : -2]), key) for key in after if key.startswith(prefix))
    counts = [(le, after[key] - before.get(key, 0.0)) for le, key in bounds]
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return 0.0
    rank = q * total
    lower_le, lower_count = 0.0, 0.0
    for le, cumulative in counts:
        if cumulative >= rank:
            if le == float("inf"):
                return lower_le * 1000.0
            share = (rank - lower_count) / max(cumulative - lower_count, 1e-12)
            return (lower_le + (le - lower_le) * share) * 1000.0
        lower_le, lower_count = le, cumulative
    return lower_le * 1000.0


class ProcessSampler:
    """Resident memory and CPU time of one process (psutil when available)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._tick = os.sysconf("SC_CLK_TCK")
        try:
            import psutil

            self._proc = psutil.Process(pid)
        except ImportError:
            self._proc = None

    def rss_bytes(self) -> int:
        if self._proc is not None:
            return int(self._proc.memory_info().rss)
        with open(f"/proc/{self.pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for pid {self.pid}")

    def cpu_seconds(self) -> float:
        if self._proc is not None:
            times = self._proc.cpu_times()
            return float(times.user + times.system)
        with open(f"/proc/{self.pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime, stime


async def produce(
    bootstrap: str, args: SoakArgs, windows: list[Window], stop: asyncio.Event
) -> None:
    """``args.rate`` events/s in 10 ms slices, ``ts_ms`` = wall clock at send."""
    rng = np.random.default_rng(1)
    weights = 1.0 / np.arange(1, args.users + 1) ** 0.8
    weights /= weights.sum()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    headers = [(CONTENT_TYPE_HEADER, b"application/msgpack")]
    started = time.monotonic()
    sent = 0
    try:
        while not stop.is_set():
            due = int((time.monotonic() - started) * args.rate)
            n = due - sent
            if n > 0:
                users = rng.choice(args.users, size=n, p=weights)
                items = rng.integers(args.items, size=n)
                now_ms = int(time.time() * 1000)
                for user_n, item_n in zip(users, items, strict=True):
                    user, item = f"u{user_n}", f"i{item_n}"
                    if rng.random() < 0.6:
                        event: PlaybackEvent | InteractionEvent = PlaybackEvent(
                            user, item, now_ms, int(rng.integers(200_000)), 200_000
                        )
                        topic = "playback-events"
                    else:
                        event = InteractionEvent(user, item, now_ms, "like")
                        topic = "interaction-events"
                    await producer.send(
                        topic, encode_event(event), key=user.encode(), headers=headers
                    )
                sent += n
                windows[-1].produced += n
            await asyncio.sleep(0.01)
        await producer.flush()
    finally:
        await producer.stop()


async def read_output(bootstrap: str, windows: list[Window], stop: asyncio.Event) -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition("recommendations", p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=200)
            for records in batches.values():
                for record in records:
                    rec = Recommendation.from_bytes(record.value)
                    windows[-1].latencies.append(float(record.timestamp - rec.last_event_ts_ms))
    finally:
        await consumer.stop()


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return 0, b""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return (int(head.split()[1]) if head else 0), body


async def scrape(port: int) -> dict[str, float]:
    return parse_metrics((await http_get(port, "/metrics"))[1].decode())


def spawn_worker(config: WorkerConfig, workdir: Path) -> subprocess.Popen[bytes]:
    file = workdir / "worker.toml"
    file.write_text(render_toml(config.to_dict(mask_secrets=False)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMREC_")}
    env["PYTHONPATH"] = str(REPO)
    with (workdir / "worker.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "streamrec.tools.cli", "run", "--config", str(file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )


@dataclass(frozen=True)
class Sample:
    """One moment: worker and broker resources and the worker's metrics."""

    at: float
    rss: int
    cpu_s: float
    broker_rss: int
    broker_cpu_s: float
    metrics: dict[str, float]


def window_row(n: int, t_s: float, window: Window, a: Sample, b: Sample) -> dict[str, object]:
    span = b.at - a.at
    lat = np.array(window.latencies) if window.latencies else np.zeros(1)
    e2p = "streamrec_event_to_publish_seconds"
    lag = sum(v for k, v in b.metrics.items() if k.startswith("streamrec_consumer_lag{"))
    queue = "streamrec_queue_delay_seconds"
    step_sums = [k for k in b.metrics if k.startswith("streamrec_step_seconds_sum{")]
    busy = sum(b.metrics[k] - a.metrics.get(k, 0.0) for k in step_sums)  # s of engine work
    return {
        "window": n,
        "t_s": round(t_s),
        "events_per_s": round(window.produced / span, 1),
        "recs_per_s": round(len(window.latencies) / span, 1),
        "rss_mb": round(b.rss / 2**20, 1),
        "cpu_pct": round(100 * (b.cpu_s - a.cpu_s) / span, 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 1),
        "p99_ms": round(float(np.percentile(lat, 99)), 1),
        "max_ms": round(float(lat.max()), 1),
        "worker_p50_ms": round(histogram_quantile(a.metrics, b.metrics, e2p, 0.5), 1),
        "worker_p99_ms": round(histogram_quantile(a.metrics, b.metrics, e2p, 0.99), 1),
        "queue_p50_ms": round(histogram_quantile(a.metrics, b.metrics, queue, 0.5), 1),
        "engine_busy_pct": round(100 * busy / span, 1),
        "lag": int(lag),
        "broker_rss_mb": round(b.broker_rss / 2**20, 1),
        "broker_cpu_pct": round(100 * (b.broker_cpu_s - a.broker_cpu_s) / span, 1),
    }


def verdict(rows: list[dict[str, object]]) -> dict[str, object]:
    """Worker RSS growth and p99 drift from the second window (past warm-up) to the last;
    the verdict is on the worker's own p99, the end-to-end one is reported beside it."""
    if len(rows) < 3:
        return {"verdict": "too short: needs at least 3 windows"}
    second, last = rows[1], rows[-1]

    def num(row: dict[str, object], key: str) -> float:
        value = row[key]
        assert isinstance(value, int | float)
        return float(value)

    def drift(key: str) -> float:
        return num(last, key) / num(second, key) if num(second, key) > 0 else float("inf")

    rss2, rss_last = num(second, "rss_mb"), num(last, "rss_mb")
    growth = (rss_last - rss2) / rss2
    flat = growth <= RSS_FLAT_FRACTION and drift("worker_p99_ms") <= P99_FLAT_RATIO
    return {
        "rss_growth_mb": round(rss_last - rss2, 1),
        "rss_growth_fraction": round(growth, 4),
        "rss_max_mb": max(num(r, "rss_mb") for r in rows[1:]),
        "worker_p99_window2_ms": num(second, "worker_p99_ms"),
        "worker_p99_last_ms": num(last, "worker_p99_ms"),
        "worker_p99_drift_ratio": round(drift("worker_p99_ms"), 3),
        "e2e_p99_window2_ms": num(second, "p99_ms"),
        "e2e_p99_last_ms": num(last, "p99_ms"),
        "e2e_p99_drift_ratio": round(drift("p99_ms"), 3),
        "broker_rss_growth_mb": round(num(last, "broker_rss_mb") - num(second, "broker_rss_mb"), 1),
        "verdict": "flat" if flat else "NOT flat",
    }


async def soak(args: SoakArgs) -> tuple[list[dict[str, object]], dict[str, object]]:
    workdir = Path(tempfile.mkdtemp(prefix="streamrec-soak-"))
    model_dir = build_model(workdir / "model", args.items)
    if args.preload:
        await preload_histories(args)
    broker = DevBroker(log_path=workdir / "broker.log")
    await broker.start_async()
    worker: subprocess.Popen[bytes] | None = None
    try:
        await broker.create_topics_async(
            {
                "playback-events": PARTITIONS,
                "interaction-events": PARTITIONS,
                "recommendations": PARTITIONS,
                "streamrec-dlq": 1,
            }
        )
        http_port = free_port()
        config = worker_config(broker.bootstrap_servers, model_dir, args, http_port)
        worker = spawn_worker(config, workdir)
        deadline = time.monotonic() + 120
        while (await http_get(http_port, "/readyz"))[0] != 200:
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker not ready; log {workdir / 'worker.log'}")
            await asyncio.sleep(0.2)
        sampler = ProcessSampler(worker.pid)
        assert broker.pid is not None
        broker_sampler = ProcessSampler(broker.pid)

        async def sample() -> Sample:
            return Sample(
                time.monotonic(),
                sampler.rss_bytes(),
                sampler.cpu_seconds(),
                broker_sampler.rss_bytes(),
                broker_sampler.cpu_seconds(),
                await scrape(http_port),
            )

        windows = [Window()]
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(produce(broker.bootstrap_servers, args, windows, stop)),
            asyncio.create_task(read_output(broker.bootstrap_servers, windows, stop)),
        ]
        rows: list[dict[str, object]] = []
        last = await sample()
        started = last.at
        while last.at - started < args.duration_s - 1e-6:
            await asyncio.sleep(min(args.window_s, args.duration_s - (last.at - started)))
            if any(t.done() for t in tasks) or worker.poll() is not None:
                raise RuntimeError(f"a soak task or the worker stopped; see {workdir}")
            now = await sample()
            window, windows[-1] = windows[-1], Window()
            row = window_row(len(rows) + 1, now.at - started, window, last, now)
            rows.append(row)
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            last = now
        stop.set()
        await asyncio.gather(*tasks)
        worker.send_signal(signal.SIGTERM)
        status = await asyncio.to_thread(worker.wait, 60)
        summary = verdict(rows) | {"worker_exit_status": status}
        shutil.rmtree(workdir, ignore_errors=True)  # kept (logs) when the soak failed
        return rows, summary
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        await broker.stop_async()
        if args.store_url.startswith("redis"):
            with contextlib.suppress(Exception):
                store = open_history_store(args.store_url, 128)
                await store.delete([f"u{n}" for n in range(args.users)])
                await store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (600)")
    parser.add_argument("--window", type=float, default=30.0, help="sample every N s (30)")
    parser.add_argument("--rate", type=float, default=500.0, help="events/s (500)")
    parser.add_argument("--users", type=int, default=5_000)
    parser.add_argument("--items", type=int, default=1_000)
    parser.add_argument("--kv-budget-mb", type=float, default=16.0)
    parser.add_argument(
        "--store",
        default=f"redis://127.0.0.1:6379/0?prefix=streamrec-soak-{uuid.uuid4().hex[:8]}",
        help="history store URL (Redis, cleaned up after; memory:// also works)",
    )
    parser.add_argument(
        "--no-preload", action="store_true", help="start from empty histories (cost grows)"
    )
    ns = parser.parse_args(argv)
    args = SoakArgs(
        duration_s=ns.duration,
        window_s=ns.window,
        rate=ns.rate,
        users=ns.users,
        items=ns.items,
        store_url=ns.store,
        kv_budget_bytes=int(ns.kv_budget_mb * 2**20),
        preload=not ns.no_preload,
    )
    print(f"soak: {args.rate:g} events/s for {args.duration_s:g} s, windows of {args.window_s:g} s")
    rows, summary = asyncio.run(soak(args))
    print()
    print_table(rows)
    print()
    print(" ".join(f"{k}={v}" for k, v in summary.items()))
    meta = {k: v for k, v in asdict(args).items() if k != "store_url"} | {"summary": summary}
    path = write_results("soak", rows, meta)
    print(f"wrote {path.relative_to(REPO)}")
    return 0 if summary.get("worker_exit_status") == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
