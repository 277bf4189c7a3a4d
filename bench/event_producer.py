"""The benchmarks' event producer: a spawned process that sends playback events to the
input topic, keyed by user, as a backlog or on a schedule.

It runs in its own process so that producing never competes with the measured worker for
its event loop or GIL; ``Job`` is what the bench hands it over a pipe, and the reply says
how fast it kept up (``max_lag_ms`` behind the schedule) and, as p50/p99, each paced
event's scheduled time → append (``append_lag``) and append → ack (every 16th event), and
the full collections it paid during the job (``gc_full_*``); an empty job's reply says
the producer is up and knows the topic (worker_bench waits for it before its first
phase). The process freezes its start-up heap first: the spawn re-imports the bench's
main module, torch with it, and a full collection over that heap stopped this producer for
133 ms at 5,000/s (CPU machine; the H200 rows before showed the same as
``producer_max_lag_ms`` 152 ms, p99 lag 105 ms).
``partition_of`` is Kafka's default partitioner, which the per-process KV budget of
``worker_bench --processes`` must agree with.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.gc_pauses import GcPauses
from streamrec.errors import BrokerError
from streamrec.schemas.codec import encode_event
from streamrec.schemas.events import PlaybackEvent
from streamrec.schemas.wire import CONTENT_TYPE_HEADER, WireFormat
from streamrec.worker.interpreter import freeze_heap

IntArray = npt.NDArray[np.int64]
_PLAYED_MS, _DURATION_MS = 190_000, 200_000  # every event is a complete playback
_HEADERS = [(CONTENT_TYPE_HEADER, WireFormat.MSGPACK.content_type.encode())]


@dataclass(frozen=True)
class Job:
    """Events for the producer, which draws the items. With ``ts_ms`` (increasing), event n
    is sent once the wall clock reaches ``ts_ms[n]``; without, a backlog stamped at send."""

    users: IntArray  # [E]
    ts_ms: IntArray | None = None  # [E]


async def job_result(conn: Connection, timeout_s: float) -> dict[str, float]:
    """The producer process's reply to the job sent last (off the loop: a pipe read)."""
    got = await asyncio.to_thread(lambda: conn.recv() if conn.poll(timeout_s) else None)
    if got is None:
        raise BrokerError(f"the producer process did not finish a job in {timeout_s} s")
    return dict(got)


def producer_process(
    bootstrap: str, topic: str, num_items: int, partitions: int, conn: Connection
) -> None:
    """The spawned producer: runs the jobs read from ``conn`` until None comes."""
    freeze_heap()  # else a full collection stalled this producer 133 ms (CPU) at 5,000/s
    asyncio.run(_producer_loop(bootstrap, topic, num_items, partitions, conn, GcPauses()))


async def _producer_loop(
    bootstrap: str,
    topic: str,
    num_items: int,
    partitions: int,
    conn: Connection,
    pauses: GcPauses,
) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_batch_size=1 << 20
    )
    await producer.start()
    await producer.partitions_for(topic)  # the topic's metadata before the first job
    loop, rng = asyncio.get_running_loop(), np.random.default_rng(1)
    try:
        while (job := await loop.run_in_executor(None, conn.recv)) is not None:
            items = rng.integers(num_items, size=len(job.users))
            began = time.monotonic()
            reply = await _send_job(producer, topic, partitions, job, items)
            full = pauses.durations(began, time.monotonic())
            reply["gc_full_count"] = float(len(full))
            reply["gc_full_max_ms"] = float(full.max()) if len(full) else 0.0
            conn.send(reply)
    finally:
        await producer.stop()


def partition_of(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives ``key`` (the producer's and the
    per-process KV budget's: they must agree)."""
    from aiokafka.partitioner import murmur2

    return int((murmur2(key) & 0x7FFFFFFF) % partitions)


async def _send_job(
    producer: Any, topic: str, partitions: int, job: Job, items: IntArray
) -> dict[str, float]:
    """Send the job's events keyed by user: a backlog in per-partition batches, a schedule
    one record at a time."""
    keys = {int(u): f"u{u}".encode() for u in np.unique(job.users)}
    sink = _Sink(producer, topic, keys, {u: partition_of(k, partitions) for u, k in keys.items()})
    send = _send_paced if job.ts_ms is not None else _send_backlog
    return await send(sink, job, items)


@dataclass(frozen=True)
class _Sink:
    """Where a job's events go: the producer, the topic, each user's key and partition."""

    producer: Any
    topic: str
    keys: dict[int, bytes]
    part: dict[int, int]


def _event(user: int, item: int, ts_ms: int) -> bytes:
    return encode_event(PlaybackEvent(f"u{user}", f"i{item}", ts_ms, _PLAYED_MS, _DURATION_MS))


async def _send_backlog(sink: _Sink, job: Job, items: IntArray) -> dict[str, float]:
    """Per-partition batches (aiokafka's batch API: one ``send`` per record costs ~25 µs in
    Python and capped this producer near 35k/s), stamped at send."""
    producer, topic, keys, part = sink.producer, sink.topic, sink.keys, sink.part
    n, sent, acks = len(job.users), 0, []
    started = time.time()
    while sent < n:
        due = min(sent + 2_000, n)
        ts, batches = int(time.time() * 1000.0), dict[int, Any]()
        for j, user in enumerate(job.users[sent:due].tolist()):
            value, p = _event(user, items[sent + j], ts), part[user]
            batch = batches.get(p)
            if batch is None:
                batch = batches[p] = producer.create_batch()
            if batch.append(key=keys[user], value=value, timestamp=None, headers=_HEADERS) is None:
                acks.append(await producer.send_batch(batch, topic, partition=p))
                batch = batches[p] = producer.create_batch()
                batch.append(key=keys[user], value=value, timestamp=None, headers=_HEADERS)
        for p, batch in batches.items():
            acks.append(await producer.send_batch(batch, topic, partition=p))
        sent = due
        await asyncio.sleep(0)
    sent_at = time.time()
    await asyncio.gather(*acks)
    return {"events": n, "events_per_s": n / max(sent_at - started, 1e-9), "max_lag_ms": 0.0}


async def _send_paced(sink: _Sink, job: Job, items: IntArray) -> dict[str, float]:
    """Each event once the wall clock reaches its ``ts_ms``, one ``send`` per record as an
    application's producer sends: a record joins its partition's open batch, which goes
    after ``linger_ms``, and no partition waits for another. (Handing whole batches to
    ``send_batch`` instead stalled this loop whenever the partition's previous batch was
    still lingering: 6.8 ms of every event's p50 at 1,000/s on the CPU machine.)"""
    assert job.ts_ms is not None
    producer, topic, keys, part = sink.producer, sink.topic, sink.keys, sink.part
    users, stamps = job.users.tolist(), job.ts_ms.tolist()
    n, sent, acks = len(users), 0, []
    lag_ms: list[float] = []  # per event: scheduled -> appended (the record's timestamp)
    ack_ms: list[float] = []  # every 16th event: appended -> the broker's ack

    def on_ack(appended_s: float) -> Callable[[asyncio.Future[Any]], None]:
        return lambda _: ack_ms.append((time.time() - appended_s) * 1000.0)

    while sent < n:
        now_ms = time.time() * 1000.0
        if stamps[sent] > now_ms:  # nothing due yet: sleep until the next event's time
            await asyncio.sleep((stamps[sent] - now_ms) / 1000.0)
            continue
        while sent < n and stamps[sent] <= now_ms:
            user = users[sent]
            value = _event(user, items[sent], stamps[sent])
            appended = time.time()
            lag_ms.append(appended * 1000.0 - stamps[sent])
            ack = await producer.send(
                topic, value, key=keys[user], partition=part[user], headers=_HEADERS
            )
            if sent % 16 == 0:
                ack.add_done_callback(on_ack(appended))
            acks.append(ack)
            sent += 1
        await asyncio.sleep(0)
    sent_at = time.time()
    await asyncio.gather(*acks)
    out = {
        "events": n,
        "events_per_s": n / max(sent_at - stamps[0] / 1000.0, 1e-9),
        "max_lag_ms": max(lag_ms),
    }
    for name, values in (("append_lag", lag_ms), ("append_ack", ack_ms)):
        for q in (50, 99):
            out[f"{name}_p{q}_ms"] = float(np.percentile(values, q))
    return out
