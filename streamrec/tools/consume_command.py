"""``streamrec consume``: print a topic's records as JSON lines (recommendations by default).

For looking at what the worker wrote: every partition is read from the beginning without
a consumer group (nothing is committed, nothing is taken from the worker), each value is
decoded by its ``content-type`` header (or sniffed) and printed as one JSON object; bytes
(a dead letter's original value in msgpack) become base64 strings, as in the JSON form
of a dead letter. It stops after ``--max`` records or after ``--idle-timeout`` seconds
without a new one.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
import time
from dataclasses import dataclass
from typing import TextIO

import orjson

from streamrec.errors import BrokerError, ConfigError
from streamrec.schemas.wire import DECODE_ERRORS, detect_format, loads
from streamrec.worker.config import KafkaConfig

_METADATA_WAIT_S = 0.2


@dataclass(frozen=True)
class ConsumeStats:
    printed: int
    undecodable: int


def add_consume_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topic", help="topic to read (default: topics.output of the config)")
    parser.add_argument("--max", type=int, default=0, help="stop after this many (0 = no limit)")
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="stop after this long without a record (0 = never)",
    )


def _jsonable(value: object) -> object:
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def render_value(value: bytes | None, headers: tuple[tuple[str, bytes], ...]) -> bytes | None:
    """One record value as a JSON line, or None when it is not msgpack/JSON."""
    if not value:
        return None
    try:
        fmt = detect_format(value, headers)
        obj = loads(value, fmt)
    except (*DECODE_ERRORS, ValueError):
        return None
    return orjson.dumps(_jsonable(obj))


async def consume(
    kafka: KafkaConfig, topic: str, *, max_records: int, idle_timeout_s: float, out: TextIO
) -> ConsumeStats:
    """Print ``topic`` from its beginning; raises BrokerError if Kafka or the topic is absent."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.errors import KafkaError
    from aiokafka.structs import TopicPartition

    if max_records < 0 or idle_timeout_s < 0:
        raise ConfigError(f"--max {max_records} / --idle-timeout {idle_timeout_s}: must be >= 0")
    consumer = AIOKafkaConsumer(**kafka.client_kwargs(), enable_auto_commit=False)
    try:
        await consumer.start()
    except KafkaError as exc:
        await consumer.stop()
        raise BrokerError(f"cannot reach Kafka at {kafka.bootstrap_servers!r}: {exc}") from exc
    printed = undecodable = 0
    try:
        partitions = await _partitions(consumer, topic)
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        last = time.monotonic()
        while not max_records or printed < max_records:
            batches = await consumer.getmany(timeout_ms=200)
            if not batches:
                if idle_timeout_s and time.monotonic() - last > idle_timeout_s:
                    break
                continue
            last = time.monotonic()
            for records in batches.values():
                for record in records:
                    line = render_value(record.value, tuple(record.headers))
                    if line is None:
                        undecodable += 1
                        line = orjson.dumps({"undecodable": _jsonable(record.value or b"")})
                    out.write(line.decode() + "\n")
                    printed += 1
                    if max_records and printed >= max_records:
                        break
                if max_records and printed >= max_records:
                    break
            out.flush()
    except KafkaError as exc:
        raise BrokerError(f"reading {topic!r} at {kafka.bootstrap_servers!r}: {exc}") from exc
    finally:
        await consumer.stop()
    return ConsumeStats(printed, undecodable)


async def _partitions(consumer: object, topic: str) -> list[int]:
    for _ in range(10):
        found = consumer.partitions_for_topic(topic)  # type: ignore[attr-defined]
        if found:
            return sorted(found)
        await consumer.topics()  # type: ignore[attr-defined]  # refreshes the metadata
        await asyncio.sleep(_METADATA_WAIT_S)
    raise BrokerError(f"topic {topic!r} does not exist")


def run_consume(args: argparse.Namespace, kafka: KafkaConfig, default_topic: str) -> int:
    topic = args.topic or default_topic
    stats = asyncio.run(
        consume(
            kafka,
            topic,
            max_records=args.max,
            idle_timeout_s=args.idle_timeout,
            out=sys.stdout,
        )
    )
    print(
        f"streamrec consume: {stats.printed} records from {topic!r}"
        + (f" ({stats.undecodable} not msgpack/JSON)" if stats.undecodable else ""),
        file=sys.stderr,
    )
    return 0
