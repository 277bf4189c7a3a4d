"""Device memory of the worker's CUDA graphs, captured one bucket at a time (CUDA only).

Builds the serving model as ``bench/worker_bench.py`` does (``--aoti``: the reference
model directory and its AOTI packages, compiled if missing; ``--eager``: the random-init
module), a KV cache of ``--kv-gib``, and a ``GraphedModel`` with the worker's buckets
(``capture_serving_graphs``: extend up to 4,096 tokens, rank and retrieve up to 256 users,
4 per octave), then captures in the worker's order and prints, per capture, the change of
``memory_allocated`` / ``memory_reserved`` and the private pools (CUDA graphs) from the
allocator's snapshot: reserved, in use, free (what the OOM message calls "allocated in
private pools") and how many streams their segments belong to.

    python3 -m bench.graph_memory --aoti            # bench/results/h200_graph_memory.json
    python3 -m bench.graph_memory --eager           # ..._eager.json
    python3 -m bench.graph_memory --aoti --ascending --stream-per-capture   # ..._before.json

``--ascending --stream-per-capture`` captures as GraphedModel did before (extend, rank,
retrieve, smallest bucket first, a new side stream per capture).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench._report import print_table, write_results
from bench.reference_config import REFERENCE_WORKLOADS
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.pipeline.graphed_model import GraphConfig, GraphedModel, bucket_ladder

MIB = 2**20
GIB = 2**30
OLD_ORDER = ("extend", "rank", "retrieve")  # before: entry points in this order, ascending


def pool_figures() -> dict[str, float]:
    """Private-pool segments of the current device: reserved, used, free MiB, streams."""
    device = torch.cuda.current_device()
    reserved = used = 0
    streams: set[int] = set()
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", device) != device or tuple(seg["segment_pool_id"]) == (0, 0):
            continue
        reserved += seg["total_size"]
        used += seg["active_size"]
        streams.add(seg["stream"])
    return {
        "pool_reserved_mib": round(reserved / MIB, 1),
        "pool_used_mib": round(used / MIB, 1),
        "pool_free_mib": round((reserved - used) / MIB, 1),
        "pool_streams": len(streams),
    }


def figures() -> dict[str, float]:
    torch.cuda.synchronize()
    return {
        "allocated_mib": round(torch.cuda.memory_allocated() / MIB, 1),
        "reserved_mib": round(torch.cuda.memory_reserved() / MIB, 1),
        **pool_figures(),
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    backend = parser.add_mutually_exclusive_group(required=True)
    backend.add_argument("--aoti", action="store_true", help="the AOTI packages (worker)")
    backend.add_argument("--eager", action="store_true", help="the eager module")
    names = [w.name for w in REFERENCE_WORKLOADS]
    parser.add_argument("--workload", default="HSTU-8L", choices=names)
    parser.add_argument("--kv-gib", type=float, default=24.0, help="KV pool size (GiB)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="model.graph_max_tokens")
    parser.add_argument("--max-users", type=int, default=256, help="batcher max_batch_users")
    parser.add_argument("--per-octave", type=int, default=4, help="graph_buckets_per_octave")
    parser.add_argument(
        "--entries", nargs="+", default=list(OLD_ORDER), choices=OLD_ORDER,
        help="entry points to capture (default all three)",
    )  # fmt: skip
    parser.add_argument("--ascending", action="store_true", help="the old capture order")
    parser.add_argument(
        "--stream-per-capture", action="store_true", help="a new side stream per capture (old)"
    )
    parser.add_argument("--name", default=None, help="results name (default by the flags)")
    parser.add_argument("--out", default=None, help="also write the JSON here (the run's $OUT)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.graph_memory needs a CUDA device")
    from bench.worker_side import loaded_model  # (imports the worker: after the check)

    w = next(x for x in REFERENCE_WORKLOADS if x.name == args.workload)
    loaded = loaded_model(w, "cuda", aoti=args.aoti)
    cfg = loaded.checkpoint.config
    model = loaded.model
    kv_cfg = KVCacheConfig(
        cfg.num_layers, cfg.num_heads, cfg.head_dim,
        dtype=getattr(model, "kv_dtype", cfg.torch_dtype),
    )  # fmt: skip
    cache = KVCache(kv_cfg, kv_cfg.num_blocks_for(int(args.kv_gib * GIB)), "cuda")
    torch.cuda.empty_cache()  # export/load leftovers: not the graphs'
    # The buckets and table width of capture_serving_graphs (worker/model_loader.py).
    tokens = tuple(
        b for b in bucket_ladder(args.max_tokens, args.per_octave) if b <= args.max_tokens
    )
    users = bucket_ladder(args.max_users, args.per_octave)
    config = GraphConfig(
        max_blocks=-(-cfg.max_seq_len // kv_cfg.block_size) + 1,
        num_candidates=w.num_candidates, buckets=tokens,
    )  # fmt: skip
    graphed = GraphedModel(model, cache.kv, cache.ts, config)
    shape = (w.num_candidates, cfg.d_model, cfg.torch_dtype)
    plan = graphed.capture_plan(
        extend=tokens if "extend" in args.entries else (),
        rank=users if "rank" in args.entries else (),
        retrieve=users if "retrieve" in args.entries else (),
    )
    if args.ascending:
        plan.sort(key=lambda eb: (OLD_ORDER.index(eb[0]), eb[1]))
    start = figures()
    print(f"{loaded.backend}: model + KV ({cache.kv.nbytes / GIB:.1f} GiB): {start}")
    rows: list[dict[str, object]] = []
    before = start
    for entry, bucket in plan:
        if args.stream_per_capture:
            graphed.capture_stream = torch.cuda.Stream()
        began = time.perf_counter()
        graphed.capture(entry, bucket, shape)
        after = figures()
        row: dict[str, object] = {"entry": entry, "bucket": bucket}
        row["s"] = round(time.perf_counter() - began, 3)
        row["d_allocated_mib"] = round(after["allocated_mib"] - before["allocated_mib"], 1)
        row["d_reserved_mib"] = round(after["reserved_mib"] - before["reserved_mib"], 1)
        row |= {k: v for k, v in after.items() if k.startswith("pool_")}
        rows.append(row)
        print(row, flush=True)
        before = after
    print_table(rows)
    end = figures()
    total = {k: round(end[k] - start[k], 1) for k in ("allocated_mib", "reserved_mib")}
    print(f"total over {len(rows)} captures: {total}; private pools {pool_figures()}")
    meta: dict[str, object] = {
        "backend": loaded.backend, "workload": w.name, "kv_gib": round(cache.kv.nbytes / GIB, 2),
        "ascending": args.ascending, "stream_per_capture": args.stream_per_capture,
        "buckets": {"extend": list(tokens), "users": list(users)}, "start": start, "end": end,
        "delta": total, "captures": graphed.stats.captures, "failed": graphed.stats.failed,
        "max_reserved_mib": round(torch.cuda.max_memory_reserved() / MIB, 1),
        "memory_stats": torch.cuda.memory_stats(),
    }  # fmt: skip
    old = args.ascending or args.stream_per_capture
    name = args.name or "h200_graph_memory" + ("_eager" if args.eager else "") + (
        "_before" if old else ""
    )
    print(f"wrote {write_results(name, rows, meta)}")
    if args.out:
        print(f"wrote {write_results(name, rows, meta, Path(args.out))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
