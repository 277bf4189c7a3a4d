"""What the dev broker alone adds to event-to-publish latency: produce -> fetch, no worker.

worker_bench's e2p runs from an event's scheduled send time to the recommendation's
produce-ack; part of it is transport the worker cannot change: the producer's linger,
the broker's append, and the consumer's fetch (``fetch_max_wait_ms``). This sends paced
events through the dev broker (the same aiokafka settings as worker_bench's producer and
the worker's consumer: acks=all, ``--linger-ms``, fetch wait ``--fetch-max-wait-ms``) and
reports send -> fetched latency, the floor under any worker's e2p on this broker.

    .venv/bin/python -m bench.broker_latency --rate 2000 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench._report import RESULTS_DIR, print_table, write_results
from streamrec.tools.devbroker import DevBroker

TOPIC = "latency-probe"


async def _produce(bootstrap: str, rate: float, n: int, linger_ms: int, partitions: int) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=linger_ms)
    await producer.start()
    try:
        start = time.time() + 0.2
        for i in range(n):
            due = start + i / rate
            if (wait := due - time.time()) > 0:
                await asyncio.sleep(wait)
            value = struct.pack("<d", due)  # the scheduled send time, as worker_bench's
            await producer.send(TOPIC, value, key=b"u%d" % (i % 997), partition=i % partitions)
        await producer.flush()
    finally:
        await producer.stop()


async def _consume(bootstrap: str, n: int, fetch_wait_ms: int, out: list[float]) -> None:
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        TOPIC, bootstrap_servers=bootstrap, fetch_max_wait_ms=fetch_wait_ms,
        auto_offset_reset="earliest", enable_auto_commit=False,
    )  # fmt: skip
    await consumer.start()
    try:
        while len(out) < n:
            batches = await consumer.getmany(timeout_ms=100)
            now = time.time()
            for records in batches.values():
                out.extend((now - struct.unpack("<d", r.value)[0]) * 1000.0 for r in records)
    finally:
        await consumer.stop()


async def probe(ns: argparse.Namespace, linger_ms: int) -> dict[str, Any]:
    async with DevBroker() as broker:
        await broker.create_topics_async({TOPIC: ns.partitions})
        got: list[float] = []
        n = int(ns.rate * ns.seconds)
        bootstrap = broker.bootstrap_servers
        reader = asyncio.create_task(_consume(bootstrap, n, ns.fetch_max_wait_ms, got))
        await asyncio.sleep(1.0)  # the consumer has joined and fetches
        await _produce(bootstrap, ns.rate, n, linger_ms, ns.partitions)
        await asyncio.wait_for(reader, 30.0)
    values = np.asarray(got[n // 10 :])  # the first tenth warms the connections
    return {
        "rate": ns.rate, "linger_ms": linger_ms, "fetch_max_wait_ms": ns.fetch_max_wait_ms,
        "events": len(got), "p50_ms": round(float(np.percentile(values, 50)), 2),
        "p99_ms": round(float(np.percentile(values, 99)), 2),
        "max_ms": round(float(values.max()), 2),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=2_000.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--linger-ms", type=int, nargs="+", default=[5, 0])
    parser.add_argument("--fetch-max-wait-ms", type=int, default=5)
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--machine", default="cpu-2core")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    ns = parser.parse_args(argv)
    rows = [asyncio.run(probe(ns, linger)) | {"machine": ns.machine} for linger in ns.linger_ms]
    print_table(rows)
    print(f"wrote {write_results('broker_latency', rows, {'argv': argv}, ns.results_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
