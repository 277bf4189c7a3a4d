"""The output producer: recommendations and dead letters, each completed on the broker's ack.

One ``AIOKafkaProducer`` serves both topics. ``acks="all"`` because an offset is committed
only once its output is acknowledged, and an ack from a leader that then loses the record
would break "nothing lost". Records are keyed by ``user_id`` (recommendations) or by the
source record's key (dead letters) and carry a ``content-type`` header.

Recommendations go out through aiokafka's batch API: the records of one step are grouped
by output partition (the Java client's default partitioner, murmur2 of the key, so a
consumer sees every version of a user on one partition) and each group is appended to a
``BatchBuilder`` and sent as one batch with one acknowledgement. A step's batch is complete
when it is handed over, so it is closed first: aiokafka sends a closed batch with the next
request instead of holding it for ``linger_ms`` (5 ms of every recommendation's p50 on the
dev broker); batches of several steps still share a request while one is in flight.
``linger_ms`` now only batches dead letters, which go one by one. ``send`` per record cost
~25 µs of event-loop time in aiokafka's accumulator, as much as the model step of a user
on the GPU. Sends return as soon as the batch is queued; ``on_ack`` runs when the broker
acknowledged it. A send that finally fails (aiokafka has retried until its delivery
timeout) is reported through ``on_error``: the worker treats it as fatal, since the offsets
behind it can never complete and a restart re-reads them from the last commit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import murmur2

from streamrec.errors import BrokerError
from streamrec.schemas.records import DeadLetter
from streamrec.schemas.wire import CONTENT_TYPE_HEADER, WireFormat
from streamrec.worker.config import KafkaConfig, TopicsConfig

log = logging.getLogger(__name__)

_PARTITION_CACHE_KEYS = 1 << 18  # users whose output partition is remembered (~35 MB)
AckCallback = Callable[[], None]
BatchAckCallback = Callable[[Sequence[int]], None]
ErrorCallback = Callable[[BaseException], None]


class Publisher:
    def __init__(
        self,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        on_error: ErrorCallback,
        producer_factory: Callable[..., AIOKafkaProducer] = AIOKafkaProducer,
    ) -> None:
        self._topics = topics
        self._format = WireFormat.JSON if topics.output_format == "json" else WireFormat.MSGPACK
        self._headers = [(CONTENT_TYPE_HEADER, self._format.content_type.encode())]
        self._on_error = on_error
        kwargs: dict[str, Any] = {
            **kafka.client_kwargs(),
            "acks": "all",
            "linger_ms": kafka.producer_linger_ms,
            "max_batch_size": kafka.producer_max_batch_bytes,
            "enable_idempotence": kafka.producer_idempotence,
        }
        if kafka.producer_compression is not None:
            kwargs["compression_type"] = kafka.producer_compression
        self._producer = producer_factory(**kwargs)
        self._in_flight = 0
        self._partitions: list[int] = []
        self._partition_of: dict[bytes, int] = {}  # user key -> output partition
        self._idle = asyncio.Event()
        self._idle.set()
        self.sent = 0
        self.acked = 0
        self.failed = 0

    @property
    def output_format(self) -> WireFormat:
        return self._format

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    async def publish(
        self, records: Sequence[tuple[bytes, bytes]], on_ack: BatchAckCallback
    ) -> None:
        """Queue ``(key, value)`` recommendations; ``on_ack(indices)`` runs once per sent
        batch with the positions (in ``records``) that batch carried."""
        topic = self._topics.output
        partitions = sorted(await self._producer.partitions_for(topic))
        if not partitions:
            raise BrokerError(f"output topic {topic!r} has no partitions")
        if partitions != self._partitions:  # first use, or the topic grew: hash anew
            self._partitions = partitions
            self._partition_of.clear()
        groups: dict[int, list[int]] = {}
        n = len(partitions)
        known = self._partition_of
        for i, (key, _) in enumerate(records):
            partition = known.get(key)
            if partition is None:  # murmur2 is pure Python in aiokafka: ~3 µs a key
                if len(known) >= _PARTITION_CACHE_KEYS:
                    known.clear()
                partition = known[key] = partitions[(murmur2(key) & 0x7FFFFFFF) % n]
            groups.setdefault(partition, []).append(i)
        for partition, members in groups.items():
            batch = self._producer.create_batch()
            carried: list[int] = []
            for i in members:
                key, value = records[i]
                added = batch.append(key=key, value=value, timestamp=None, headers=self._headers)
                if added is None:  # full: send what it holds; an empty batch takes any
                    await self._send_batch(batch, topic, partition, carried, on_ack)
                    batch, carried = self._producer.create_batch(), []
                    batch.append(key=key, value=value, timestamp=None, headers=self._headers)
                carried.append(i)
            await self._send_batch(batch, topic, partition, carried, on_ack)

    async def _send_batch(
        self,
        batch: Any,
        topic: str,
        partition: int,
        carried: list[int],
        on_ack: BatchAckCallback,
    ) -> None:
        batch.close()  # complete: aiokafka sends a closed batch without lingering
        try:
            future = await self._producer.send_batch(batch, topic, partition=partition)
        except Exception as exc:  # aiokafka raises KafkaError subclasses and others
            raise BrokerError(f"producing to {topic!r} failed: {exc!r}") from exc
        self._track(future, topic, len(carried), lambda: on_ack(carried))

    async def dead_letter(self, letter: DeadLetter, on_ack: AckCallback) -> None:
        """Queue one dead letter (in JSON its raw value and key are base64 strings)."""
        await self._send(
            self._topics.dead_letter,
            letter.to_bytes(self._format),
            letter.key,
            self._headers,
            on_ack,
        )

    async def flush(self, timeout_s: float) -> bool:
        """Send everything buffered and wait for the acks; False if ``timeout_s`` ran out."""
        try:
            await asyncio.wait_for(self._flush(), timeout_s)
        except TimeoutError:
            log.warning("producer flush timed out", extra={"in_flight": self._in_flight})
            return False
        return True

    async def _flush(self) -> None:
        await self._producer.flush()
        await self._idle.wait()  # ack callbacks have run, not just the futures resolved

    async def _send(
        self,
        topic: str,
        value: bytes,
        key: bytes | None,
        headers: list[tuple[str, bytes]],
        on_ack: AckCallback,
    ) -> None:
        try:
            future = await self._producer.send(topic, value, key=key, headers=headers)
        except Exception as exc:  # aiokafka raises KafkaError subclasses and others
            raise BrokerError(f"producing to {topic!r} failed: {exc!r}") from exc
        self._track(future, topic, 1, on_ack)

    def _track(
        self, future: asyncio.Future[Any], topic: str, records: int, on_ack: AckCallback
    ) -> None:
        self.sent += records
        self._in_flight += 1
        self._idle.clear()

        def done(fut: asyncio.Future[Any]) -> None:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
            if fut.cancelled():
                self.failed += records
                self._on_error(BrokerError(f"send to {topic!r} was cancelled"))
                return
            exc = fut.exception()
            if exc is not None:
                self.failed += records
                self._on_error(BrokerError(f"send to {topic!r} failed: {exc!r}"))
                return
            self.acked += records
            on_ack()

        future.add_done_callback(done)
