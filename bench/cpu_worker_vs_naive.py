"""One event stream three ways on the CPU: naive per-event recompute, the engine, the worker.

Issue 8, target 5. The naive loop is what a recommender without this project would do:
for every event, append it to the user's history (a Python list) and recompute that user's
recommendation from the whole history (``full_recompute``: prefill + retrieve + rank, the
same ``ScoringConfig`` the worker serves with), one event at a time, nothing cached or
batched. The engine row runs the same events through ``Engine`` without Kafka, in batches
made by the real ``MicroBatcher``; the worker row produces them into a dev broker and runs
the real ``App`` in this process. The model is the demo's (trained in about a second).

No user gets more than ``max_seq_len`` events by default (``--no-cap`` lifts it): the
engine plans a cached user whose coalesced burst in one batch is longer than the window
as an extend, which ``KVTiers.ensure_room`` refuses with a ``CacheError`` that stops the
worker (seen here: 513 new tokens, max_seq_len 64, in the worker's backlog batches).

Latency means different things per row, and the JSON says which: the naive loop's is one
event's recompute; the engine's is the step time of the batch the event rode in; the
worker's is produce-send to broker acknowledgement of the recommendation covering it.

    python -m bench.cpu_worker_vs_naive
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench._report import print_table, write_results
from streamrec.cache.history_backends import open_history_store
from streamrec.cache.history_store import History
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_tiers import KVTiers
from streamrec.errors import BrokerError, ConfigError
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.pipeline.delta import Delta
from streamrec.pipeline.engine import Engine, EngineConfig
from streamrec.pipeline.micro_batcher import Batch, BatcherClosed, BatcherConfig, MicroBatcher
from streamrec.pipeline.reference import full_recompute
from streamrec.schemas.codec import encode_event
from streamrec.schemas.events import Event, InteractionEvent, PlaybackEvent
from streamrec.schemas.wire import CONTENT_TYPE_HEADER, WireFormat
from streamrec.tools.demo import train_demo_model, worker_config
from streamrec.tools.devbroker import DevBroker
from streamrec.worker.app import App
from streamrec.worker.config import WorkerConfig
from streamrec.worker.model_loader import LoadedModel, load_model
from streamrec.worker.serving_pipeline import Published
from streamrec.worker.serving_stack import serving_scoring

_DURATION_MS = 200_000
_PLAYED_MS = (190_000, 100_000, 10_000)  # complete, partial, skip
_INTERACTIONS = ("like", "save", "share")
_TS0 = 1_700_000_000_000


@dataclass(frozen=True)
class StreamSpec:
    """The synthetic stream: ``users`` with Zipf(``skew``) activity, ``interaction_share``
    of the events explicit interactions, the rest playbacks."""

    events: int = 4_000
    users: int = 300
    skew: float = 1.0
    interaction_share: float = 0.2
    max_per_user: int = 0  # 0 = no cap
    seed: int = 0

    def __post_init__(self) -> None:
        if self.events < 1 or self.users < 1 or self.max_per_user < 0:
            raise ConfigError(
                f"stream: events={self.events} users={self.users} "
                f"max_per_user={self.max_per_user}: need >= 1, >= 1, >= 0"
            )
        if self.max_per_user and self.max_per_user * self.users < self.events:
            raise ConfigError(
                f"stream: {self.users} users x max_per_user={self.max_per_user} "
                f"cannot carry {self.events} events"
            )
        if self.skew < 0 or not 0.0 <= self.interaction_share <= 1.0:
            raise ConfigError(
                f"stream: skew={self.skew} interaction_share={self.interaction_share}: "
                "need skew >= 0 and 0 <= share <= 1"
            )


@dataclass(frozen=True)
class Setup:
    """What every path shares: the loaded model, the worker's config and the stream."""

    loaded: LoadedModel
    config: WorkerConfig
    events: list[Event]

    @property
    def vocab(self) -> ItemVocabulary:
        return self.loaded.checkpoint.vocab


def make_stream(spec: StreamSpec, vocab: ItemVocabulary) -> list[Event]:
    """Events in time order; a user's activity and an item's popularity are both Zipf."""
    rng = np.random.default_rng(spec.seed)
    users = _active_users(spec, rng)
    items = vocab.items
    item_p = 1.0 / np.arange(1, len(items) + 1) ** 0.8
    picks = rng.choice(len(items), size=spec.events, p=item_p / item_p.sum())
    kinds = rng.random(spec.events)
    flavours = rng.integers(0, 3, size=spec.events)
    out: list[Event] = []
    for n in range(spec.events):
        user, item, ts = f"u{int(users[n])}", items[int(picks[n])], _TS0 + 50 * n
        flavour = int(flavours[n])
        if kinds[n] < spec.interaction_share:
            out.append(InteractionEvent(user, item, ts, _INTERACTIONS[flavour]))
        else:
            out.append(PlaybackEvent(user, item, ts, _PLAYED_MS[flavour], _DURATION_MS))
    return out


def _active_users(spec: StreamSpec, rng: np.random.Generator) -> np.ndarray:
    """The user of every event [E]: Zipf draws, a user at the cap drawn no more."""
    weights = 1.0 / np.arange(1, spec.users + 1) ** spec.skew  # [U]
    if not spec.max_per_user:
        return rng.choice(spec.users, size=spec.events, p=weights / weights.sum())
    counts = np.zeros(spec.users, dtype=np.int64)
    out = np.empty(spec.events, dtype=np.int64)
    for n in range(spec.events):
        user = int(rng.choice(spec.users, p=weights / weights.sum()))
        out[n] = user
        counts[user] += 1
        if counts[user] == spec.max_per_user:
            weights[user] = 0.0
    return out


def _row(
    path: str, events: int, steps: int, seconds: float, lat_s: list[float], latency: str
) -> dict[str, object]:
    lat = np.asarray(lat_s) * 1000.0
    return {
        "path": path,
        "events": events,
        "model_steps": steps,
        "seconds": round(seconds, 3),
        "events_per_s": events / seconds,
        "mean_ms": float(lat.mean()),
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "latency": latency,
    }


# ---------------------------------------------------------------------- naive loop


def run_naive(setup: Setup, limit: int) -> dict[str, object]:
    """Per event: append to a Python list, recompute the user from the whole window."""
    hstu = setup.loaded.checkpoint.config
    scoring = serving_scoring(setup.config.scoring, hstu)
    vocab = setup.vocab
    histories: dict[str, list[tuple[int, int, int]]] = defaultdict(list)

    def recompute(user: str, rows: list[tuple[int, int, int]]) -> list[str]:
        table = np.asarray(rows[-hstu.max_seq_len :], dtype=np.int64)  # [L, 3]
        history = History.from_table(table, {}, len(rows))
        out = full_recompute(
            setup.loaded.model,
            {user: history},
            num_layers=hstu.num_layers,
            num_heads=hstu.num_heads,
            head_dim=hstu.head_dim,
            max_seq_len=hstu.max_seq_len,
            dtype=hstu.torch_dtype,
            task_names=hstu.task_names,
            scoring=scoring,
            device=setup.loaded.device,
            block_size=setup.config.cache.block_size,
        )[user]
        return [vocab.external(int(r)) for r in out.items]

    recompute("warm-up", [(vocab.index(vocab.items[0]), 1, _TS0)])  # first-call costs
    latencies: list[float] = []
    started = time.perf_counter()
    for event in setup.events[:limit]:
        t0 = time.perf_counter()
        rows = histories[event.user_id]
        rows.append((vocab.index(event.item_id), int(event.token_action), event.ts_ms))
        recompute(event.user_id, rows)
        latencies.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - started
    n = len(latencies)
    return _row("naive per-event recompute", n, n, seconds, latencies, "one recompute")


# ---------------------------------------------------------------------- engine alone


async def _batches(setup: Setup, flood: bool) -> list[Batch]:
    """Batches the real batcher makes when events trickle in one by one (a batch leaves
    as soon as ``max_batch_users`` users are pending) or all arrive at once (``flood``:
    every user's queued events coalesce, as in a worker catching up on a backlog)."""
    b = setup.config.batching
    batcher = MicroBatcher(
        BatcherConfig(
            max_batch_users=b.max_batch_users,
            max_queue_events=max(2 * b.queue_high_watermark, len(setup.events)),
        )
    )
    out: list[Batch] = []
    for offset, event in enumerate(setup.events):
        kind = "interaction" if isinstance(event, InteractionEvent) else "playback"
        delta = Delta(
            event.user_id, event.item_id, event.token_action, event.ts_ms, kind, 0, offset
        )
        batcher.submit(delta)
        if not flood and batcher.stats().queue_depth_users >= b.max_batch_users:
            out.append(await batcher.next_batch())
    batcher.close()
    with contextlib.suppress(BatcherClosed):
        while True:
            out.append(await batcher.next_batch())
    return out


def _engine(setup: Setup) -> Engine:
    """The engine as ``App._prepare`` builds it (same pool budget, no host tier on CPU)."""
    hstu = setup.loaded.checkpoint.config
    c = setup.config.cache
    geometry = KVCacheConfig(
        hstu.num_layers, hstu.num_heads, hstu.head_dim, c.block_size, hstu.torch_dtype
    )
    cache = KVCache(geometry, geometry.num_blocks_for(c.kv_budget_bytes), setup.loaded.device)
    return Engine(
        setup.loaded.model,
        KVTiers(cache, None, hstu.max_seq_len),
        open_history_store("memory://", hstu.max_seq_len),
        setup.vocab,
        hstu.task_names,
        EngineConfig(
            model_name=setup.loaded.checkpoint.model_name,
            model_version=setup.loaded.checkpoint.version,
            backend=setup.loaded.backend,
            scoring=serving_scoring(setup.config.scoring, hstu),
        ),
    )


async def run_engine(setup: Setup, flood: bool) -> tuple[dict[str, object], dict[str, object]]:
    batches = await _batches(setup, flood)
    engine = _engine(setup)
    latencies: list[float] = []
    started = time.perf_counter()
    for batch in batches:
        t0 = time.perf_counter()
        await engine.process(batch)
        latencies.extend([time.perf_counter() - t0] * batch.n_events)
    seconds = time.perf_counter() - started
    await engine.close()
    s = engine.stats()
    how = "all queued" if flood else f"{setup.config.batching.max_batch_users}-user"
    row = _row(f"engine, {how} batches", s.events, s.users, seconds, latencies, "batch step")
    looked_up = max(1, s.gpu_hits + s.host_hits + s.misses)
    detail = {
        "batches": s.batches,
        "hit_rate": s.gpu_hits / looked_up,
        "tokens_prefilled": s.tokens_prefilled,
        "tokens_extended": s.tokens_extended,
        "phase_ms": {k: round(v * 1000.0, 1) for k, v in s.phase_seconds.items()},
    }
    return row, detail


# ---------------------------------------------------------------------- whole worker


class _Acks:
    """Produce-to-acknowledgement latency of every event, from the publish hook.

    A recommendation of version ``v`` covers the user's first ``v`` events; produce order
    is taken as apply order (a user's playbacks and interactions travel on two topics, so
    the worker may interleave them differently: the latency is then approximate).
    """

    def __init__(self, events: list[Event]) -> None:
        self.by_user: dict[str, list[int]] = defaultdict(list)
        for n, event in enumerate(events):
            self.by_user[event.user_id].append(n)
        self.sent_at = [0.0] * len(events)
        self.covered: dict[str, int] = defaultdict(int)
        self.latencies: list[float] = []
        self.enqueue_latencies: list[float] = []
        self.last_ack = 0.0

    def __call__(self, rec: Published) -> None:
        now = time.monotonic()
        self.last_ack = now
        self.enqueue_latencies.append(rec.latency_s)
        seen = self.covered[rec.user_id]
        for n in self.by_user[rec.user_id][seen : rec.version]:
            self.latencies.append(now - self.sent_at[n])
        self.covered[rec.user_id] = max(seen, rec.version)


async def _produce(bootstrap: str, config: WorkerConfig, events: list[Event], acks: _Acks) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    headers = [(CONTENT_TYPE_HEADER, WireFormat.MSGPACK.content_type.encode())]
    t = config.topics
    pending = []
    try:
        for n, event in enumerate(events):
            topic = t.interaction if isinstance(event, InteractionEvent) else t.playback
            acks.sent_at[n] = time.monotonic()
            key = event.user_id.encode()
            pending.append(
                await producer.send(topic, encode_event(event), key=key, headers=headers)
            )
            if len(pending) >= 500:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


async def run_worker(
    setup: Setup, partitions: int, timeout_s: float
) -> tuple[dict[str, object], dict[str, object]]:
    acks = _Acks(setup.events)
    async with DevBroker() as broker:
        config = worker_config(broker.bootstrap_servers, setup.config.model.model_dir)
        t = config.topics
        topics = {t.playback: partitions, t.interaction: partitions, t.output: partitions}
        await broker.create_topics_async({**topics, t.dead_letter: 1})
        app = App(config, model=setup.loaded, on_published=acks)
        worker = asyncio.create_task(app.run())
        deadline = time.monotonic() + timeout_s
        while not app.ready:
            if worker.done() or time.monotonic() > deadline:
                raise BrokerError(f"the bench worker was not ready within {timeout_s} s")
            await asyncio.sleep(0.05)
        started = time.monotonic()
        await _produce(broker.bootstrap_servers, config, setup.events, acks)
        while app.stats().tracker.completed < len(setup.events):
            if worker.done() or time.monotonic() > deadline:
                raise BrokerError(
                    f"the bench worker completed {app.stats().tracker.completed} of "
                    f"{len(setup.events)} events within {timeout_s} s"
                )
            await asyncio.sleep(0.01)
        seconds = acks.last_ack - started
        app.stop()
        if await worker != 0:
            raise BrokerError("the bench worker exited with an error (see its log)")
    stats = app.stats()
    row = _row(
        "worker (Kafka, in-process)",
        len(setup.events),
        stats.published,
        seconds,
        acks.latencies,
        "produce->ack",
    )
    enq = np.asarray(acks.enqueue_latencies) * 1000.0
    detail: dict[str, object] = {
        "batches": stats.batches,
        "partitions": partitions,
        "enqueue_to_ack_p50_ms": float(np.percentile(enq, 50)),
        "enqueue_to_ack_p99_ms": float(np.percentile(enq, 99)),
    }
    return row, detail


# ---------------------------------------------------------------------- main


async def _run(ns: argparse.Namespace) -> int:
    torch.manual_seed(0)
    # One intra-op thread for every path: with two on this shared 2-core machine, the tiny
    # per-event ops of the naive loop wait on OpenMP barriers (measured 745 vs 112 events/s).
    torch.set_num_threads(ns.threads)
    load_before = os.getloadavg()  # the machine is shared: record how busy it was
    with tempfile.TemporaryDirectory(prefix="streamrec-bench-") as tmp:
        trained = time.perf_counter()
        model_dir = train_demo_model(Path(tmp) / "model")
        train_s = time.perf_counter() - trained
        config = worker_config("127.0.0.1:9", model_dir)  # the broker address is replaced
        loaded = load_model(config.model)
        cap = 0 if ns.no_cap else loaded.checkpoint.config.max_seq_len
        spec = StreamSpec(ns.events, ns.users, ns.skew, max_per_user=cap, seed=ns.seed)
        setup = Setup(loaded, config, make_stream(spec, loaded.checkpoint.vocab))
        limit = min(ns.naive_events or len(setup.events), len(setup.events))
        naive = run_naive(setup, limit)
        engine_rows = [await run_engine(setup, flood) for flood in (False, True)]
        worker, worker_detail = await run_worker(setup, ns.partitions, ns.timeout_s)
    rows = [naive, *(r for r, _ in engine_rows), worker]
    base = float(naive["events_per_s"])  # type: ignore[arg-type]
    for row in rows:
        row["speedup"] = float(row["events_per_s"]) / base  # type: ignore[arg-type]
    print_table(rows)
    hstu = loaded.checkpoint.config
    meta = {
        "argv": ns.argv,
        "stream": vars(spec),
        "busiest_user_events": max(Counter(e.user_id for e in setup.events).values()),
        "distinct_users": len({e.user_id for e in setup.events}),
        "naive_prefix": limit < len(setup.events),
        "model": {
            "name": loaded.checkpoint.model_name,
            "weights": f"trained ({train_s:.1f} s, demo recipe)",
            "d_model": hstu.d_model,
            "num_layers": hstu.num_layers,
            "num_heads": hstu.num_heads,
            "head_dim": hstu.head_dim,
            "max_seq_len": hstu.max_seq_len,
            "num_items": hstu.num_items,
        },
        "scoring": vars(serving_scoring(config.scoring, hstu)),
        "torch_threads": torch.get_num_threads(),
        "load_average_before_after": [load_before, os.getloadavg()],
        "engine": {str(r["path"]): d for r, d in engine_rows},
        "worker": worker_detail,
    }
    path = write_results("cpu_worker_vs_naive", rows, meta)
    if limit < len(setup.events):
        print(f"naive loop timed on the first {limit} of {len(setup.events)} events")
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=4_000)
    parser.add_argument("--users", type=int, default=300)
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--no-cap", action="store_true", help="users may exceed the window")
    parser.add_argument("--naive-events", type=int, default=0, help="0 = the whole stream")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    ns.argv = argv or []
    return asyncio.run(_run(ns))


if __name__ == "__main__":
    raise SystemExit(main())
