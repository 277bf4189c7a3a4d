"""The Kafka side of the input: one aiokafka consumer on both input topics.

Why these settings:

- **One consumer, range assignor.** The playback and interaction topics are keyed by
  ``user_id`` and have equal partition counts, and the range assignor hands partition
  ``p`` of both topics to the same member, so every user's events meet in one worker.
  ``check_copartitioned`` refuses to start otherwise: with unequal counts a user's two
  streams would land on different workers and each would hold half a history.
- **Manual commits.** ``enable_auto_commit=False``; the worker commits only positions
  whose records are done (``OffsetTracker``). ``auto_offset_reset="earliest"``: a new
  group must not skip the events that are already waiting.
- **Start-up retries.** The broker may come up after the worker (a pod restart, the
  demo); ``start`` backs off and retries until it connects or the worker is stopped, and
  for up to ``kafka.topic_wait_s`` after the first connection while an input topic is
  missing (a topic job running beside the worker; a fresh consumer reads fresh metadata).

This class adapts aiokafka to plain tuples (its records pass through unchanged: they are
``ConsumedRecord``s); what happens to the records is the ``App``'s business.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from streamrec.backoff import Backoff
from streamrec.errors import BrokerError
from streamrec.schemas.codec import ConsumedRecord
from streamrec.worker.config import GroupConfig, KafkaConfig, TopicsConfig
from streamrec.worker.rebalance import RebalanceListener

log = logging.getLogger(__name__)
_TOPIC_POLL_S = 0.25  # between connections while an input topic is missing

TP = tuple[str, int]


class KafkaInput:
    def __init__(
        self,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        group: GroupConfig,
        listener: RebalanceListener,
        consumer_factory: Callable[..., AIOKafkaConsumer] = AIOKafkaConsumer,
    ) -> None:
        self._kafka = kafka
        self._topics = topics
        self._group = group
        self._listener = listener
        self._factory = consumer_factory
        self._consumer: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self.connect_attempts = 0

    def _new_consumer(self) -> AIOKafkaConsumer:
        kwargs: dict[str, Any] = {
            **self._kafka.consumer_kwargs(),
            "group_id": self._group.group_id,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "partition_assignment_strategy": (RangePartitionAssignor,),
        }
        if self._group.group_instance_id is not None:
            kwargs["group_instance_id"] = self._group.group_instance_id
        return self._factory(**kwargs)

    @property
    def consumer(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise BrokerError("the Kafka consumer is not started")
        return self._consumer

    async def start(self, stopping: asyncio.Event) -> bool:
        """Connect (retrying with backoff while the broker is absent), check the topics,
        subscribe. False if ``stopping`` was set before a connection was made."""
        backoff = Backoff(0.1, self._kafka.connect_retry_max_s)
        topics_by: float | None = None  # deadline for missing input topics
        while not stopping.is_set():
            self.connect_attempts += 1
            consumer = self._new_consumer()
            try:
                await consumer.start()
            except KafkaError as exc:
                await consumer.stop()
                delay = backoff.next_delay()
                log.warning(
                    "kafka not reachable, retrying",
                    extra={
                        "bootstrap_servers": self._kafka.bootstrap_servers,
                        "retry_in_s": round(delay, 2),
                        "error": repr(exc),
                    },
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), delay)
                continue
            self._consumer = consumer
            try:
                present = await consumer.topics()
                missing = [t for t in self._topics.input_topics() if t not in present]
                topics_by = topics_by or time.monotonic() + self._kafka.topic_wait_s
                if not missing or time.monotonic() >= topics_by:
                    await self.check_copartitioned()  # raises for a topic still missing
            except BaseException:
                await self.stop()
                raise
            if missing and time.monotonic() < topics_by:
                log.warning("input topics missing, waiting", extra={"topics": missing})
                await self.stop()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), _TOPIC_POLL_S)
                continue
            consumer.subscribe(list(self._topics.input_topics()), listener=self._listener)
            return True
        return False

    async def cluster_id(self) -> str:
        """The id of the cluster behind the bootstrap address, asked afresh (Metadata v2+,
        through the admin client's ``describe_cluster``; on a cluster with many topics the
        answer carries their metadata too: a few kB per call, once per batch and commit).

        The worker scopes its offset watermarks by it (``LogScopedStore``): a new id means
        a new log whose offsets restart at 0. Raises aiokafka's errors while unreachable.
        """
        if self._admin is None:
            admin = AIOKafkaAdminClient(**self._kafka.client_kwargs())
            await admin.start()
            self._admin = admin
        found = (await self._admin.describe_cluster()).get("cluster_id")
        return str(found) if found else ""

    async def check_copartitioned(self) -> dict[str, int]:
        """Partition count per input topic; BrokerError unless both exist and are equal."""
        consumer = self.consumer
        await consumer.topics()  # a metadata request for every topic (creates none)
        counts: dict[str, int] = {}
        for topic in self._topics.input_topics():
            partitions = consumer.partitions_for_topic(topic)
            if not partitions:
                raise BrokerError(
                    f"input topic {topic!r} does not exist at {self._kafka.bootstrap_servers!r} "
                    f"(waited kafka.topic_wait_s = {self._kafka.topic_wait_s:g} s)"
                )
            counts[topic] = len(partitions)
        playback, interaction = self._topics.input_topics()
        if counts[playback] != counts[interaction]:
            raise BrokerError(
                f"input topics must be co-partitioned: {playback!r} has {counts[playback]} "
                f"partitions but {interaction!r} has {counts[interaction]}"
            )
        return counts

    async def fetch(self, timeout_ms: int) -> dict[TP, list[ConsumedRecord]]:
        """Whatever the consumer has buffered (waiting up to ``timeout_ms``), per partition."""
        batches = await self.consumer.getmany(timeout_ms=timeout_ms)
        return {(tp.topic, tp.partition): records for tp, records in batches.items()}

    def assignment(self) -> set[TP]:
        if self._consumer is None:
            return set()
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def pause(self, tps: Iterable[TP]) -> None:
        wanted = [TopicPartition(t, p) for t, p in tps]
        if wanted and self._consumer is not None:
            self._consumer.pause(*wanted)

    def resume(self, tps: Iterable[TP]) -> None:
        wanted = [TopicPartition(t, p) for t, p in tps]
        if wanted and self._consumer is not None:
            self._consumer.resume(*wanted)

    async def commit(self, positions: Mapping[TP, int]) -> None:
        """Commit ``{tp: next offset to read}``; raises aiokafka's errors unchanged."""
        offsets = {
            TopicPartition(t, p): OffsetAndMetadata(pos, "") for (t, p), pos in positions.items()
        }
        await self.consumer.commit(offsets)

    def lags(self, positions: Mapping[TP, int]) -> dict[TP, int]:
        """High watermark minus ``positions`` for partitions whose watermark is known."""
        out: dict[TP, int] = {}
        if self._consumer is None:
            return out
        for (topic, partition), pos in positions.items():
            high = self._consumer.highwater(TopicPartition(topic, partition))
            if high is not None:
                out[(topic, partition)] = high - pos
        return out

    async def stop(self) -> None:
        consumer, self._consumer = self._consumer, None
        admin, self._admin = self._admin, None
        if consumer is not None:
            await _stop_tolerating_own_cancel(consumer)
        if admin is not None:
            await admin.close()


async def _stop_tolerating_own_cancel(consumer: AIOKafkaConsumer) -> None:
    """``consumer.stop()``, where aiokafka's fetcher awaits the fetch tasks it has just
    cancelled: one that was backing off after a lost broker re-raises its CancelledError
    into the caller (seen with a restarted broker: the worker's exit became a cancelled
    task). That error is swallowed unless this task itself is being cancelled."""
    try:
        await consumer.stop()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("consumer stop: aiokafka re-raised its own fetch task's cancellation")
