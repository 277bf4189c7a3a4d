"""Input decoding throughput: how many events per second one core turns from bytes into events.

The worker decodes every consumed record on its event-loop thread, so this is a ceiling on
the events one worker process can ingest. Acceptance (issue 2): batch-decoding 100,000
msgpack events reaches >= 300,000 events/s on one core.

Run: ``.venv/bin/python -m bench.decode_bench`` (writes bench/results/decode.json).
The garbage collector stays on, as in the worker; results of one run are released before the
next so each run starts from the same heap.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from collections.abc import Sequence

from bench._report import print_table, write_results
from streamrec.schemas.codec import RawRecord, decode_batch, encode_event
from streamrec.schemas.events import INTERACTION_ACTIONS, EventKind, InteractionEvent, PlaybackEvent
from streamrec.schemas.wire import CONTENT_TYPE_HEADER, WireFormat

PLAYBACK_SHARE = 0.7  # playback events dominate a music/video stream
CONTEXT_SHARE = 0.1  # playbacks that carry a small client context map
BASE_TS_MS = 1_700_000_000_000


def make_records(
    n: int, fmt: WireFormat, seed: int, with_headers: bool
) -> dict[EventKind, list[RawRecord]]:
    """Realistic records (~90 bytes in msgpack), split by kind as the two input topics are."""
    rng = random.Random(seed)
    actions = list(INTERACTION_ACTIONS)
    headers = ((CONTENT_TYPE_HEADER, fmt.content_type.encode()),) if with_headers else ()
    by_kind: dict[EventKind, list[RawRecord]] = {k: [] for k in EventKind}
    for offset in range(n):
        user = f"user-{rng.randrange(10**8):08d}"
        item = f"track-{rng.randrange(10**9):09d}"
        ts_ms = BASE_TS_MS + offset * 7
        event: PlaybackEvent | InteractionEvent
        if rng.random() < PLAYBACK_SHARE:
            duration = rng.randrange(30_000, 400_000)
            context: dict[str, object] | None = None
            if rng.random() < CONTEXT_SHARE:
                context = {"device": "ios", "surface": "home"}
            event = PlaybackEvent(user, item, ts_ms, rng.randrange(duration + 1), duration, context)
        else:
            event = InteractionEvent(user, item, ts_ms, rng.choice(actions))
        topic = f"{event.kind.value}-events"
        value = encode_event(event, fmt)
        record = RawRecord(value, headers, topic, offset % 12, offset, key=user.encode())
        by_kind[event.kind].append(record)
    return by_kind


def time_decode(by_kind: dict[EventKind, list[RawRecord]], batch: int) -> tuple[float, float]:
    """(wall, CPU) seconds to decode every record, ``batch`` records per decode_batch call.

    CPU time is reported too because the benchmark machine may be shared: it is what the
    decoder costs this process, while wall time also counts time the core spent elsewhere.
    """
    gc.collect()
    decoded = 0
    cpu_start = time.process_time()
    start = time.perf_counter()
    for kind, records in by_kind.items():
        for lo in range(0, len(records), batch):
            result = decode_batch(records[lo : lo + batch], kind)
            if result.errors:
                raise RuntimeError(f"benchmark records failed to decode: {result.errors[0]}")
            decoded += len(result.events)
            del result
    elapsed = time.perf_counter() - start
    cpu_elapsed = time.process_time() - cpu_start
    expected = sum(map(len, by_kind.values()))
    if decoded != expected:
        raise RuntimeError(f"decoded {decoded} events, expected {expected}")
    return elapsed, cpu_elapsed


def pin_to_one_core(cpu: int | None) -> int | None:
    """Pin this process to one core (the last allowed one unless given); None if unsupported."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    chosen = allowed[-1] if cpu is None else cpu
    os.sched_setaffinity(0, {chosen})
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7, help="runs per scenario; best is kept")
    parser.add_argument("--poll-batch", type=int, default=500, help="records per poll scenario")
    parser.add_argument("--cpu", type=int, default=None, help="core to pin to (default: last)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    cpu = pin_to_one_core(args.cpu)
    scenarios = [
        # (label, format, records per decode_batch call, content-type header set)
        ("msgpack, one call", WireFormat.MSGPACK, args.events, False),
        ("msgpack + header, one call", WireFormat.MSGPACK, args.events, True),
        (f"msgpack, polls of {args.poll_batch}", WireFormat.MSGPACK, args.poll_batch, False),
        ("json, one call", WireFormat.JSON, args.events, False),
    ]
    rows: list[dict[str, object]] = []
    for label, fmt, batch, with_headers in scenarios:
        by_kind = make_records(args.events, fmt, args.seed, with_headers)
        n = sum(map(len, by_kind.values()))
        mean_bytes = sum(len(r.value or b"") for rs in by_kind.values() for r in rs) / n
        runs = [time_decode(by_kind, batch) for _ in range(args.repeats)]
        times = [wall for wall, _ in runs]
        rows.append(
            {
                "scenario": label,
                "events": n,
                "mean_bytes": round(mean_bytes, 1),
                "best_s": round(min(times), 4),
                "best_events_per_s": round(n / min(times)),
                "median_events_per_s": round(n / statistics.median(times)),
                "best_cpu_events_per_s": round(n / min(cpu for _, cpu in runs)),
            }
        )
        del by_kind

    print(
        f"decode benchmark: {args.events:,} events, best of {args.repeats}, pinned to cpu {cpu}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print_table(rows)
    path = write_results(
        "decode",
        rows,
        {
            "events": args.events,
            "repeats": args.repeats,
            "pinned_cpu": cpu,
            "playback_share": PLAYBACK_SHARE,
            "context_share": CONTEXT_SHARE,
            "gc_enabled": gc.isenabled(),
            "load_average_1m": os.getloadavg()[0],
            "acceptance": ">= 300,000 msgpack events/s on one core (issue 2)",
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
