"""Crash, SIGTERM and rebalance against the real dev broker and the real Redis (issue 7,
acceptance 2-4). Workers share a Redis history store under a unique key prefix."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from streamrec.cache.history_backends import open_history_store
from streamrec.schemas.codec import RawRecord, decode_batch
from streamrec.schemas.events import EventKind
from streamrec.tools.cli import render_toml
from streamrec.worker.app import App
from streamrec.worker.config import WorkerConfig
from tests.worker.harness import (
    Stream,
    Topics,
    assert_matches_recompute,
    committed_offsets,
    end_offsets,
    latest_recommendations,
    make_stream,
    make_topics,
    produce,
    read_topic,
    tiny_model_dir,
    wait_until,
    worker_config,
)

pytestmark = [pytest.mark.broker, pytest.mark.redis, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def store_url(redis_url: str):
    url = f"{redis_url}?prefix=streamrec-test-{uuid.uuid4().hex[:10]}"
    yield url
    store = open_history_store(url, 64)
    asyncio.run(_erase(store))


async def _erase(store) -> None:
    await store.delete([f"u{n}" for n in range(500)])  # every user make_stream may write
    await store.close()


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Kill and wait: a child left unwaited warns in whichever later test collects it."""
    proc.kill()
    proc.wait(30)


def spawn(config: WorkerConfig, tmp_path: Path, name: str) -> subprocess.Popen[bytes]:
    file = tmp_path / f"{name}.toml"
    file.write_text(render_toml(config.to_dict(mask_secrets=False)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMREC_")}
    env["PYTHONPATH"] = str(REPO)
    with (tmp_path / f"{name}.log").open("wb") as log:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "streamrec.tools.cli", "run", "--config", str(file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )


async def committed_total(bootstrap: str, group: str, topics: Topics) -> int:
    tps = [(t, p) for t in (topics.playback, topics.interaction) for p in range(4)]
    return sum((await committed_offsets(bootstrap, group, tps)).values())


async def check_end_state(
    bootstrap: str, topics: Topics, stream: Stream, store_url: str, config, model_dir: Path
) -> None:
    """No event lost or duplicated in any history; last lists equal the recompute."""
    store = open_history_store(store_url, 64)
    try:
        histories = await store.get(stream.users)
    finally:
        await store.close()
    for user, count in stream.valid.items():
        assert histories[user].total_appended == count, user
        assert len(histories[user]) == min(count, 64), user
    latest = latest_recommendations(await read_topic(bootstrap, topics.output))
    assert {u: r.version for u, r in latest.items()} == dict(stream.valid)
    assert_matches_recompute(model_dir, config, histories, latest)


async def test_sigkill_then_successor_loses_and_duplicates_nothing(
    broker, unique_topic, model_dir, store_url, tmp_path
) -> None:
    topics = make_topics(broker, unique_topic)
    bootstrap = broker.bootstrap_servers
    group = f"g-{uuid.uuid4().hex[:8]}"
    config = worker_config(bootstrap, topics, group, model_dir, store_url)
    stream = make_stream(topics, 6_000, 200, 0.02, seed=11)
    first = spawn(config, tmp_path, "first")
    lead, rest = stream.records[:300], stream.records[300:]
    try:
        # The lead first, until the worker commits: with the whole stream paced from the
        # start, a worker that took longer to start than the stream lasts (4 s) consumed
        # and committed all of it at once, and the kill was no longer mid-stream.
        await produce(bootstrap, lead)
        await wait_until(
            lambda: committed_total(bootstrap, group, topics), 90, "the first worker's commits"
        )
        producer = asyncio.create_task(produce(bootstrap, rest, rate=1_500))
        await asyncio.sleep(1.0)  # the worker is consuming the paced rest (~3.8 s long)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        # Killed mid-stream: work is left for the successor. (Checked now, with nobody
        # committing: after the producer's end the successor may already have caught up.)
        assert await committed_total(bootstrap, group, topics) < len(stream.records)
        second = spawn(config, tmp_path, "second")
        try:
            await producer
            ends = await end_offsets(bootstrap, [topics.playback, topics.interaction])
            await wait_until(
                lambda: _committed_is(bootstrap, group, ends), 120, "the successor's commits"
            )
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
        finally:
            _reap(second)
    finally:
        _reap(first)
    await check_end_state(bootstrap, topics, stream, store_url, config, model_dir)


async def _committed_is(bootstrap: str, group: str, ends: dict[tuple[str, int], int]) -> bool:
    return await committed_offsets(bootstrap, group, sorted(ends)) == ends


async def test_sigterm_drains_and_commits_exactly_what_was_processed(
    broker, unique_topic, model_dir, store_url, tmp_path
) -> None:
    topics = make_topics(broker, unique_topic)
    bootstrap = broker.bootstrap_servers
    group = f"g-{uuid.uuid4().hex[:8]}"
    drain = 10.0
    config = worker_config(bootstrap, topics, group, model_dir, store_url, drain_timeout_s=drain)
    stream = make_stream(topics, 5_000, 150, 0.0, seed=13)
    worker = spawn(config, tmp_path, "worker")
    try:
        await produce(bootstrap, stream.records[:500])
        await wait_until(lambda: committed_total(bootstrap, group, topics), 90, "first commits")
        producer = asyncio.create_task(produce(bootstrap, stream.records[500:], rate=1_000))
        await asyncio.sleep(1.0)
        started = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        status = await asyncio.to_thread(worker.wait, drain + 15)
        elapsed = time.monotonic() - started
        await producer
    finally:
        _reap(worker)
    assert status == 0
    assert elapsed < drain + 5
    inputs = [topics.playback, topics.interaction]
    ends = await end_offsets(bootstrap, inputs)
    committed = await committed_offsets(bootstrap, group, sorted(ends))
    assert sum(committed.values()) < sum(ends.values())  # stopped mid-stream
    # committed == processed: per user, the events below the committed offsets are exactly
    # those in its history, and its last recommendation covers exactly those.
    below: dict[str, int] = {}
    for topic, kind in (
        (topics.playback, EventKind.PLAYBACK),
        (topics.interaction, EventKind.INTERACTION),
    ):
        raw = [
            RawRecord(value, (), topic, partition, offset)
            for partition, offset, value in await read_topic(bootstrap, topic)
        ]
        for item in decode_batch(raw, kind, require_key=False).events:
            if item.offset < committed[(topic, item.partition)]:
                below[item.event.user_id] = below.get(item.event.user_id, 0) + 1
    store = open_history_store(store_url, 64)
    try:
        histories = await store.get(stream.users)
    finally:
        await store.close()
    assert {u: h.total_appended for u, h in histories.items() if h.total_appended} == below
    latest = latest_recommendations(await read_topic(bootstrap, topics.output))
    assert {u: r.version for u, r in latest.items()} == below


async def test_member_joins_and_leaves_mid_stream(
    broker, unique_topic, model_dir, store_url
) -> None:
    topics = make_topics(broker, unique_topic)
    bootstrap = broker.bootstrap_servers
    group = f"g-{uuid.uuid4().hex[:8]}"
    config = worker_config(bootstrap, topics, group, model_dir, store_url)
    stream = make_stream(topics, 8_000, 300, 0.01, seed=17)
    apps = [App(config), App(config)]
    runs = [asyncio.create_task(app.run()) for app in apps]
    await wait_until(lambda: all(a.ready for a in apps), 60, "two members with partitions")
    producer = asyncio.create_task(produce(bootstrap, stream.records, rate=1_000))
    await asyncio.sleep(1.5)
    third = App(config)
    third_run = asyncio.create_task(third.run())
    await wait_until(lambda: third.stats().published > 0, 60, "the third member to publish")
    assert all(len(a.owned) < 8 for a in apps)
    await asyncio.sleep(1.5)
    third.stop()  # leaves mid-stream
    assert await asyncio.wait_for(third_run, 30) == 0
    await producer
    ends = await end_offsets(bootstrap, [topics.playback, topics.interaction])
    await wait_until(lambda: _committed_is(bootstrap, group, ends), 120, "all commits")
    await wait_until(
        lambda: apps[0].owned | apps[1].owned == set(ends) and not apps[0].owned & apps[1].owned,
        60,
        "the group to settle",
    )
    assert third.stats().rebalances >= 1 and all(a.stats().rebalances >= 2 for a in apps)
    cached = [a.engine.cached_users() for a in apps]
    assert not cached[0] & cached[1]
    for app, users in zip(apps, cached):
        partitions = {p for _, p in app.owned}
        assert all(_partition_of(stream, user) in partitions for user in users)
    for app in apps:
        app.stop()
    assert await asyncio.gather(*runs) == [0, 0]
    await check_end_state(bootstrap, topics, stream, store_url, config, model_dir)


def _partition_of(stream: Stream, user: str) -> int:
    """The partition Kafka's default partitioner gave the user's records."""
    from aiokafka.partitioner import DefaultPartitioner

    return DefaultPartitioner()(user.encode(), list(range(4)), list(range(4)))
