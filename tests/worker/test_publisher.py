"""Batched produce against the real dev broker: every record acknowledged once, on the
partition Kafka's default partitioner would have chosen for its key."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka.partitioner import murmur2

from streamrec.worker.config import KafkaConfig, TopicsConfig
from streamrec.worker.publisher import Publisher
from tests.worker.harness import read_topic

pytestmark = [pytest.mark.broker]
PARTITIONS = 4


async def test_batches_land_on_the_key_partition_and_ack_every_record(broker, unique_topic) -> None:
    topics = TopicsConfig(output=unique_topic("recs"), dead_letter=unique_topic("dlq"))
    broker.create_topics({topics.output: PARTITIONS, topics.dead_letter: 1})
    errors: list[BaseException] = []
    publisher = Publisher(
        KafkaConfig(bootstrap_servers=broker.bootstrap_servers), topics, errors.append
    )
    await publisher.start()
    acked: list[int] = []
    try:
        first = [(f"u{n}".encode(), f"value-{n}".encode()) for n in range(300)]
        await publisher.publish(first, acked.extend)
        second = [(f"u{n}".encode(), f"again-{n}".encode()) for n in range(0, 300, 3)]
        await publisher.publish(second, lambda done: acked.extend(300 + i for i in done))
        assert await publisher.flush(30)
    finally:
        await publisher.stop()
    assert not errors
    assert sorted(acked) == list(range(400))  # each record once, in some batch
    assert publisher.acked == publisher.sent == 400
    landed = await read_topic(broker.bootstrap_servers, topics.output)
    assert len(landed) == 400
    for partition, _, value in landed:
        n = int(value.split(b"-")[1])
        assert partition == (murmur2(f"u{n}".encode()) & 0x7FFFFFFF) % PARTITIONS
    # One user's records keep their order on its partition.
    u0 = [value for _, _, value in sorted(landed) if value.endswith(b"-0")]
    assert u0 == [b"value-0", b"again-0"]


async def test_full_batches_are_sent_and_a_big_record_goes_alone(broker, unique_topic) -> None:
    topics = TopicsConfig(output=unique_topic("recs"), dead_letter=unique_topic("dlq"))
    broker.create_topics({topics.output: 1, topics.dead_letter: 1})
    kafka = KafkaConfig(bootstrap_servers=broker.bootstrap_servers, producer_max_batch_bytes=1024)
    publisher = Publisher(kafka, topics, lambda exc: None)
    await publisher.start()
    batches: list[list[int]] = []
    try:
        records = [(b"u1", b"x" * 300) for _ in range(7)] + [(b"u2", b"y" * 4096)]
        await publisher.publish(records, lambda done: batches.append(list(done)))
        assert await publisher.flush(30)
    finally:
        await publisher.stop()
    assert sorted(i for b in batches for i in b) == list(range(8))
    assert len(batches) >= 3 and [7] in batches  # three 300-byte records a batch; 4 KB alone
    landed = await read_topic(broker.bootstrap_servers, topics.output)
    assert [len(value) for _, _, value in landed] == [300] * 7 + [4096]


async def test_a_steps_batch_goes_at_once_whatever_the_linger(broker, unique_topic) -> None:
    """A step's output is complete when handed over: its batches are closed, so aiokafka
    sends them with the next request instead of holding them for ``linger_ms`` (here 2 s,
    against acknowledgements in milliseconds)."""
    topics = TopicsConfig(output=unique_topic("recs"), dead_letter=unique_topic("dlq"))
    broker.create_topics({topics.output: PARTITIONS, topics.dead_letter: 1})
    kafka = KafkaConfig(bootstrap_servers=broker.bootstrap_servers, producer_linger_ms=2_000)
    publisher = Publisher(kafka, topics, lambda exc: None)
    await publisher.start()
    try:
        await publisher.publish([(b"warm", b"up")], lambda done: None)  # metadata, connection
        assert await publisher.flush(30)
        acked = asyncio.Event()
        started = time.monotonic()
        await publisher.publish(
            [(f"u{n}".encode(), b"v") for n in range(20)], lambda done: acked.set()
        )
        await asyncio.wait_for(acked.wait(), 10)
        assert time.monotonic() - started < 1.0
    finally:
        await publisher.stop()
