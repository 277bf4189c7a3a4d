"""``streamrec demo``: the whole system on one machine, and the numbers that back its claim.

A dev broker (Tansu) with the four topics; a small model trained on the demo data in
seconds to a few CPU-minutes (kept under ``.streamrec-cache/demo/`` for the next run) or the
configured one; MovieLens-small when the shared data is present (titles from
``movies.csv``), synthetic data otherwise; the real worker (``App``) in this process. Two
replays: one paced at ``--rate`` (a few users' updates are printed as they are
acknowledged), then one unpaced (as fast as the worker goes), each with a few malformed
records mixed in. It closes with a table: incremental vs full recompute for the same
users, HR@10 against most-popular, cache hit rate, per-phase p50/p99 and throughput.

The worker's configuration comes from the same layers as ``streamrec run`` (``--config``,
``STREAMREC_*``, ``--set``, shortcut flags) above the demo's own defaults, so e.g.
``STREAMREC_MODEL__BACKEND=aoti`` with an exported package serves the AOTI path.
Only the broker address is the demo's own: it starts the broker.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, TextIO

from aiokafka import AIOKafkaProducer

from streamrec.cache.history_backends import open_history_store
from streamrec.cache.history_store import History, HistoryStore
from streamrec.errors import BrokerError, StreamrecError
from streamrec.offline.evaluation import evaluate
from streamrec.pipeline.micro_batcher import BatcherConfig
from streamrec.pipeline.reference import full_recompute
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.schemas.codec import encode_event
from streamrec.schemas.events import Event, PlaybackEvent
from streamrec.schemas.records import Recommendation
from streamrec.schemas.wire import CONTENT_TYPE_HEADER, WireFormat
from streamrec.tools.config_flags import effective_config
from streamrec.tools.demo_data import (
    DEMO_DEFAULTS,
    DemoConfig,
    DemoSource,
    load_source,
    log_to_events,
    replay_users,
)
from streamrec.tools.demo_model import (
    demo_model_dir,
    ensure_demo_model,
    is_trained,
    train_demo_model,
    training_log,
)
from streamrec.tools.demo_report import (
    DemoReport,
    Exactness,
    Quality,
    Recorder,
    Throughput,
)
from streamrec.tools.devbroker import DevBroker
from streamrec.tools.update_cost import measure_update_costs
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
from streamrec.worker.logging_setup import configure_logging
from streamrec.worker.model_loader import LoadedModel, load_model
from streamrec.worker.serving_pipeline import Published
from streamrec.worker.serving_stack import serving_scoring

__all__ = ["DemoConfig", "run_demo", "run_demo_command", "train_demo_model", "worker_config"]

# (value, to the playback topic?, key or None for the user's): one of each rejection kind
_MALFORMED: Final = (
    (b"\xc1 not msgpack", True, None),
    (b'{"user_id": "u1", "item_id": 7, "ts_ms": 1}', False, None),
    (b'{"item_id": "s1", "ts_ms": 1, "ms_played": 1, "duration_ms": 2}', True, None),
    # a valid event keyed by another user: it would sit on that user's partition
    (b'{"user_id": "u1", "item_id": "s1", "ts_ms": 1, "action": "like"}', False, b"u2"),
)
_SHOWN_ITEMS: Final = 3
Record = tuple[bool, bytes | None, bytes]  # (to the playback topic?, key, value)


def worker_config(bootstrap: str, model_dir: Path) -> WorkerConfig:
    """A fixed small CPU worker config (benchmarks use it; the demo itself layers)."""
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
    """Prints the watched users' recommendations (titles, not ids), every ``every``-th."""

    def __init__(self, source: DemoSource, users: list[str], out: TextIO, every: int = 3):
        self.source = source
        self.shown = dict.fromkeys(users, -every)
        self.out = out
        self.every = every
        self.active = True

    def __call__(self, rec: Recommendation, latency_s: float) -> None:
        last = self.shown.get(rec.user_id)
        if not self.active or last is None or rec.version < last + self.every:
            return
        self.shown[rec.user_id] = rec.version
        top = " · ".join(
            f"{self.source.title(item)} {score:.2f}" for item, score in rec.items[:_SHOWN_ITEMS]
        )
        self.out.write(
            f"{rec.user_id:>6} v{rec.version:<3} {rec.cache_outcome.value:<8} "
            f"{latency_s * 1000:6.1f} ms  {top}\n"
        )
        self.out.flush()


def _records(cfg: DemoConfig, events: Sequence[Event]) -> Iterator[Record]:
    """The events as records, with a malformed record every ``malformed_every``."""
    for n, event in enumerate(events, start=1):
        yield isinstance(event, PlaybackEvent), event.user_id.encode(), encode_event(event)
        if cfg.malformed_every and n % cfg.malformed_every == 0:
            value, playback, key = _MALFORMED[(n // cfg.malformed_every) % len(_MALFORMED)]
            yield playback, key or event.user_id.encode(), value


async def _produce(
    producer: AIOKafkaProducer, topics: TopicsConfig, records: list[Record], rate: float | None
) -> None:
    """Send the records, paced at ``rate`` events/s (None: as fast as the broker takes)."""
    headers = {
        fmt: [(CONTENT_TYPE_HEADER, fmt.content_type.encode())]
        for fmt in (WireFormat.MSGPACK, WireFormat.JSON)
    }
    started = time.monotonic()
    pending = []
    for n, (is_playback, key, value) in enumerate(records, start=1):
        topic = topics.playback if is_playback else topics.interaction
        fmt = WireFormat.JSON if value[:1] == b"{" else WireFormat.MSGPACK
        pending.append(await producer.send(topic, value, key=key, headers=headers[fmt]))
        if rate is not None:
            ahead = n / rate - (time.monotonic() - started)
            if ahead > 0.005:
                await asyncio.sleep(ahead)
        if len(pending) >= 500:
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending)


@dataclass
class _Run:
    """The worker of one demo run and what feeds it."""

    app: App
    worker: asyncio.Task[int]
    producer: AIOKafkaProducer
    recorder: Recorder

    async def wait(self, done: Callable[[], bool], timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if self.worker.done():
                status = self.worker.result()
                raise BrokerError(f"the demo worker stopped early with status {status}")
            if time.monotonic() > deadline:
                raise BrokerError(f"the demo worker did not finish within {timeout_s:.0f} s")
            await asyncio.sleep(0.005)

    async def replay(self, records: list[Record], rate: float | None, label: str) -> Throughput:
        """Produce ``records`` and wait until the worker has finished every one of them."""
        tracker = self.app.tracker
        target = tracker.stats().completed + len(records)
        first = len(self.recorder.latencies_s)
        started = time.monotonic()
        await _produce(self.producer, self.app.config.topics, records, rate)
        await self.wait(lambda: tracker.stats().completed >= target)
        seconds = time.monotonic() - started
        return Throughput(label, len(records), seconds, self.recorder.latencies_s[first:])


async def _compared_histories(
    store: HistoryStore, recorder: Recorder, max_seq_len: int, count: int
) -> dict[str, History]:
    """Up to ``count`` users whose last recommendation covers their whole history and whose
    history fits the window (where incremental and full recompute must agree)."""
    histories = await store.get(sorted(recorder.latest))
    fits = {
        u: h
        for u, h in histories.items()
        if 2 <= h.total_appended <= max_seq_len and recorder.latest[u].version == h.total_appended
    }
    return dict(list(fits.items())[:count])


def _exactness(
    loaded: LoadedModel,
    config: WorkerConfig,
    histories: dict[str, History],
    published: dict[str, Recommendation],
) -> Exactness:
    """The worker's last answers against the oracle, and the cost of an update both ways."""
    hstu = loaded.checkpoint.config
    scoring = serving_scoring(config.scoring, hstu)
    vocab = loaded.checkpoint.vocab
    expected = full_recompute(
        loaded.model, histories, num_layers=hstu.num_layers, num_heads=hstu.num_heads,
        head_dim=hstu.head_dim, max_seq_len=hstu.max_seq_len, dtype=hstu.torch_dtype,
        task_names=hstu.task_names, scoring=scoring, device=loaded.device,
        block_size=config.cache.block_size,
    )  # fmt: skip
    recomputed = {
        user: [(vocab.external(int(r)), float(s)) for r, s in zip(out.items, out.scores)]
        for user, out in expected.items()
    }
    costs = measure_update_costs(
        loaded.model, hstu, scoring, histories, loaded.device, config.cache.block_size
    )
    return Exactness.compare(
        published, recomputed, costs, [h.total_appended for h in histories.values()]
    )


def _quality(source: DemoSource, model_dir: Path, out: TextIO) -> Quality | None:
    try:
        result = evaluate(model_dir, training_log(source), k=10, report=None, device="cpu")
    except (StreamrecError, RuntimeError) as exc:  # e.g. the data do not fit the model
        out.write(f"model quality: not measured ({exc})\n")
        return None
    return Quality(result.k, result.model.hr, result.popular.hr, result.num_users)


async def run_demo(cfg: DemoConfig, config: WorkerConfig, source: DemoSource,
                   out: TextIO | None = None) -> DemoReport:  # fmt: skip
    """Broker, worker, two replays and the closing table (returned and printed)."""
    out = out if out is not None else sys.stdout  # looked up per call: tests capture it
    loaded = await asyncio.to_thread(load_model, config.model, kv_dtype=config.cache.kv_dtype)
    hstu = loaded.checkpoint.config
    out.write(_model_line(loaded, config) + "\n")
    chosen = replay_users(source.log, cfg.users, cfg.events_per_user)
    events = log_to_events(source.log, cfg.paced_events + cfg.unpaced_events, cfg.seed, chosen)
    records = list(_records(cfg, events))
    every = cfg.malformed_every
    split = cfg.paced_events + (cfg.paced_events // every if every else 0)  # paced records
    store = open_history_store(config.store.url, hstu.max_seq_len)
    recorder = Recorder()
    watcher = _Watcher(
        source, list(dict.fromkeys(e.user_id for e in events))[: cfg.watch_users], out
    )

    def published(done: Published) -> None:
        rec = done.recommendation()  # decodes the record: fine at demo rates
        recorder(rec, done.latency_s)
        watcher(rec, done.latency_s)

    try:
        async with DevBroker() as broker:
            config = _with_bootstrap(config, broker.bootstrap_servers)
            t = config.topics
            n = cfg.partitions
            await broker.create_topics_async(
                {t.playback: n, t.interaction: n, t.output: n, t.dead_letter: 1}
            )
            app = App(config, model=loaded, store=store, on_published=published)
            worker = asyncio.create_task(app.run())
            try:
                async with AIOKafkaProducer(
                    bootstrap_servers=broker.bootstrap_servers, acks="all", linger_ms=1
                ) as producer:
                    run = _Run(app, worker, producer, recorder)
                    await run.wait(lambda: app.ready, 60.0)
                    out.write(
                        f"dev broker at {broker.bootstrap_servers}; replaying {len(events)} "
                        f"events of {len(chosen)} users ({cfg.paced_events} at "
                        f"{cfg.rate:,.0f}/s, then {cfg.unpaced_events} unpaced)\n"
                    )
                    runs = []
                    if split:
                        runs.append(await run.replay(records[:split], cfg.rate, "paced"))
                    watcher.active = False
                    if records[split:]:
                        runs.append(await run.replay(records[split:], None, "unpaced"))
                    total = app.stats().tracker.tracked
                    await run.wait(lambda: sum(app.stats().committed.values()) >= total)
            finally:
                app.stop()
                status = await worker
            if status != 0:
                raise BrokerError(f"the demo worker exited with status {status}")
        histories = await _compared_histories(store, recorder, hstu.max_seq_len, cfg.compare_users)
        try:
            exactness: Exactness | None = await asyncio.to_thread(
                _exactness, loaded, config, histories, recorder.latest
            )
        except (StreamrecError, RuntimeError) as exc:  # the table goes on without it
            out.write(f"incremental vs full recompute: not measured ({exc})\n")
            exactness = None
    finally:
        await store.close()
    quality = await asyncio.to_thread(_quality, source, config.model.model_dir, out)
    report = DemoReport(
        source=source.name,
        backend=loaded.backend,
        device=str(loaded.device),
        model_version=loaded.checkpoint.version,
        published=app.stats().published,
        dead_letters=app.metrics.invalid_counts(),
        hit_rate=_hit_rate(app),
        phases=recorder.phase_ms(),
        runs=runs,
        exactness=exactness if histories else None,
        quality=quality,
    )
    out.write(report.render() + "\n")
    return report


def _model_line(loaded: LoadedModel, config: WorkerConfig) -> str:
    line = (
        f"model {loaded.checkpoint.model_name} {loaded.checkpoint.version}: backend "
        f"{loaded.backend} on {loaded.device}"
    )
    if loaded.backend == "eager_fallback":
        line += (
            f" (no AOTI package in {config.model.aoti_cache_dir}; `streamrec export "
            f"--model {config.model.model_dir}` compiles one)"
        )
    return line


def _hit_rate(app: App) -> float:
    if app.engine is None:
        return 0.0
    es = app.engine.stats()
    lookups = es.gpu_hits + es.host_hits + es.misses
    return (es.gpu_hits + es.host_hits) / lookups if lookups else 0.0


def _with_bootstrap(config: WorkerConfig, bootstrap: str) -> WorkerConfig:
    return replace(config, kafka=replace(config.kafka, bootstrap_servers=bootstrap))


def run_demo_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``streamrec demo``: config layers, data, model (cached or trained), then the run."""
    out = out if out is not None else sys.stdout
    cfg = DemoConfig(
        paced_events=args.num_events,
        unpaced_events=args.unpaced_events,
        rate=args.rate,
        users=args.users,
        partitions=args.partitions,
        watch_users=args.watch,
        ratings=args.ratings,
        synthetic=args.synthetic,
        retrain=args.retrain,
    )
    source = load_source(
        cfg.ratings, synthetic=cfg.synthetic, users=cfg.users, events_per_user=cfg.events_per_user
    )
    own_model = demo_model_dir(source)
    config = effective_config(args, {**DEMO_DEFAULTS, "model.model_dir": str(own_model)})
    configure_logging(config.log)
    out.write(f"data: {source.describe()}\n")
    if config.model.model_dir == own_model:
        if cfg.retrain or not is_trained(own_model):
            out.write(f"training the demo model on {source.name} data (kept in {own_model}) ...\n")
            out.flush()
        bar = sys.stderr if sys.stderr.isatty() else None  # a log file gets no bar lines
        model = ensure_demo_model(source, own_model, retrain=cfg.retrain, progress=bar)
        if not model.cached:
            out.write(f"trained in {model.trained_s:.1f} s\n")
    asyncio.run(run_demo(cfg, config, source, out))
    return 0
