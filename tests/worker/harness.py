"""Shared pieces of the worker's end-to-end tests: a tiny model, a stream with malformed
records, topic readers, and the end-state check against the offline full recompute."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from streamrec.cache.history_store import History
from streamrec.models.checkpoint import load_checkpoint, save_checkpoint
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.pipeline.micro_batcher import BatcherConfig
from streamrec.pipeline.reference import full_recompute
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.schemas.codec import encode_event
from streamrec.schemas.events import InteractionEvent, PlaybackEvent
from streamrec.schemas.records import DeadLetter, Recommendation
from streamrec.schemas.validation import ErrorKind
from streamrec.schemas.wire import CONTENT_TYPE_HEADER
from streamrec.worker import serving_pipeline
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
from streamrec.worker.serving_stack import serving_scoring

PARTITIONS = 4
MAX_RECORD_BYTES = 2_048
BLOCK_SIZE = 8


def tiny_model_dir(path: Path, num_items: int = 120, seed: int = 0) -> Path:
    """A randomly initialised small HSTU saved as a model directory (no training needed)."""
    torch.manual_seed(seed)
    vocab = ItemVocabulary([f"i{n}" for n in range(num_items)], num_oov_buckets=4)
    config = HSTUConfig(
        num_items=vocab.size,
        num_oov_buckets=4,
        d_model=16,
        num_layers=2,
        num_heads=2,
        head_dim=8,
        max_seq_len=64,
        num_time_buckets=16,
        task_hidden=16,
    )
    save_checkpoint(path, HSTU(config).eval(), vocab, {"model_name": "tiny"})
    return path


@dataclass(frozen=True)
class Topics:
    playback: str
    interaction: str
    output: str
    dead_letter: str

    def config(self) -> TopicsConfig:
        return TopicsConfig(
            playback=self.playback,
            interaction=self.interaction,
            output=self.output,
            dead_letter=self.dead_letter,
            max_record_bytes=MAX_RECORD_BYTES,
        )


def make_topics(broker: object, unique_topic: Callable[[str], str]) -> Topics:
    topics = Topics(
        unique_topic("playback"),
        unique_topic("interaction"),
        unique_topic("recs"),
        unique_topic("dlq"),
    )
    create_topics(broker, topics)
    return topics


def create_topics(broker: object, topics: Topics) -> None:
    """The four topics with the test layout (again, on a broker that lost them)."""
    broker.create_topics(  # type: ignore[attr-defined]
        {
            topics.playback: PARTITIONS,
            topics.interaction: PARTITIONS,
            topics.output: PARTITIONS,
            topics.dead_letter: 1,
        }
    )


def worker_config(
    bootstrap: str,
    topics: Topics,
    group_id: str,
    model_dir: Path,
    store_url: str = "memory://",
    kv_blocks_bytes: int = 1 << 20,
    drain_timeout_s: float = 10.0,
) -> WorkerConfig:
    return WorkerConfig(
        kafka=KafkaConfig(
            bootstrap_servers=bootstrap,
            session_timeout_ms=6_000,
            heartbeat_interval_ms=500,
            request_timeout_ms=10_000,
            connect_retry_max_s=1.0,
        ),
        topics=topics.config(),
        group=GroupConfig(
            group_id=group_id, commit_interval_ms=100, drain_timeout_s=drain_timeout_s
        ),
        batching=BatcherConfig(max_batch_users=64, max_wait_ms=5.0),
        scoring=ScoringConfig(num_candidates=16, top_k=5),
        cache=CacheConfig(kv_budget_bytes=kv_blocks_bytes, block_size=BLOCK_SIZE),
        model=ModelConfig(model_dir=model_dir, device="cpu"),
        store=StoreConfig(url=store_url),
        http=HttpConfig(host="127.0.0.1", port=0),
        log=LogConfig(format="json", level="INFO"),
    )


@dataclass
class Stream:
    """What was produced, to check the end state against."""

    records: list[tuple[str, bytes, bytes]] = field(default_factory=list)  # topic, key, value
    valid: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # user -> events
    malformed: dict[bytes, str] = field(default_factory=dict)  # value -> expected kind
    # user -> (topic, event time) in produce order; times increase per user, so within
    # each topic this is the order the worker must apply them in
    ts: dict[str, list[tuple[str, int]]] = field(default_factory=lambda: defaultdict(list))

    @property
    def users(self) -> list[str]:
        return sorted(self.valid)


def make_stream(
    topics: Topics,
    n_events: int,
    n_users: int,
    malformed_fraction: float,
    seed: int,
    num_items: int = 120,
) -> Stream:
    """Events for ``n_users`` on both topics (some unknown items: OOV, not errors) with a
    share of malformed records of every kind the worker must dead-letter."""
    rng = np.random.default_rng(seed)
    stream = Stream()
    ts = {f"u{u}": 1_700_000_000_000 + int(rng.integers(10**9)) for u in range(n_users)}
    bad_kinds = [
        (b"\xc1 not msgpack %d", ErrorKind.UNDECODABLE),
        (
            b'{"user_id": "u0", "item_id": "i1", "ts_ms": -%d, "action": "like"}',
            ErrorKind.OUT_OF_RANGE,
        ),
        (b'{"user_id": "u0", "ts_ms": %d, "action": "like"}', ErrorKind.MISSING_FIELD),
        (
            b'{"user_id": "u0", "item_id": "i1", "ts_ms": %d, "action": "wave"}',
            ErrorKind.UNKNOWN_ACTION,
        ),
        (b'{"pad": "' + b"x" * MAX_RECORD_BYTES + b'", "n": %d}', ErrorKind.OVERSIZED),
    ]
    for n in range(n_events):
        user = f"u{int(rng.integers(n_users))}"
        if rng.random() < malformed_fraction:
            template, kind = bad_kinds[n % len(bad_kinds)]
            value = template % n
            stream.malformed[value] = kind.value
            stream.records.append((topics.interaction, user.encode(), value))
            continue
        ts[user] += int(rng.integers(1_000, 600_000))
        item = f"i{int(rng.integers(num_items))}" if rng.random() < 0.95 else f"new{n}"
        if rng.random() < 0.6:
            played = int(rng.integers(0, 200_000))
            event: PlaybackEvent | InteractionEvent = PlaybackEvent(
                user, item, ts[user], played, 200_000
            )
            topic = topics.playback
        else:
            action = ("like", "skip", "save", "click")[int(rng.integers(4))]
            event = InteractionEvent(user, item, ts[user], action)
            topic = topics.interaction
        stream.records.append((topic, user.encode(), encode_event(event)))
        stream.valid[user] += 1
        stream.ts[user].append((topic, ts[user]))
    return stream


async def produce(bootstrap: str, records: list[tuple[str, bytes, bytes]], rate: float = 0) -> None:
    """Send the records (keyed, content-type only on valid msgpack), optionally paced."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    started = time.monotonic()
    try:
        pending = []
        for n, (topic, key, value) in enumerate(records, start=1):
            headers = (
                []
                if value[:1] in (b"{", b"\xc1")
                else [(CONTENT_TYPE_HEADER, b"application/msgpack")]
            )
            pending.append(await producer.send(topic, value, key=key, headers=headers))
            if rate:
                ahead = n / rate - (time.monotonic() - started)
                if ahead > 0.01:
                    await asyncio.sleep(ahead)
            if len(pending) >= 1_000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


async def read_topic(bootstrap: str, topic: str) -> list[tuple[int, int, bytes]]:
    """Every record of ``topic`` as (partition, offset, value).

    Tansu's ListOffsets answers may lag the log (seen: 19,282 for 20,000 records), so
    the end is where fetching stops yielding records, not the listed end offset.
    """
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        await consumer.topics()
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[tuple[int, int, bytes]] = []
        quiet = 0
        while quiet < 3:
            batches = await consumer.getmany(timeout_ms=300)
            quiet = 0 if batches else quiet + 1
            for tp, records in batches.items():
                out.extend((tp.partition, r.offset, r.value) for r in records)
        return out
    finally:
        await consumer.stop()


async def end_offsets(bootstrap: str, topics: list[str]) -> dict[tuple[str, int], int]:
    """One past the last offset of every partition, found by reading (see read_topic)."""
    ends: dict[tuple[str, int], int] = {}
    for topic in topics:
        for partition, offset, _ in await read_topic(bootstrap, topic):
            ends[(topic, partition)] = max(ends.get((topic, partition), 0), offset + 1)
    return ends


async def committed_offsets(
    bootstrap: str, group_id: str, tps: list[tuple[str, int]]
) -> dict[tuple[str, int], int]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group_id, enable_auto_commit=False
    )
    await consumer.start()
    try:
        out = {}
        for topic, partition in tps:
            value = await consumer.committed(TopicPartition(topic, partition))
            out[(topic, partition)] = value if value is not None else 0
        return out
    finally:
        await consumer.stop()


async def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.2)


def latest_recommendations(records: list[tuple[int, int, bytes]]) -> dict[str, Recommendation]:
    latest: dict[str, Recommendation] = {}
    for _, _, value in records:
        rec = Recommendation.from_bytes(value)
        if rec.user_id not in latest or rec.version >= latest[rec.user_id].version:
            latest[rec.user_id] = rec
    return latest


def dead_letters(records: list[tuple[int, int, bytes]]) -> list[DeadLetter]:
    return [DeadLetter.from_bytes(value) for _, _, value in records]


def assert_matches_recompute(
    model_dir: Path,
    config: WorkerConfig,
    histories: Mapping[str, History],
    latest: Mapping[str, Recommendation],
) -> None:
    """Every user's last published list equals a from-scratch recompute of its history."""
    ckpt = load_checkpoint(model_dir)
    hstu = ckpt.config
    expected = full_recompute(
        ckpt.model,
        histories,
        num_layers=hstu.num_layers,
        num_heads=hstu.num_heads,
        head_dim=hstu.head_dim,
        max_seq_len=hstu.max_seq_len,
        dtype=torch.float32,
        task_names=hstu.task_names,
        scoring=serving_scoring(config.scoring, hstu),
        block_size=BLOCK_SIZE,
    )
    assert set(expected) == set(latest)
    for user, rec in latest.items():
        want = expected[user]
        assert rec.version == histories[user].total_appended == want.version, user
        assert rec.item_ids == [ckpt.vocab.external(int(r)) for r in want.items], user
        got = np.array([score for _, score in rec.items])
        np.testing.assert_allclose(got, want.scores, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- fault tests (issue 9)


class RedisServer:
    """A private ``redis-server`` on a free port, to stop and resume without touching the
    shared server. No persistence: SIGSTOP/SIGCONT keeps the data, a kill loses it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._proc: subprocess.Popen[bytes] | None = None

    def url(self, prefix: str, socket_timeout_s: float = 0.5) -> str:
        return f"redis://127.0.0.1:{self.port}/0?socket_timeout={socket_timeout_s}&prefix={prefix}"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise AssertionError("redis-server is not on PATH")
        self._proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock,
            ):
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return self
            time.sleep(0.05)
        self.stop()
        raise AssertionError(f"redis-server on port {self.port} did not answer PING")

    def pause(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.send_signal(signal.SIGCONT)  # a stopped process ignores SIGTERM until then
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass
class Published:
    """Every recommendation an in-process worker had acknowledged (``App(on_published=)``):
    survives a broker that lost its output topic."""

    latest: dict[str, Recommendation] = field(default_factory=dict)
    count: int = 0

    def __call__(self, published: serving_pipeline.Published) -> None:
        rec = published.recommendation()
        self.count += 1
        have = self.latest.get(rec.user_id)
        if have is None or rec.version >= have.version:
            self.latest[rec.user_id] = rec


def app_committed(app: App) -> int:
    """Records an in-process worker has committed, over all partitions."""
    return sum(app.stats().committed.values())


def assert_end_state(
    model_dir: Path,
    config: WorkerConfig,
    valid: Mapping[str, int],
    histories: Mapping[str, History],
    latest: Mapping[str, Recommendation],
    max_seq_len: int = 64,
    order: Mapping[str, list[tuple[str, int]]] | None = None,
) -> None:
    """The worker issue's end-state check: every valid event applied exactly once (nothing
    lost, no token duplicated), in order when ``order`` gives each user's event times,
    every user's last list covers all its events and equals the offline recompute."""
    for user, count in valid.items():
        assert histories[user].total_appended == count, (user, histories[user].total_appended)
        assert len(histories[user]) == min(count, max_seq_len), user
        if order is not None:
            assert_applied_in_order(histories[user].ts.tolist(), order[user])
    assert {u: r.version for u, r in latest.items()} == dict(valid)
    assert_matches_recompute(model_dir, config, {u: histories[u] for u in valid}, latest)


def assert_applied_in_order(history_ts: list[int], produced: list[tuple[str, int]]) -> None:
    """The stored window is the newest events, each exactly once, and each topic's events
    in produce order: the worker merges a user's two partitions by event time only over
    the events a batch holds together, so across batches the topics may interleave."""
    kept = sorted(ts for _, ts in produced)[-len(history_ts) :] if history_ts else []
    assert sorted(history_ts) == kept, "the window is not the newest events, once each"
    position = {ts: n for n, ts in enumerate(history_ts)}
    for topic in {t for t, _ in produced}:
        mine = [position[ts] for t, ts in produced if t == topic and ts in position]
        assert mine == sorted(mine), f"events of {topic} applied out of produce order"


async def start_app(app: App, timeout_s: float = 60) -> asyncio.Task[int]:
    task = asyncio.create_task(app.run())
    await wait_until(lambda: app.ready or task.done(), timeout_s, "the worker to be ready")
    assert not task.done(), "the worker stopped before it was ready"
    return task


def letter_values(letters: list[DeadLetter]) -> list[bytes]:
    """The dead-lettered record values, sorted (every input record has a value)."""
    values = [letter.value for letter in letters]
    assert all(v is not None for v in values)
    return sorted(v for v in values if v is not None)
