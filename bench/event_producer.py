"""The benchmarks' event producer: a spawned process that sends playback events to the
input topic, keyed by user, as a backlog or on a schedule.

It runs in its own process so that producing never competes with the measured worker for
its event loop or GIL; ``Job`` is what the bench hands it over a pipe, and the reply says
how fast it kept up (``max_lag_ms`` behind the schedule) and, as p50/p99, each paced
event's scheduled time → append (``append_lag``) and each batch's append → ack.
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

from streamrec.schemas.codec import encode_event
from streamrec.schemas.events import PlaybackEvent
from streamrec.schemas.wire import CONTENT_TYPE_HEADER, WireFormat

IntArray = npt.NDArray[np.int64]
_PLAYED_MS, _DURATION_MS = 190_000, 200_000  # every event is a complete playback


@dataclass(frozen=True)
class Job:
    """Events for the producer, which draws the items. With ``ts_ms`` (increasing), event n
    is sent once the wall clock reaches ``ts_ms[n]``; without, a backlog stamped at send."""

    users: IntArray  # [E]
    ts_ms: IntArray | None = None  # [E]


def producer_process(
    bootstrap: str, topic: str, num_items: int, partitions: int, conn: Connection
) -> None:
    """The spawned producer: runs the jobs read from ``conn`` until None comes."""
    asyncio.run(_producer_loop(bootstrap, topic, num_items, partitions, conn))


async def _producer_loop(
    bootstrap: str, topic: str, num_items: int, partitions: int, conn: Connection
) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_batch_size=1 << 20
    )
    await producer.start()
    loop, rng = asyncio.get_running_loop(), np.random.default_rng(1)
    try:
        while (job := await loop.run_in_executor(None, conn.recv)) is not None:
            items = rng.integers(num_items, size=len(job.users))
            conn.send(await _send_job(producer, topic, partitions, job, items))
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
    """Send the job's events keyed by user, in per-partition batches (aiokafka's batch API:
    one ``send`` per record costs ~25 µs in Python and capped this producer near 35k/s)."""
    headers = [(CONTENT_TYPE_HEADER, WireFormat.MSGPACK.content_type.encode())]
    n, sent, max_lag_ms = len(job.users), 0, 0.0
    keys = {int(u): f"u{u}".encode() for u in np.unique(job.users)}
    part = {u: partition_of(k, partitions) for u, k in keys.items()}
    acks: list[asyncio.Future[Any]] = []
    append_lag_ms: list[float] = []  # per paced event: its scheduled time -> appended
    ack_ms: list[float] = []  # per batch: handed to the producer -> the broker's ack

    def on_ack(sent_s: float) -> Callable[[asyncio.Future[Any]], None]:
        return lambda _: ack_ms.append((time.time() - sent_s) * 1000.0)

    async def send(batch: Any, partition: int) -> None:
        ack = await producer.send_batch(batch, topic, partition=partition)
        ack.add_done_callback(on_ack(time.time()))
        acks.append(ack)

    started = time.time()
    while sent < n:
        now_ms = time.time() * 1000.0
        if job.ts_ms is None:
            due = min(sent + 2_000, n)
        else:
            due = int(np.searchsorted(job.ts_ms, now_ms, side="right"))
            if due == sent:  # nothing due yet: sleep until the next event's time
                await asyncio.sleep(max(float(job.ts_ms[sent]) - now_ms, 0.0) / 1000.0)
                continue
            max_lag_ms = max(max_lag_ms, now_ms - float(job.ts_ms[sent]))
        batches: dict[int, Any] = {}
        users, stamps = job.users[sent:due].tolist(), None
        if job.ts_ms is not None:
            stamps = job.ts_ms[sent:due].tolist()
        for j, user in enumerate(users):
            ts = int(now_ms) if stamps is None else stamps[j]
            value = encode_event(
                PlaybackEvent(f"u{user}", f"i{items[sent + j]}", ts, _PLAYED_MS, _DURATION_MS)
            )
            p = part[user]
            batch = batches.get(p)
            if batch is None:
                batch = batches[p] = producer.create_batch()
            if batch.append(key=keys[user], value=value, timestamp=None, headers=headers) is None:
                await send(batch, p)
                batch = batches[p] = producer.create_batch()
                batch.append(key=keys[user], value=value, timestamp=None, headers=headers)
        for p, batch in batches.items():
            await send(batch, p)
        if stamps is not None:  # the record's timestamp is its append time (timestamp=None)
            append_lag_ms.extend((time.time() * 1000.0 - np.asarray(stamps)).tolist())
        sent = due
        await asyncio.sleep(0)
    sent_at = time.time()
    await asyncio.gather(*acks)
    first = started if job.ts_ms is None else float(job.ts_ms[0]) / 1000.0
    rate = n / max(sent_at - first, 1e-9)
    out = {"events": n, "events_per_s": rate, "max_lag_ms": max_lag_ms}
    for name, values in (("append_lag", append_lag_ms), ("append_ack", ack_ms)):
        for q in (50, 99):
            out[f"{name}_p{q}_ms"] = float(np.percentile(values, q)) if values else 0.0
    return out
