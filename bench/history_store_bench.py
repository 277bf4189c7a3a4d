"""History-store append throughput: batches of 512 events, memory and Redis backends.

The engine appends every micro-batch to the store before it runs the model, so this rate
bounds the worker's event rate. Events are spread over many users and co-partitioned
topics as in production (one EVALSHA per user per batch on Redis).

    .venv/bin/python -m bench.history_store_bench [--events N] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from streamrec.cache.history_backends import open_history_store
from streamrec.cache.history_store import HistoryEvent, HistoryStore, Token
from streamrec.errors import StoreError

RESULTS = Path(__file__).parent / "results" / "history_store_bench.json"
TOPICS = ("playback-events", "interaction-events")


@dataclass(frozen=True)
class Figure:
    backend: str
    events: int
    batch_size: int
    users: int
    seconds: float
    events_per_s: float
    get_users_per_s: float


def _events(n: int, users: int, partitions: int, seed: int) -> list[HistoryEvent]:
    rng = random.Random(seed)
    offsets = {(t, p): 0 for t in TOPICS for p in range(partitions)}
    out = []
    for i in range(n):
        u = rng.randrange(users)
        tp = (rng.choice(TOPICS), u % partitions)
        offsets[tp] += 1
        token = Token(rng.randrange(1, 1_000_000), rng.randrange(1, 12), 1_700_000_000_000 + i)
        out.append(HistoryEvent(f"user-{u}", tp[0], tp[1], offsets[tp], token))
    return out


async def _measure(
    store: HistoryStore, name: str, events: list[HistoryEvent], batch: int
) -> Figure:
    users = sorted({e.user_id for e in events})
    start = time.perf_counter()
    for i in range(0, len(events), batch):
        await store.append(events[i : i + batch])
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, len(users), batch):
        await store.get(users[i : i + batch])
    get_seconds = time.perf_counter() - start
    return Figure(
        backend=name,
        events=len(events),
        batch_size=batch,
        users=len(users),
        seconds=round(seconds, 4),
        events_per_s=round(len(events) / seconds),
        get_users_per_s=round(len(users) / get_seconds),
    )


async def _run(args: argparse.Namespace) -> list[Figure]:
    events = _events(args.events, args.users, args.partitions, seed=0)
    users = sorted({e.user_id for e in events})
    figures = []
    prefix = f"streamrec-bench-{uuid.uuid4().hex}"
    for name, url in (("memory", "memory://"), ("redis", f"{args.redis_url}?prefix={prefix}")):
        store = open_history_store(url, args.max_seq_len)
        try:
            await store.ping()
            figures.append(await _measure(store, name, events, args.batch_size))
        except StoreError as exc:
            print(f"skipping {name}: {exc}")
        finally:
            with contextlib.suppress(StoreError):
                await store.delete(users)  # leave the shared Redis as we found it
            await store.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--users", type=int, default=20_000)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args(argv)
    figures = asyncio.run(_run(args))
    row = "{:<8} {:>8} {:>6} {:>7} {:>10} {:>12}"
    print(row.format("backend", "events", "batch", "users", "events/s", "get users/s"))
    for f in figures:
        print(
            row.format(
                f.backend,
                f.events,
                f.batch_size,
                f.users,
                f"{f.events_per_s:,}",
                f"{f.get_users_per_s:,}",
            )
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps([asdict(f) for f in figures], indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
