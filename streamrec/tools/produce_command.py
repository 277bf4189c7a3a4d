"""``streamrec produce``: JSON lines in, validated events on a topic out.

Lines are validated with the same codec the worker decodes with, so whatever this
command accepts the worker accepts too. By default it is all or nothing: the whole input
is validated first and, if any line is invalid, every invalid line is reported (with its
line number) and nothing is sent, so the fixed file can simply be sent again.
``skip_invalid`` streams instead: valid lines go out as they arrive (a pipe from another
process) and invalid ones are reported and skipped. ``dry_run`` validates and sends
nothing. Records are keyed by ``user_id`` (the worker dead-letters any other key:
co-partitioning depends on it) and carry a ``content-type`` header. The producer uses
``acks=all`` without idempotence: the dev broker does not implement InitProducerId.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import IO, Final

from streamrec.errors import BrokerError, ConfigError, SchemaError
from streamrec.schemas.codec import decode_event, encode_event
from streamrec.schemas.events import EventKind
from streamrec.schemas.wire import CONTENT_TYPE_HEADER, WireFormat
from streamrec.worker.config import KafkaConfig, TopicsConfig

_FLUSH_EVERY: Final = 1_000  # await delivery reports in chunks to bound memory


@dataclass(frozen=True)
class OutgoingRecord:
    """A validated line, ready to send."""

    line_no: int
    key: bytes
    value: bytes


@dataclass(frozen=True)
class LineError:
    line_no: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line_no}: {self.reason}"


@dataclass
class ProduceStats:
    """What one ``produce`` run did; ``invalid`` lines were reported and not sent."""

    valid: int = 0
    sent: int = 0
    blank: int = 0
    errors: list[LineError] = field(default_factory=list)

    @property
    def invalid(self) -> int:
        return len(self.errors)


def kind_for_topic(topic: str, topics: TopicsConfig, explicit: str | None = None) -> EventKind:
    """The event schema of ``topic``: ``explicit`` if given, else by the configured names."""
    if explicit is not None:
        try:
            return EventKind(explicit)
        except ValueError:
            kinds = [k.value for k in EventKind]
            raise ConfigError(f"--kind {explicit!r}: expected one of {kinds}") from None
    if topic == topics.playback:
        return EventKind.PLAYBACK
    if topic == topics.interaction:
        return EventKind.INTERACTION
    raise ConfigError(
        f"topic {topic!r} is neither topics.playback ({topics.playback!r}) nor "
        f"topics.interaction ({topics.interaction!r}); pass --kind playback|interaction"
    )


def prepare_line(
    line: str | bytes, line_no: int, kind: EventKind, fmt: WireFormat
) -> OutgoingRecord | LineError | None:
    """Validate one JSON line and encode it for the wire, keyed by its user_id; None for a
    blank line."""
    data = line.encode() if isinstance(line, str) else line
    if not data.strip():
        return None
    try:
        event = decode_event(data.strip(), kind, WireFormat.JSON)
    except SchemaError as exc:
        return LineError(line_no, str(exc))
    return OutgoingRecord(line_no, event.user_id.encode(), encode_event(event, fmt))


async def _iter_lines(stream: IO[bytes]) -> AsyncIterator[bytes]:
    """Lines of ``stream`` without blocking the loop on a pipe or a terminal.

    A regular file never blocks for long, so it is read directly; anything else (a pipe
    fed by another process) is read on a helper thread, one line at a time, so records
    go out as they arrive.
    """
    try:
        regular = stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (OSError, ValueError):  # io.BytesIO and friends have no file descriptor
        regular = True
    if regular:
        for line in stream:
            yield line
        return
    while line := await asyncio.to_thread(stream.readline):
        yield line


async def produce_stream(
    stream: IO[bytes],
    *,
    topic: str,
    kind: EventKind,
    kafka: KafkaConfig,
    fmt: WireFormat = WireFormat.MSGPACK,
    skip_invalid: bool = False,
    dry_run: bool = False,
) -> ProduceStats:
    """Validate ``stream`` and send it to ``topic``: all lines or none unless
    ``skip_invalid``; nothing with ``dry_run``. Raises BrokerError if Kafka is unreachable."""
    stats = ProduceStats()
    if dry_run or not skip_invalid:
        ready: list[OutgoingRecord] = []
        async for prepared in _prepared(stream, kind, fmt, stats):
            ready.append(prepared)
        if dry_run or stats.invalid:
            return stats
        return await _send(_from_list(ready), topic, kafka, fmt, stats)
    return await _send(_prepared(stream, kind, fmt, stats), topic, kafka, fmt, stats)


async def _prepared(
    stream: IO[bytes], kind: EventKind, fmt: WireFormat, stats: ProduceStats
) -> AsyncIterator[OutgoingRecord]:
    """The valid lines of ``stream``; blank and invalid ones are counted in ``stats``."""
    line_no = 0
    async for line in _iter_lines(stream):
        line_no += 1
        prepared = prepare_line(line, line_no, kind, fmt)
        if prepared is None:
            stats.blank += 1
        elif isinstance(prepared, LineError):
            stats.errors.append(prepared)
        else:
            stats.valid += 1
            yield prepared


async def _from_list(records: list[OutgoingRecord]) -> AsyncIterator[OutgoingRecord]:
    for record in records:
        yield record


async def _send(
    records: AsyncIterator[OutgoingRecord],
    topic: str,
    kafka: KafkaConfig,
    fmt: WireFormat,
    stats: ProduceStats,
) -> ProduceStats:
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaError

    headers = [(CONTENT_TYPE_HEADER, fmt.content_type.encode())]
    producer = AIOKafkaProducer(**kafka.client_kwargs(), acks="all", enable_idempotence=False)
    try:
        await producer.start()
    except KafkaError as exc:
        await producer.stop()
        raise BrokerError(f"cannot reach Kafka at {kafka.bootstrap_servers!r}: {exc}") from exc
    try:
        pending: list[asyncio.Future[object]] = []
        async for record in records:
            pending.append(
                await producer.send(topic, record.value, key=record.key, headers=headers)
            )
            if len(pending) >= _FLUSH_EVERY:
                stats.sent += await _await_all(pending)
                pending = []
        stats.sent += await _await_all(pending)
    except KafkaError as exc:
        raise BrokerError(f"producing to {topic!r} at {kafka.bootstrap_servers!r}: {exc}") from exc
    finally:
        await producer.stop()
    return stats


async def _await_all(pending: Iterable[asyncio.Future[object]]) -> int:
    results = await asyncio.gather(*pending)
    return len(results)
