"""The worker end to end against the real dev broker (issue 7, acceptance 1 and friends)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from streamrec.cache.history_backends import open_history_store
from streamrec.errors import BrokerError
from streamrec.tools.devbroker import free_port
from streamrec.worker.app import App
from tests.worker.harness import (
    PARTITIONS,
    Topics,
    assert_matches_recompute,
    committed_offsets,
    create_topics,
    dead_letters,
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

pytestmark = [pytest.mark.broker, pytest.mark.slow]


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny")


async def test_stream_with_malformed_records_end_state(broker, unique_topic, model_dir) -> None:
    """20,000 events for 500 users, 2% malformed: complete, dead-lettered, committed, exact."""
    topics = make_topics(broker, unique_topic)
    bootstrap = broker.bootstrap_servers
    group = f"g-{uuid.uuid4().hex[:8]}"
    config = worker_config(bootstrap, topics, group, model_dir)
    stream = make_stream(topics, 20_000, 500, 0.02, seed=7)
    store = open_history_store("memory://", 64)
    app = App(config, store=store)
    worker = asyncio.create_task(app.run())
    await wait_until(lambda: app.ready or worker.done(), 60, "the worker to be ready")
    port = app.http.port
    assert (await http_get(port, "/readyz"))[0] == 200

    await produce(bootstrap, stream.records)
    total = len(stream.records)
    inputs = [topics.playback, topics.interaction]
    ends = await end_offsets(bootstrap, inputs)
    assert sum(ends.values()) == total
    await wait_until(
        lambda: sum(app.stats().committed.values()) == total or worker.done(), 240, "commits"
    )
    status, health = await http_get(port, "/healthz")
    assert status == 200, health
    status, metrics = await http_get(port, "/metrics")
    text = metrics.decode()
    assert status == 200
    assert f'streamrec_events_consumed_total{{topic="{topics.playback}"}}' in text
    assert 'streamrec_model_backend{backend="eager_fallback"} 1.0' in text  # auto, no package
    assert app.metrics.sample("streamrec_dead_letters_total") == len(stream.malformed)
    assert app.metrics.sample("streamrec_recommendations_published_total") == app.stats().published
    app.stop()
    assert await asyncio.wait_for(worker, 30) == 0

    # Committed offsets (as the broker has them) are the end offsets.
    assert await committed_offsets(bootstrap, group, sorted(ends)) == ends
    # Every malformed record is dead-lettered once, with its reason and coordinates.
    letters = dead_letters(await read_topic(bootstrap, topics.dead_letter))
    assert sorted(letter.value for letter in letters) == sorted(stream.malformed)
    for letter in letters:
        assert letter.error_kind == stream.malformed[letter.value]
        assert letter.reason and letter.topic == topics.interaction
        assert 0 <= letter.partition < PARTITIONS and letter.offset >= 0
    # Every user's last recommendation covers all its events and equals the recompute.
    latest = latest_recommendations(await read_topic(bootstrap, topics.output))
    assert {u: r.version for u, r in latest.items()} == dict(stream.valid)
    histories = await store.get(stream.users)
    assert_matches_recompute(model_dir, config, histories, latest)


async def test_unequal_partition_counts_refuse_to_start(broker, unique_topic, model_dir) -> None:
    topics = make_topics(broker, unique_topic)
    other = unique_topic("interaction3")
    broker.create_topics({other: PARTITIONS - 1})
    config = worker_config(broker.bootstrap_servers, topics, "g-unequal", model_dir)
    config = type(config)(
        **{
            **config.__dict__,
            "topics": type(config.topics)(**{**config.topics.__dict__, "interaction": other}),
        }
    )
    app = App(config)
    with pytest.raises(BrokerError, match=rf"{topics.playback}.* has {PARTITIONS} .* has 3"):
        await asyncio.wait_for(app.run(), 60)


def _app_without_topics(broker, unique_topic, model_dir, tag: str, wait_s: float):
    """An App on four topic names the broker does not have (yet), waiting ``wait_s``."""
    topics = Topics(*(unique_topic(f"{s}-{tag}") for s in ("pb", "ia", "recs", "dlq")))
    config = worker_config(broker.bootstrap_servers, topics, f"g-{tag}", model_dir)
    kafka = type(config.kafka)(**{**config.kafka.__dict__, "topic_wait_s": wait_s})
    return App(type(config)(**{**config.__dict__, "kafka": kafka})), topics


async def test_a_missing_input_topic_is_an_error_after_the_topic_wait(
    broker, unique_topic, model_dir
) -> None:
    app, topics = _app_without_topics(broker, unique_topic, model_dir, "none", 1.0)
    started = asyncio.get_running_loop().time()
    with pytest.raises(
        BrokerError, match=rf"{topics.playback}.* does not exist .*topic_wait_s = 1 s"
    ):
        await asyncio.wait_for(app.run(), 60)
    assert asyncio.get_running_loop().time() - started >= 1.0


async def test_input_topics_created_while_the_worker_waits_are_served(
    broker, unique_topic, model_dir
) -> None:
    app, topics = _app_without_topics(broker, unique_topic, model_dir, "late", 30.0)
    worker = asyncio.create_task(app.run())
    await wait_until(lambda: app.input.connect_attempts >= 1, 30, "a connection")
    await asyncio.sleep(0.5)  # the worker is waiting for the topics now
    assert not worker.done() and not app.ready
    create_topics(broker, topics)
    await wait_until(lambda: app.ready or worker.done(), 60, "the worker to join")
    assert app.ready
    app.stop()
    assert await asyncio.wait_for(worker, 30) == 0


async def test_absent_broker_is_retried_not_ready(unique_topic, model_dir) -> None:
    topics = Topics("a", "b", "c", "d")
    config = worker_config(f"127.0.0.1:{free_port()}", topics, "g", model_dir)
    app = App(config)
    worker = asyncio.create_task(app.run())
    await wait_until(
        lambda: app.engine is not None and app.input.connect_attempts >= 2, 30, "retries"
    )
    port = app.http.port
    assert (await http_get(port, "/readyz"))[0] == 503
    assert (await http_get(port, "/healthz"))[0] == 200
    assert (await http_get(port, "/nope"))[0] == 404
    app.stop()
    assert await asyncio.wait_for(worker, 10) == 0
