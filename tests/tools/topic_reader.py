"""Reading a topic back in the tools' tests (a plain consumer, no group)."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord

from streamrec.schemas.codec import RawRecord


async def consume(
    bootstrap: str, topic: str, count: int, timeout_s: float = 10.0
) -> list[ConsumerRecord[bytes, bytes]]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    records: list[ConsumerRecord[bytes, bytes]] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(records) < count and loop.time() < deadline:
            batches = await consumer.getmany(timeout_ms=200)
            for batch in batches.values():
                records.extend(batch)
    finally:
        await consumer.stop()
    return records


def as_raw(record: ConsumerRecord[bytes, bytes]) -> RawRecord:
    return RawRecord(
        value=record.value,
        headers=tuple(record.headers),
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key,
    )
