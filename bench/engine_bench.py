"""``streamrec bench engine``: the engine alone on a synthetic stream of session bursts.

Users have skewed history lengths (pre-loaded into a memory history store, as if they had
been active before the worker started) and come back in bursts of a few events, with a
Zipf-skewed popularity so that some users are hot (GPU hits), some lukewarm (host-tier
hits) and some cold (misses, prefilled from the store). Figures: steps/s, events/s,
p50/p99 step latency, per-tier hit rates and the time per phase.

    python -m bench.engine_bench                 # small config, CPU (this machine)
    python -m bench.engine_bench --config hstu-8l --device cuda   # the H200 reference
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import numpy as np
import torch

from bench._report import print_table, write_results
from bench.reference_config import HSTU_3L, HSTU_8L, ReferenceWorkload
from streamrec.cache.history_backends import open_history_store
from streamrec.cache.history_store import HistoryEvent, HistoryStore, Token
from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_tiers import KVTiers
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.pipeline.delta import Delta, UserDelta
from streamrec.pipeline.engine import Engine, EngineConfig
from streamrec.pipeline.micro_batcher import Batch, ReleaseReason
from streamrec.pipeline.scoring_config import ScoringConfig

SMALL = ReferenceWorkload(
    name="small",
    num_layers=2,
    d_model=64,
    num_heads=2,
    head_dim=32,
    max_seq_len=256,
    num_items=5_000,
    num_candidates=64,
    dtype="float32",
    history_median=60,
)
WORKLOADS = {"small": SMALL, "hstu-3l": HSTU_3L, "hstu-8l": HSTU_8L}


@dataclass(frozen=True)
class BenchArgs:
    workload: ReferenceWorkload
    device: str
    users: int
    steps: int
    batch_users: int
    gpu_fraction: float  # of all users' KV that fits the GPU pool
    host_fraction: float
    burst_max: int  # a user brings 1..burst_max new events per step
    seed: int


def _model(w: ReferenceWorkload, device: str) -> tuple[HSTU, ItemVocabulary]:
    torch.manual_seed(0)
    vocab = ItemVocabulary([f"i{n}" for n in range(w.num_items)], num_oov_buckets=16)
    config = HSTUConfig(
        num_items=vocab.size,
        num_oov_buckets=16,
        d_model=w.d_model,
        num_layers=w.num_layers,
        num_heads=w.num_heads,
        head_dim=w.head_dim,
        max_seq_len=w.max_seq_len,
        dtype=w.dtype,
    )
    model = HSTU(config).to(device=device, dtype=config.torch_dtype).eval()
    return model, vocab


async def _preload(
    store: HistoryStore, lengths: np.ndarray, n_items: int, rng: np.random.Generator
) -> None:
    """Histories that exist before the run (written with offsets below the stream's)."""
    chunk: list[HistoryEvent] = []
    for user, length in enumerate(lengths):
        items = rng.integers(17, 17 + n_items, size=int(length))
        ts = 1_600_000_000_000 + np.cumsum(rng.integers(1_000, 600_000, size=int(length)))
        for n in range(int(length)):
            chunk.append(
                HistoryEvent(f"u{user}", "history", 0, n, Token(int(items[n]), 1, int(ts[n])))
            )
        if len(chunk) >= 50_000:
            await store.append(chunk)
            chunk = []
    if chunk:
        await store.append(chunk)


def _bursts(args: BenchArgs, rng: np.random.Generator) -> list[Batch]:
    """Batches of ``batch_users`` users each bringing a burst of 1..burst_max new events."""
    popularity = 1.0 / np.arange(1, args.users + 1) ** 0.9
    popularity /= popularity.sum()
    offset = 0
    ts = 1_700_000_000_000
    batches = []
    for seq in range(args.steps):
        chosen = rng.choice(args.users, size=args.batch_users, replace=False, p=popularity)
        users = []
        for u in chosen:
            deltas = []
            for _ in range(int(rng.integers(1, args.burst_max + 1))):
                ts += int(rng.integers(1, 1_000))
                item = f"i{int(rng.integers(0, args.workload.num_items))}"
                deltas.append(Delta(f"u{u}", item, int(rng.integers(1, 12)), ts, "live", 0, offset))
                offset += 1
            users.append(UserDelta(f"u{u}", tuple(deltas)))
        batches.append(
            Batch(seq, tuple(users), ReleaseReason.SIZE, 0.0, sum(len(x.deltas) for x in users))
        )
    return batches


async def run(args: BenchArgs) -> dict[str, object]:
    w = args.workload
    rng = np.random.default_rng(args.seed)
    model, vocab = _model(w, args.device)
    lengths = w.history_lengths(args.users, seed=args.seed)
    store = open_history_store("memory://", w.max_seq_len)
    await _preload(store, lengths, w.num_items, rng)
    kv_config = KVCacheConfig(w.num_layers, w.num_heads, w.head_dim, 16, model.config.torch_dtype)
    total_blocks = int(np.sum(-(-(lengths + args.steps) // 16)))
    cache = KVCache(kv_config, max(64, int(total_blocks * args.gpu_fraction)), args.device)
    host_blocks = int(total_blocks * args.host_fraction)
    host = HostTier(cache, host_blocks) if host_blocks else None
    tiers = KVTiers(cache, host, w.max_seq_len)
    scoring = ScoringConfig(top_k=20, num_candidates=w.num_candidates, exclude_recent=16)
    engine = Engine(
        model,
        tiers,
        store,
        vocab,
        model.config.task_names,
        EngineConfig(model_name=w.name, model_version="bench", scoring=scoring),
    )
    batches = _bursts(args, rng)
    warm = max(1, len(batches) // 5)
    for batch in batches[:warm]:  # first touches are misses: warm the tiers, not timed
        await engine.process(batch)
    before = engine.stats()
    base = (
        before.gpu_hits,
        before.host_hits,
        before.misses,
        before.events,
        dict(before.phase_seconds),
    )
    latencies = []
    start = time.perf_counter()
    for batch in batches[warm:]:
        t0 = time.perf_counter()
        await engine.process(batch)
        latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    s = engine.stats()
    steps = len(batches) - warm
    hits = (s.gpu_hits - base[0], s.host_hits - base[1], s.misses - base[2])
    looked_up = max(1, sum(hits))
    phases = {k: (v - base[4].get(k, 0.0)) * 1000.0 / steps for k, v in s.phase_seconds.items()}
    await engine.close()
    lat = np.array(latencies) * 1000.0
    return {
        "workload": w.name,
        "device": args.device,
        "batch_users": args.batch_users,
        "steps": steps,
        "steps_per_s": steps / elapsed,
        "events_per_s": (s.events - base[3]) / elapsed,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "gpu_hit": hits[0] / looked_up,
        "host_hit": hits[1] / looked_up,
        "miss": hits[2] / looked_up,
        **{f"{k}_ms": round(v, 3) for k, v in phases.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(WORKLOADS), default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--users", type=int, default=None)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-users", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--gpu-fraction", type=float, default=0.5)
    parser.add_argument("--host-fraction", type=float, default=0.3)
    parser.add_argument("--burst-max", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    workload = WORKLOADS[ns.config]
    users = ns.users or (400 if workload is SMALL else 1_000)
    rows = []
    for batch_users in ns.batch_users:
        args = BenchArgs(
            workload,
            ns.device,
            users,
            ns.steps,
            batch_users,
            ns.gpu_fraction,
            ns.host_fraction,
            ns.burst_max or (3 if workload is SMALL else workload.new_events_per_step),
            ns.seed,
        )
        rows.append(asyncio.run(run(args)))
    print_table(rows)
    name = f"engine_{workload.name.lower()}_{ns.device}"
    path = write_results(name, rows, {"argv": argv or [], "users": users, "steps": ns.steps})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
