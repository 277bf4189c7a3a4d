"""Fault tests against real processes (issue 9): the dev broker, a private redis-server and
in-process workers. Every test ends with the worker issue's end-state check: nothing lost,
no token duplicated, committed <= processed, final recommendations equal the recompute.

What "nothing lost" means when the broker itself restarts: Tansu keeps its data in
memory, so a restarted broker has no topics, records or committed offsets. The worker
cannot recover records the broker lost; what it guarantees is that (a) everything it
applied before the restart stays applied once (the Redis history store keeps it), (b)
every record of the new log is applied once, although its offsets restart at 0 (the
watermarks are scoped by the broker's cluster id: ``LogScopedStore``), and (c) no offset
of the old log is ever committed to the new one. The producer re-sends to the new broker
what the old one had not acknowledged; here the old broker's part was fully processed
before it stopped, so the expected state is the recompute over everything produced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrec.cache.history_backends import open_history_store
from streamrec.cache.history_store import History
from streamrec.cache.kv_cache import KVCacheConfig
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.schemas.codec import encode_event
from streamrec.schemas.events import InteractionEvent, PlaybackEvent
from streamrec.schemas.validation import ErrorKind
from streamrec.tools.devbroker import DevBroker, free_port
from streamrec.worker.app import App
from streamrec.worker.config import ModelConfig, WorkerConfig
from streamrec.worker.model_loader import LoadedModel, load_model
from tests.worker.harness import (
    BLOCK_SIZE,
    PARTITIONS,
    Published,
    RedisServer,
    Stream,
    Topics,
    app_committed,
    assert_end_state,
    committed_offsets,
    create_topics,
    dead_letters,
    end_offsets,
    latest_recommendations,
    letter_values,
    make_stream,
    make_topics,
    produce,
    read_topic,
    start_app,
    tiny_model_dir,
    wait_until,
    worker_config,
)
from tests.worker.test_app import http_get

pytestmark = [pytest.mark.broker, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def own_port() -> int:
    return free_port()


@pytest.fixture
def own_broker(own_port: int) -> Iterator[DevBroker]:
    """A broker of the test's own on ``own_port``, free to stop and restart (it is not
    started here)."""
    broker = DevBroker(port=own_port)
    yield broker
    broker.stop()


def group_id() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


async def assert_committed_all(bootstrap: str, group: str, topics: Topics, total: int) -> None:
    """The broker has the group at the end offsets (committed == processed == produced)."""
    ends = await end_offsets(bootstrap, [topics.playback, topics.interaction])
    assert sum(ends.values()) == total
    assert await committed_offsets(bootstrap, group, sorted(ends)) == ends


async def test_absent_broker_then_up_on_the_same_port(
    own_broker, own_port, unique_topic, model_dir
) -> None:
    bootstrap = f"127.0.0.1:{own_port}"
    topics = Topics(*(unique_topic(s) for s in ("playback", "interaction", "recs", "dlq")))
    group = group_id()
    config = worker_config(bootstrap, topics, group, model_dir)
    store = open_history_store("memory://", 64)
    app = App(config, store=store)
    worker = asyncio.create_task(app.run())
    await wait_until(lambda: app.input.connect_attempts >= 3, 30, "connection retries")
    assert (await http_get(app.http.port, "/readyz"))[0] == 503
    assert (await http_get(app.http.port, "/healthz"))[0] == 200

    await own_broker.start_async()  # where the worker keeps knocking
    create_topics(own_broker, topics)
    await wait_until(lambda: app.ready or worker.done(), 60, "the worker to join")
    assert (await http_get(app.http.port, "/readyz"))[0] == 200

    stream = make_stream(topics, 2_000, 100, 0.02, seed=21)
    await produce(bootstrap, stream.records)
    total = len(stream.records)
    await wait_until(lambda: app_committed(app) == total or worker.done(), 120, "commits")
    histories = await store.get(stream.users)
    app.stop()
    assert await asyncio.wait_for(worker, 30) == 0

    await assert_committed_all(bootstrap, group, topics, total)
    letters = dead_letters(await read_topic(bootstrap, topics.dead_letter))
    assert letter_values(letters) == sorted(stream.malformed)
    latest = latest_recommendations(await read_topic(bootstrap, topics.output))
    assert_end_state(model_dir, config, stream.valid, histories, latest, order=stream.ts)


async def test_broker_restart_mid_stream_applies_the_new_log_once(
    own_broker, unique_topic, model_dir, redis_url, caplog
) -> None:
    """The restarted broker's offsets start at 0 again: the first worker notices the new
    cluster id before applying or committing anything of it and exits 1; its restart
    (a supervisor's job; here the test's) binds the new log and applies all of it."""
    await own_broker.start_async()
    bootstrap = own_broker.bootstrap_servers
    topics = make_topics(own_broker, unique_topic)
    group = group_id()
    prefix = f"streamrec-test-{uuid.uuid4().hex[:10]}"
    config = worker_config(bootstrap, topics, group, model_dir, f"{redis_url}?prefix={prefix}")
    stream = make_stream(topics, 3_000, 120, 0.0, seed=23)
    half = len(stream.records) // 2
    store = open_history_store(config.store.url, 64)
    published = Published()
    try:
        first = App(config, store=store, on_published=published)
        first_run = await start_app(first)
        await produce(bootstrap, stream.records[:half])
        await wait_until(lambda: app_committed(first) == half, 120, "the old log committed")

        await own_broker.stop_async()  # memory storage: topics, records, offsets are gone
        # While the broker is away the worker is alive but not ready.
        port = first.http.port

        async def unready() -> bool:
            status, body = await http_get(port, "/readyz")
            return status == 503 and b"broker unreachable" in body

        await wait_until(unready, 30, "readiness to notice the broker is gone")
        assert (await http_get(port, "/healthz"))[0] == 200
        await own_broker.start_async()  # same port, new cluster id
        create_topics(own_broker, topics)
        producer = asyncio.create_task(produce(bootstrap, stream.records[half:], rate=3_000))
        assert await asyncio.wait_for(first_run, 60) == 1
        fatal = [r for r in caplog.records if r.getMessage() == "fatal worker error, stopping"]
        assert fatal and "input log was replaced" in fatal[0].error
        tps = [(t, p) for t in (topics.playback, topics.interaction) for p in range(PARTITIONS)]
        none = dict.fromkeys(tps, 0)
        assert await committed_offsets(bootstrap, group, tps) == none  # no old position here

        second = App(config, model=first.loaded, store=store, on_published=published)
        second_run = await start_app(second)
        await producer
        rest = len(stream.records) - half
        await wait_until(lambda: app_committed(second) == rest, 120, "the new log committed")
        histories = await store.get(stream.users)
        second.stop()
        assert await asyncio.wait_for(second_run, 30) == 0
        await assert_committed_all(bootstrap, group, topics, rest)
        assert_end_state(
            model_dir, config, stream.valid, histories, published.latest, order=stream.ts
        )
    finally:
        await store.delete(stream.users)
        await store.close()


async def test_redis_outage_stalls_commits_then_resumes(broker, unique_topic, model_dir) -> None:
    """SIGSTOP: the server is unreachable but keeps its data (a network partition, a long
    pause); appends time out (socket_timeout), the engine retries with backoff, and no
    offset is completed or committed until they succeed after SIGCONT."""
    topics = make_topics(broker, unique_topic)
    bootstrap = broker.bootstrap_servers
    redis = RedisServer(free_port()).start()
    try:
        config = worker_config(bootstrap, topics, group_id(), model_dir, redis.url("outage"))
        # A short stall bound: the outage below lasts longer, and must not fail liveness.
        http = dataclasses.replace(config.http, stall_timeout_s=1.5)
        config = dataclasses.replace(config, http=http)
        stream = make_stream(topics, 4_000, 150, 0.0, seed=29)
        total = len(stream.records)
        store = open_history_store(config.store.url, 64)
        app = App(config, store=store)
        worker = await start_app(app)
        producer = asyncio.create_task(produce(bootstrap, stream.records, rate=1_000))
        await wait_until(lambda: app_committed(app) > 0, 60, "first commits")

        redis.pause()
        await asyncio.sleep(1.0)  # the batch in flight fails; acks already due land
        frozen = app.stats()
        await asyncio.sleep(2.0)
        during = app.stats()
        assert during.committed == frozen.committed  # nothing completes without the store
        assert during.tracker.completed == frozen.tracker.completed
        assert during.consumed > frozen.consumed  # events kept arriving meanwhile
        assert app.engine is not None and app.engine.stats().store_retries > 0
        assert app_committed(app) < total
        # Waiting out the outage is not a reason to restart the pod, nor to stop routing.
        status, body = await http_get(app.http.port, "/healthz")
        assert status == 200 and b"outage" in body
        assert (await http_get(app.http.port, "/readyz"))[0] == 200

        redis.resume()
        await producer
        await wait_until(lambda: app_committed(app) == total or worker.done(), 120, "commits")
        histories = await store.get(stream.users)
        await store.close()
        app.stop()
        assert await asyncio.wait_for(worker, 30) == 0
    finally:
        redis.stop()
    await assert_committed_all(bootstrap, config.group.group_id, topics, total)
    latest = latest_recommendations(await read_topic(bootstrap, topics.output))
    assert_end_state(model_dir, config, stream.valid, histories, latest, order=stream.ts)


async def test_tiny_kv_pool_evicts_and_keeps_up(broker, unique_topic, model_dir) -> None:
    """A pool of 12 blocks (users need up to 8 at 64 tokens): batches are admitted in
    parts, users are evicted and rebuilt from the store, nothing crashes."""
    topics = make_topics(broker, unique_topic)
    bootstrap = broker.bootstrap_servers
    geometry = KVCacheConfig(2, 2, 8, BLOCK_SIZE, torch.float32)  # tiny_model_dir's shape
    budget = 12 * geometry.bytes_per_block
    config = worker_config(bootstrap, topics, group_id(), model_dir, kv_blocks_bytes=budget)
    stream = make_stream(topics, 3_000, 150, 0.0, seed=31)
    total = len(stream.records)
    store = open_history_store("memory://", 64)
    app = App(config, store=store)
    worker = await start_app(app)
    assert app.engine is not None and app.engine.tiers.cache.pool.num_blocks == 12
    await produce(bootstrap, stream.records)
    await wait_until(lambda: app_committed(app) == total or worker.done(), 180, "commits")
    pool = app.engine.tiers.stats().pool
    histories = await store.get(stream.users)
    app.stop()
    assert await asyncio.wait_for(worker, 30) == 0
    assert pool.evictions > 0 and pool.blocks_used <= 12
    await assert_committed_all(bootstrap, config.group.group_id, topics, total)
    latest = latest_recommendations(await read_topic(bootstrap, topics.output))
    assert_end_state(model_dir, config, stream.valid, histories, latest, order=stream.ts)


@dataclasses.dataclass
class Run:
    valid_per_s: float
    valid_per_cpu_s: float  # per second of this process's CPU time (the worker's threads)
    submitted: int  # events the intake handed to the batcher (the engine's work)
    stream: Stream
    topics: Topics
    config: WorkerConfig
    histories: dict[str, History]


async def _valid_events_per_second(
    broker: DevBroker, unique_topic, model_dir: Path, malformed: float, model: LoadedModel
) -> Run:
    """Valid events/s over a backlog, from the first record consumed until every record is
    done (published or dead-lettered and acknowledged). The commit that follows is awaited
    untimed: its interval would otherwise add up to one commit period to a ~0.5 s run."""
    topics = make_topics(broker, unique_topic)
    config = worker_config(broker.bootstrap_servers, topics, group_id(), model_dir)
    stream = make_stream(topics, 3_000, 150, malformed, seed=37)
    await produce(broker.bootstrap_servers, stream.records)
    total = len(stream.records)
    store = open_history_store("memory://", 64)
    app = App(config, store=store, model=model)
    worker = asyncio.create_task(app.run())
    while app.stats().consumed == 0 and not worker.done():
        await asyncio.sleep(0.005)
    started, cpu_started = time.monotonic(), time.process_time()
    while app.stats().tracker.completed < total and not worker.done():
        await asyncio.sleep(0.005)
    elapsed, cpu = time.monotonic() - started, time.process_time() - cpu_started
    while app_committed(app) < total and not worker.done():
        await asyncio.sleep(0.005)
    histories = await store.get(stream.users)
    submitted = app.batcher.stats().submitted
    app.stop()
    assert await asyncio.wait_for(worker, 30) == 0
    valid = sum(stream.valid.values())
    return Run(valid / elapsed, valid / cpu, submitted, stream, topics, config, histories)


async def test_malformed_flood_keeps_valid_throughput(broker, unique_topic, model_dir) -> None:
    """10% malformed records cost dead-letter sends, not engine time: the intake hands the
    batcher exactly the valid events, as in a clean run of the same size, and every
    malformed record is dead-lettered once. Valid events per CPU-second of the worker are
    printed for three (clean, flood) pairs but not asserted: on the shared 2-core CI
    machine they swing with the load (one clean-clone run: flood/clean 0.26-0.61 per
    pair; alone, the same test: 0.98-1.14), so they measure the scheduler, not the
    dead-letter path; the throughput figure belongs to a benchmark, the cause to a test."""
    loaded = await asyncio.to_thread(
        load_model,
        ModelConfig(model_dir=model_dir, device="cpu"),
        ScoringConfig(num_candidates=16, top_k=5),
    )
    clean: list[float] = []
    flood: list[float] = []
    walls: list[tuple[float, float]] = []
    for _ in range(3):
        run = await _valid_events_per_second(broker, unique_topic, model_dir, 0.0, loaded)
        assert run.submitted == sum(run.stream.valid.values())
        clean.append(run.valid_per_cpu_s)
        wall = run.valid_per_s
        run = await _valid_events_per_second(broker, unique_topic, model_dir, 0.10, loaded)
        assert run.submitted == sum(run.stream.valid.values())  # nothing malformed got in
        flood.append(run.valid_per_cpu_s)
        walls.append((wall, run.valid_per_s))
    print(f"valid events per CPU-s clean {clean} flood {flood}; wall (clean, flood) {walls}")
    # The flood run is also complete and exact.
    stream, topics, config = run.stream, run.topics, run.config
    assert len(stream.malformed) > 200
    letters = dead_letters(await read_topic(broker.bootstrap_servers, topics.dead_letter))
    assert letter_values(letters) == sorted(stream.malformed)
    await assert_committed_all(
        broker.bootstrap_servers, config.group.group_id, topics, len(stream.records)
    )
    latest = latest_recommendations(await read_topic(broker.bootstrap_servers, topics.output))
    assert_end_state(model_dir, config, stream.valid, run.histories, latest, order=stream.ts)


def timestamp_stream(
    topics: Topics, now_ms: int, n_events: int, seed: int
) -> tuple[Stream, dict[str, int]]:
    """Events whose times go backwards (out of order, accepted), a share more than 24 h
    ahead of now (dead-lettered) and some within the bound (accepted)."""
    rng = np.random.default_rng(seed)
    stream = Stream()
    newest: dict[str, int] = {}
    day = 86_400_000
    for n in range(n_events):
        user = f"u{int(rng.integers(60))}"
        roll = rng.random()
        if roll < 0.05:
            ts = now_ms + day + int(rng.integers(60_000, 10 * day))  # beyond the bound
        elif roll < 0.15:
            ts = now_ms + int(rng.integers(0, day - 600_000))  # ahead, but within it
        else:
            ts = now_ms - int(rng.integers(0, 30 * day))  # any order in the past month
        item = f"i{int(rng.integers(120))}"
        if n % 2:
            event: PlaybackEvent | InteractionEvent = PlaybackEvent(user, item, ts, 150, 200)
            topic = topics.playback
        else:
            event = InteractionEvent(user, item, ts, "like")
            topic = topics.interaction
        value = encode_event(event)
        stream.records.append((topic, user.encode(), value))
        if ts > now_ms + day:
            stream.malformed[value] = ErrorKind.OUT_OF_RANGE.value
        else:
            stream.valid[user] += 1
            newest[user] = max(newest.get(user, 0), ts)
    return stream, newest


async def test_out_of_order_and_far_future_timestamps(broker, unique_topic, model_dir) -> None:
    topics = make_topics(broker, unique_topic)
    bootstrap = broker.bootstrap_servers
    config = worker_config(bootstrap, topics, group_id(), model_dir)
    assert config.topics.max_future_skew_ms == 86_400_000  # the documented default
    now_ms = int(time.time() * 1000)
    stream, newest = timestamp_stream(topics, now_ms, 2_000, seed=41)
    total = len(stream.records)
    store = open_history_store("memory://", 64)
    app = App(config, store=store)
    worker = await start_app(app)
    await produce(bootstrap, stream.records)
    await wait_until(lambda: app_committed(app) == total or worker.done(), 120, "commits")
    histories = await store.get(stream.users)
    app.stop()
    assert await asyncio.wait_for(worker, 30) == 0

    await assert_committed_all(bootstrap, config.group.group_id, topics, total)
    letters = dead_letters(await read_topic(bootstrap, topics.dead_letter))
    assert len(stream.malformed) > 50
    assert letter_values(letters) == sorted(stream.malformed)
    for letter in letters:
        assert letter.error_kind == ErrorKind.OUT_OF_RANGE.value
        assert "ts_ms " in letter.reason and "max_future_skew_ms=86400000" in letter.reason
        assert letter.topic in (topics.playback, topics.interaction)
        assert 0 <= letter.partition < PARTITIONS
    # Accepted events are kept, whatever their times (per partition in offset order).
    for user, history in histories.items():
        arrived = [
            r for r in stream.records if r[1] == user.encode() and r[2] not in stream.malformed
        ]
        assert len(history) == min(len(arrived), 64)
    latest = latest_recommendations(await read_topic(bootstrap, topics.output))
    for user, rec in latest.items():
        assert rec.last_event_ts_ms <= newest[user]
        assert rec.last_event_ts_ms >= int(histories[user].ts[-1])  # the step had the last
    assert_end_state(model_dir, config, stream.valid, histories, latest)
