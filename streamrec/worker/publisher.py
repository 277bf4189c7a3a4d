"""The output producer: recommendations and dead letters, each completed on the broker's ack.

One ``AIOKafkaProducer`` serves both topics. ``acks="all"`` because an offset is committed
only once its output is acknowledged, and an ack from a leader that then loses the record
would break "nothing lost". Records are keyed by ``user_id`` (recommendations) or by the
source record's key (dead letters) and carry a ``content-type`` header. Batching
(``linger_ms``, ``max_batch_size``) trades a few milliseconds for far fewer requests.

Sends return as soon as the record is in the producer's buffer; ``on_ack`` runs when the
broker acknowledged it. A send that finally fails (aiokafka has retried until its delivery
timeout) is reported through ``on_error``: the worker treats it as fatal, since the offsets
behind it can never complete and a restart re-reads them from the last commit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaProducer

from streamrec.errors import BrokerError
from streamrec.schemas.records import DeadLetter, Recommendation
from streamrec.schemas.wire import CONTENT_TYPE_HEADER, WireFormat
from streamrec.worker.config import KafkaConfig, TopicsConfig

log = logging.getLogger(__name__)

AckCallback = Callable[[], None]
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

    async def publish(self, rec: Recommendation, on_ack: AckCallback) -> None:
        """Queue one recommendation (key = user id); ``on_ack`` once the broker has it."""
        await self._send(
            self._topics.output,
            rec.to_bytes(self._format),
            rec.user_id.encode(),
            self._headers,
            on_ack,
        )

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
        self.sent += 1
        self._in_flight += 1
        self._idle.clear()

        def done(fut: asyncio.Future[Any]) -> None:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
            if fut.cancelled():
                self.failed += 1
                self._on_error(BrokerError(f"send to {topic!r} was cancelled"))
                return
            exc = fut.exception()
            if exc is not None:
                self.failed += 1
                self._on_error(BrokerError(f"send to {topic!r} failed: {exc!r}"))
                return
            self.acked += 1
            on_ack()

        future.add_done_callback(done)
