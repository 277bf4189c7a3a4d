"""``streamrec demo``: the whole system on one machine in well under a minute.

A dev broker (Tansu) with the four topics, a small model trained on synthetic data in a
few seconds (or ``--model DIR``), a replayed event stream (synthetic, or a MovieLens
``ratings.csv`` with ``--events``) with a few malformed records mixed in, and the real
worker (``App``) in this process. It prints some users' recommendations as they are
acknowledged and a closing summary, then exits 0 once every record is committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from streamrec.errors import BrokerError, ConfigError
from streamrec.offline.datasets import InteractionLog, SyntheticSpec, read_movielens, synthetic_log
from streamrec.offline.training import TrainConfig, train
from streamrec.pipeline.micro_batcher import BatcherConfig
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.schemas.codec import encode_event
from streamrec.schemas.events import Action, Event, InteractionEvent, PlaybackEvent
from streamrec.schemas.wire import CONTENT_TYPE_HEADER, WireFormat
from streamrec.tools.devbroker import DevBroker
from streamrec.worker.app import App
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
from streamrec.worker.serving_pipeline import Published

_DURATION_MS = 200_000
_PLAYED_MS = {Action.COMPLETE: 190_000, Action.PARTIAL: 100_000, Action.SKIP: 10_000}
_INTERACTION = {Action.LIKE: "like", Action.SAVE: "save", Action.SHARE: "share"}
_MALFORMED = (
    b"\xc1 not msgpack",
    b'{"user_id": "u1", "item_id": 7, "ts_ms": 1}',
    b'{"item_id": "s1", "ts_ms": 1, "ms_played": 1, "duration_ms": 2}',
)


@dataclass(frozen=True)
class DemoConfig:
    """What the demo replays and how fast; ``rate`` 0 means as fast as the broker takes."""

    events: int = 5_000
    rate: float = 1_000.0
    partitions: int = 4
    model_dir: Path | None = None
    events_file: Path | None = None
    watch_users: int = 3
    malformed_every: int = 200  # one malformed record per this many events (0 = none)
    seed: int = 1

    def __post_init__(self) -> None:
        if self.events < 1 or self.partitions < 1 or self.watch_users < 0:
            raise ConfigError(
                f"demo: events={self.events} partitions={self.partitions} "
                f"watch_users={self.watch_users} must be >= 1, >= 1, >= 0"
            )
        if self.rate < 0 or self.malformed_every < 0:
            raise ConfigError(
                f"demo: rate={self.rate} malformed_every={self.malformed_every} must be >= 0"
            )


@dataclass
class DemoSummary:
    events: int
    malformed: int
    seconds: float
    published: int
    dead_letters: int
    latencies_s: list[float] = field(default_factory=list)
    hit_rate: float = 0.0
    batches: int = 0
    backend: str = ""

    @property
    def events_per_s(self) -> float:
        return (self.events + self.malformed) / self.seconds if self.seconds > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1000) if self.latencies_s else 0.0

    def render(self) -> str:
        return "\n".join(
            [
                "-- summary " + "-" * 50,
                f"events          {self.events} valid + {self.malformed} malformed "
                f"in {self.seconds:.1f} s ({self.events_per_s:,.0f} events/s)",
                f"published       {self.published} recommendations in {self.batches} batches "
                f"(backend {self.backend})",
                f"event->publish  p50 {self.percentile_ms(50):.1f} ms, "
                f"p99 {self.percentile_ms(99):.1f} ms",
                f"cache hit rate  {self.hit_rate:.1%}",
                f"dead letters    {self.dead_letters}",
            ]
        )


def log_to_events(log: InteractionLog, limit: int, seed: int = 0) -> list[Event]:
    """At most ``limit`` of the log's tokens as wire events, users interleaved.

    Every user's n-th event comes before anyone's (n+1)-th (random order within a round),
    so a short replay still reaches many users; each user's own events stay in order.
    Playback actions become playbacks with a matching fraction played, likes/saves/shares
    interactions; MovieLens VIEW becomes a partial playback.
    """
    lengths = log.lengths()
    users = np.repeat(np.arange(log.num_users), lengths)
    rank = np.arange(log.num_events) - np.repeat(log.offsets[:-1], lengths)  # [E]
    jitter = np.random.default_rng(seed).random(log.num_events)
    order = np.lexsort((jitter, rank))[:limit]
    out: list[Event] = []
    for i in order.tolist():
        user, item = log.users[int(users[i])], str(log.items[i])
        action, ts = Action(int(log.actions[i])), int(log.ts_ms[i])
        if action in _INTERACTION:
            out.append(InteractionEvent(user, item, ts, _INTERACTION[action]))
        else:
            played = _PLAYED_MS.get(action, _PLAYED_MS[Action.PARTIAL])
            out.append(PlaybackEvent(user, item, ts, played, _DURATION_MS))
    return out


def train_demo_model(out_dir: Path, progress: TextIO | None = None) -> Path:
    """A small HSTU on synthetic chains: a few seconds on two CPU cores."""
    data = synthetic_log(SyntheticSpec(num_users=300, num_items=200, events_per_user=30, seed=0))
    config = TrainConfig(
        epochs=2,
        batch_size=64,
        seq_len=32,
        max_seq_len=64,
        num_negatives=64,
        d_model=32,
        num_layers=2,
        num_heads=2,
        head_dim=16,
        num_oov_buckets=4,
        dropout=0.0,
        lr=3e-3,
        model_name="demo-hstu",
    )
    return train(data, out_dir, config, progress=progress).model_dir


def _source_log(cfg: DemoConfig) -> InteractionLog:
    if cfg.events_file is not None:
        return read_movielens(cfg.events_file)
    users = max(50, cfg.events // 15)
    return synthetic_log(
        SyntheticSpec(num_users=users, num_items=200, events_per_user=30, seed=cfg.seed)
    )


def worker_config(bootstrap: str, model_dir: Path) -> WorkerConfig:
    return WorkerConfig(
        kafka=KafkaConfig(bootstrap_servers=bootstrap, client_id="streamrec-demo"),
        topics=TopicsConfig(),
        group=GroupConfig(group_id="streamrec-demo", commit_interval_ms=200),
        batching=BatcherConfig(max_batch_users=64, max_wait_ms=5.0),
        scoring=ScoringConfig(num_candidates=64, top_k=10),
        cache=CacheConfig(kv_budget_bytes=32 << 20, host_tier_bytes=0),
        model=ModelConfig(model_dir=model_dir, device="cpu"),
        store=StoreConfig(url="memory://"),
        http=HttpConfig(host="127.0.0.1", port=0),
        log=LogConfig(format="text", level="WARNING"),
    )


class _Watcher:
    """Prints the watched users' recommendations, at most one per ``every`` versions."""

    def __init__(self, users: list[str], out: TextIO, every: int = 3) -> None:
        self.shown = dict.fromkeys(users, -every)
        self.out = out
        self.every = every
        self.latencies: list[float] = []

    def __call__(self, published: Published) -> None:
        latency_s = published.latency_s
        self.latencies.append(latency_s)
        last = self.shown.get(published.user_id)
        if last is not None and published.version >= last + self.every:
            rec = published.recommendation()
            self.shown[rec.user_id] = rec.version
            top = ", ".join(f"{item} {score:.2f}" for item, score in rec.items[:5])
            self.out.write(
                f"{rec.user_id:>6} v{rec.version:<3} {rec.cache_outcome.value:<8} "
                f"{latency_s * 1000:6.1f} ms  {top}\n"
            )
            self.out.flush()


def _records(cfg: DemoConfig, events: list[Event]) -> Iterator[tuple[bool, bytes, bytes]]:
    """(is playback, key, value), with a malformed record every ``malformed_every``."""
    for n, event in enumerate(events, start=1):
        yield isinstance(event, PlaybackEvent), event.user_id.encode(), encode_event(event)
        if cfg.malformed_every and n % cfg.malformed_every == 0:
            bad = _MALFORMED[(n // cfg.malformed_every) % len(_MALFORMED)]
            yield True, event.user_id.encode(), bad


async def _produce(
    bootstrap: str, topics: TopicsConfig, cfg: DemoConfig, events: list[Event]
) -> tuple[int, int]:
    """Send the stream (paced at ``cfg.rate``); returns (valid, malformed) counts."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    headers = [(CONTENT_TYPE_HEADER, WireFormat.MSGPACK.content_type.encode())]
    valid = malformed = 0
    started = time.monotonic()
    pending = []
    try:
        for is_playback, key, value in _records(cfg, events):
            topic = topics.playback if is_playback else topics.interaction
            pending.append(await producer.send(topic, value, key=key, headers=headers))
            if value in _MALFORMED:
                malformed += 1
            else:
                valid += 1
            if cfg.rate:
                ahead = (valid + malformed) / cfg.rate - (time.monotonic() - started)
                if ahead > 0.005:
                    await asyncio.sleep(ahead)
            if len(pending) >= 500:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return valid, malformed


async def run_demo(cfg: DemoConfig, out: TextIO = sys.stdout) -> DemoSummary:
    with tempfile.TemporaryDirectory(prefix="streamrec-demo-") as tmp:
        model_dir = cfg.model_dir
        if model_dir is None:
            out.write("training a small model on synthetic data ...\n")
            started = time.monotonic()
            model_dir = await asyncio.to_thread(train_demo_model, Path(tmp) / "model")
            out.write(f"trained in {time.monotonic() - started:.1f} s -> {model_dir}\n")
        events = log_to_events(_source_log(cfg), cfg.events, cfg.seed)
        async with DevBroker() as broker:
            config = worker_config(broker.bootstrap_servers, model_dir)
            t = config.topics
            await broker.create_topics_async(
                {
                    t.playback: cfg.partitions,
                    t.interaction: cfg.partitions,
                    t.output: cfg.partitions,
                    t.dead_letter: 1,
                }
            )
            out.write(f"dev broker at {broker.bootstrap_servers}; replaying {len(events)} events\n")
            watched = list(dict.fromkeys(e.user_id for e in events))[: cfg.watch_users]
            watcher = _Watcher(watched, out)
            app = App(config, on_published=watcher)
            worker = asyncio.create_task(app.run())
            await _wait_ready(app, worker)
            started = time.monotonic()
            valid, malformed = await _produce(broker.bootstrap_servers, t, cfg, events)
            await _wait_all_done(app, worker, valid + malformed)
            seconds = time.monotonic() - started
            app.stop()
            status = await worker
            if status != 0:
                raise BrokerError(f"the demo worker exited with status {status}")
            stats = app.stats()
            engine = app.engine
            assert engine is not None
            es = engine.stats()
            lookups = es.gpu_hits + es.host_hits + es.misses
            summary = DemoSummary(
                events=valid,
                malformed=malformed,
                seconds=seconds,
                published=stats.published,
                dead_letters=stats.dead_letters,
                latencies_s=watcher.latencies,
                hit_rate=(es.gpu_hits + es.host_hits) / lookups if lookups else 0.0,
                batches=stats.batches,
                backend=es.backend,
            )
    out.write(summary.render() + "\n")
    return summary


async def _wait_ready(app: App, worker: asyncio.Task[int], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not app.ready:
        if worker.done():
            raise BrokerError(f"the demo worker stopped early with status {worker.result()}")
        if time.monotonic() > deadline:
            raise BrokerError(f"the demo worker was not ready within {timeout_s} s")
        await asyncio.sleep(0.05)


async def _wait_all_done(app: App, worker: asyncio.Task[int], total: int) -> None:
    """Until every produced record is done (published or dead-lettered) and committed."""
    while True:
        if worker.done():
            raise BrokerError(f"the demo worker stopped early with status {worker.result()}")
        stats = app.stats()
        committed = sum(stats.committed.values())
        if stats.tracker.completed >= total and committed >= total:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(worker), 0.1)
