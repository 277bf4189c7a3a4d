"""Issue 8 on the H200, side by side in one run: cache speedup, kernels, hit rates, roofline.

Sections (``--sections``):
  kernel   fused op vs torch reference, alone: extend (1 query/user) and rank (256
           candidates/user) at batch 64 and history 2048, launch-shape variants, K/V GB/s
  speedup  (a) full recompute (eager / torch.compile / CUDA graph, best taken) vs the
           incremental step (extend 1 token + rank 256 candidates over the paged cache,
           100% hits) for HSTU-3L/8L at batch 1/8/64, p50/p99; (b) incremental with the
           torch attention vs the fused op, eager vs CUDA-graph replay
  hitrate  (c) HSTU-8L batch 64: hit rates 100/90/50/0 %, misses onloaded from the
           pinned host tier (streamrec.cache.host_tier) inside the timed step
  aoti     (b) eager vs AOTInductor packages of extend and rank (HSTU-8L), bf16 error
Every section also records the measured ceilings (copy GB/s, bf16 TFLOP/s) for (d).

    CXX=/usr/bin/g++ python3 -m bench.h200_bench            # all sections
    python3 -m bench.h200_bench --sections kernel --quick   # smoke test
"""

from __future__ import annotations

import argparse
import tempfile
import time
import types
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench._report import print_table, write_results
from bench.attention_sweep import summary as sweep_summary
from bench.attention_sweep import sweep_batch, sweep_model
from bench.h200_common import (
    Batch,
    build_model,
    ceilings,
    full_recompute,
    graphed,
    pct,
    time_ms,
)
from bench.reference_config import BATCH_SIZES, HSTU_3L, HSTU_8L, SPEEDUP_HISTORY_LEN
from bench.reference_config import ReferenceWorkload as Workload
from streamrec.cache.block_pool import NoRoom
from streamrec.cache.host_tier import HostTier
from streamrec.models import candidate_attention as ca
from streamrec.models import paged_attention as pa

# ------------------------------------------------------------------ sections


def load_baseline(path: str) -> Any:
    """The launch functions of an earlier ``paged_attention.py`` (its custom ops left out,
    their names are taken), so that before/after kernels are timed in one run."""
    source = Path(path).read_text()
    start = source.index("    @torch.library.triton_op(OP_DECODE")
    end = source.index("ATTENTION_BACKENDS = ")
    module = types.ModuleType("baseline_paged_attention")
    exec(compile(source[:start] + source[end:], path, "exec"), module.__dict__)
    return module


def kernel_section(
    quick: bool, ceil: dict[str, float], baseline: Any = None
) -> list[dict[str, object]]:
    """The fused kernels alone on one layer's pool, launch shapes swept, vs the previous
    kernels (``bench/attention_sweep.py``): extend with 1, 4, 16 new tokens per user
    (decode kernel, % of copy bandwidth) and rank with 256 candidates per user
    (candidate kernel, TFLOP/s), each checked against the fp32 dense reference."""
    rows: list[dict[str, object]] = []
    model = sweep_model()
    for batch in [16] if quick else [1, 8, 64]:
        rows += sweep_batch(model, batch, ceil, baseline, quick)
    for line in sweep_summary(rows):
        print(line)
    return rows


def step_flops_bytes(w: Workload, batch: int, history: int) -> tuple[float, float]:
    """FLOPs and minimal HBM bytes of one incremental step (extend + rank).

    Bytes: every weight once plus each user's K/V read twice (extend and rank are
    separate kernels); FLOPs: projections, attention over the cache, task head.
    """
    hd = w.num_heads * w.head_dim
    tokens = batch * (1 + w.num_candidates)
    per_layer = 2.0 * tokens * (w.d_model * 4 * hd + hd * w.d_model)
    per_layer += 4.0 * tokens * history * hd
    flops = w.num_layers * per_layer
    weights = w.num_layers * (w.d_model * 5 * hd) * 2
    kv = w.num_layers * batch * history * hd * 2 * 2
    return float(flops), float(weights + 2 * kv)


def speedup_section(
    workloads: list[Workload], batches: list[int], iters: int, compile_baseline: bool,
    ceil: dict[str, float], compile_incremental: bool = False,
) -> list[dict[str, object]]:  # fmt: skip
    rows: list[dict[str, object]] = []
    for w in workloads:
        model = build_model(w)
        compiled = torch.compile(full_recompute, dynamic=False) if compile_baseline else None
        for batch in batches:
            data = Batch(model, batch, SPEEDUP_HISTORY_LEN, w.num_candidates, seed=batch)
            items = torch.cat([data.hist_items, data.items[:, None]], 1)  # [B, L+1]
            actions = torch.cat([data.hist_actions, data.actions[:, None]], 1)
            ts = torch.cat([data.hist_ts, data.ts[:, None]], 1)
            cand = data.cand
            args = (model, items, actions, ts, cand, data.ts)
            results: dict[str, list[float]] = {}
            outputs: dict[str, torch.Tensor] = {}
            with torch.no_grad():
                base_iters = max(3, iters // 4) if batch >= 64 else iters
                results["recompute-eager"] = time_ms(partial(full_recompute, *args), base_iters)
                if compiled is not None:
                    compiled(*args)
                    results["recompute-compile"] = time_ms(lambda: compiled(*args), base_iters)  # noqa: B023
                outputs["recompute"] = full_recompute(*args)[1].float()
                for backend in ("torch", "triton"):
                    model.attention_backend = backend
                    step = partial(data.incremental, model)
                    try:
                        results[f"incremental-{backend}-eager"] = time_ms(step, iters)
                    except torch.OutOfMemoryError:  # the dense gather of 256 cands x B users
                        print(f"{w.name} batch {batch}: incremental-{backend} out of memory")
                        torch.cuda.empty_cache()
                        continue
                    outputs[backend] = step()[1].float().view(batch, -1, model.config.num_tasks)
                    try:
                        results[f"incremental-{backend}-graph"] = time_ms(graphed(step), iters)
                    except RuntimeError as exc:  # capture can fail on some paths
                        print(f"graph capture failed ({backend}): {exc}")
                    if compile_incremental and backend == "triton":
                        # Inductor fuses the per-layer elementwise tail around the fused
                        # attention ops; the graph removes the launch cost of what is left.
                        try:
                            fused = torch.compile(step, dynamic=False)
                            fused()
                            results["incremental-triton-compiled-graph"] = time_ms(
                                graphed(fused), iters
                            )
                        except Exception as exc:  # report and keep the other paths
                            print(f"compiled incremental failed: {type(exc).__name__}: {exc}")
                model.attention_backend = "auto"
            best_base = min(
                (k for k in results if k.startswith("recompute")),
                key=lambda k: pct(results[k], 50),
            )
            flops, nbytes = step_flops_bytes(w, batch, SPEEDUP_HISTORY_LEN)
            floor_ms = max(flops / ceil["bf16_tflop_s"] / 1e9, nbytes / ceil["copy_gb_s"] / 1e6)
            for name, samples in results.items():
                p50 = pct(samples, 50)
                row: dict[str, object] = {
                    "section": "speedup", "workload": w.name, "batch": batch, "path": name,
                    "p50_ms": round(p50, 3), "p99_ms": round(pct(samples, 99), 3),
                    "speedup_vs_best_recompute": round(pct(results[best_base], 50) / p50, 2),
                    "floor_ms": round(floor_ms, 3),
                }  # fmt: skip
                if name.startswith("incremental") and name.split("-")[1] in outputs:
                    backend = name.split("-")[1]
                    err = (outputs[backend] - outputs["recompute"]).abs().max()
                    row["max_abs_err_vs_recompute"] = round(float(err), 4)
                rows.append(row)
            del data
            torch.cuda.empty_cache()
    return rows


def hitrate_section(batch: int, iters: int) -> list[dict[str, object]]:
    """Misses are onloaded from pinned host memory inside the timed step."""
    rows: list[dict[str, object]] = []
    torch.cuda.empty_cache()
    model = build_model(HSTU_8L)
    data = Batch(model, batch, SPEEDUP_HISTORY_LEN, HSTU_8L.num_candidates, seed=3)
    cache = data.cache
    host = HostTier(cache, num_blocks=cache.num_blocks)
    for hit_rate in (1.0, 0.9, 0.5, 0.0):
        misses = data.users[: round((1 - hit_rate) * batch)]
        samples: list[float] = []
        moved = 0
        for it in range(iters + 2):
            for u in misses:  # untimed: push the missing users out to the host tier
                host.offload(u, cache.pool.block_table(u), cache.pool.length(u))
                cache.pool.free(u)
            host.synchronize()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for u in misses:
                blocks = cache.pool.restore(u, host.length(u))
                assert not isinstance(blocks, NoRoom)
                moved += len(blocks) * cache.config.bytes_per_block
                host.onload(u, blocks)
            data.refresh_tables()
            with torch.no_grad():
                data.incremental(model)
            torch.cuda.synchronize()
            if it >= 2:
                samples.append((time.perf_counter() - start) * 1e3)
        rows.append({
            "section": "hitrate", "workload": HSTU_8L.name, "batch": batch,
            "hit_rate": hit_rate, "host_onloads": len(misses),
            "p50_ms": round(pct(samples, 50), 3), "p99_ms": round(pct(samples, 99), 3),
            "onload_gb_per_step": round(moved / (iters + 2) / 1e9, 3),
        })  # fmt: skip
    return rows


def aoti_section(batches: list[int], iters: int) -> list[dict[str, object]]:
    """Eager vs AOTInductor packages (extend and rank exported with the fused op)."""
    from streamrec.models.aoti_export import ExportConfig, compile_entry_point

    rows: list[dict[str, object]] = []
    model = build_model(HSTU_8L)
    runners: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("extend", "rank"):
            path = Path(tmp) / f"{name}.pt2"
            timings = compile_entry_point(
                model, name, ExportConfig(entry_points=(name,)), torch.device("cuda"), path, print
            )
            runners[name] = torch._inductor.aoti_load_package(str(path))
            rows.append({"section": "aoti", "entry_point": name, **timings})
        for batch in batches:
            data = Batch(model, batch, SPEEDUP_HISTORY_LEN, HSTU_8L.num_candidates, seed=batch)
            kv, tsp = data.cache.kv, data.cache.ts
            ext = (data.items, data.actions, data.ts, data.offsets, kv, tsp, data.tables, data.lens)
            rnk = (data.cand, data.ts, kv, tsp, data.tables, data.lens)

            def aoti_step() -> Any:
                return runners["extend"](*ext)[2], runners["rank"](*rnk)  # noqa: B023

            with torch.no_grad():
                eager = time_ms(lambda: data.incremental(model), iters)  # noqa: B023
                aoti = time_ms(aoti_step, iters)
                want = data.incremental(model)[1].float()
                got = aoti_step()[1].float()
            rows.append({
                "section": "aoti", "workload": HSTU_8L.name, "batch": batch,
                "eager_p50_ms": round(pct(eager, 50), 3), "aoti_p50_ms": round(pct(aoti, 50), 3),
                "aoti_p99_ms": round(pct(aoti, 99), 3),
                "speedup": round(pct(eager, 50) / pct(aoti, 50), 2),
                "rank_max_abs_err": round(float((got - want).abs().max()), 5),
            })  # fmt: skip
    return rows


def profile_section(batches: list[int]) -> list[dict[str, object]]:
    """Where the HSTU-8L incremental step spends device time: top kernels by share."""
    from torch.profiler import ProfilerActivity, profile

    rows: list[dict[str, object]] = []
    model = build_model(HSTU_8L)
    for batch in batches:
        data = Batch(model, batch, SPEEDUP_HISTORY_LEN, HSTU_8L.num_candidates, seed=batch)
        with torch.no_grad():
            step = graphed(partial(data.incremental, model))
            step()
            torch.cuda.synchronize()
            plain = partial(data.incremental, model)
            plain()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    plain()
                torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in events) or 1.0
        for e in sorted(events, key=lambda e: -e.device_time_total)[:12]:
            rows.append({
                "section": "profile", "workload": HSTU_8L.name, "batch": batch,
                "kernel": e.key[:60], "calls_per_step": e.count // 5,
                "ms_per_step": round(e.device_time_total / 5 / 1000, 4),
                "share": round(e.device_time_total / total, 3),
            })  # fmt: skip
        del data
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sections", nargs="+", default=["kernel", "speedup", "hitrate"],
        choices=["kernel", "speedup", "hitrate", "aoti", "profile"],
    )  # fmt: skip
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument(
        "--workloads", nargs="+", default=["HSTU-3L", "HSTU-8L"], choices=["HSTU-3L", "HSTU-8L"]
    )
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile baseline")
    parser.add_argument(
        "--baseline-kernels", default=None,
        help="an earlier paged_attention.py whose kernels the sweep times first (before/after)",
    )  # fmt: skip
    parser.add_argument(
        "--compile-incremental", action="store_true",
        help="also time the incremental step compiled by Inductor, in a CUDA graph",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA device (the H200 of issue 8)")
    t0 = time.perf_counter()
    ceil = ceilings(args.quick)
    print(f"ceilings: {ceil}", flush=True)
    rows: list[dict[str, object]] = []
    workloads = [w for w in (HSTU_3L, HSTU_8L) if w.name in args.workloads]
    for section in args.sections:
        start = time.perf_counter()
        if section == "kernel":
            with torch.no_grad():
                base = load_baseline(args.baseline_kernels) if args.baseline_kernels else None
                rows += kernel_section(args.quick, ceil, base)
        elif section == "speedup":
            rows += speedup_section(
                workloads, args.batches, args.iters, not args.no_compile, ceil,
                args.compile_incremental,
            )  # fmt: skip
        elif section == "hitrate":
            rows += hitrate_section(max(args.batches), args.iters)
        elif section == "profile":
            rows += profile_section(args.batches)
        else:
            rows += aoti_section(args.batches, args.iters)
        print(f"section {section}: {time.perf_counter() - start:.0f} s", flush=True)
        print_table([r for r in rows if r["section"] == section])
    meta: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _triton_version(),
        "ceilings": ceil,
        "history": SPEEDUP_HISTORY_LEN,
        "launch": {
            "decode": (pa.DECODE_BLOCK_N, pa.DECODE_WARPS, pa.TARGET_PROGRAMS, pa.DECODE_ACC2D),
            "candidates": (
                ca.CAND_BLOCK_M,
                ca.CAND_BLOCK_N,
                ca.CAND_WARPS,
                ca.CAND_STAGES,
                ca.CAND_TARGET_PROGRAMS,
            ),
        },
        "sections": args.sections,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    out_dir = Path(args.out) if args.out else None
    path = (
        write_results("h200", rows, meta, out_dir) if out_dir else write_results("h200", rows, meta)
    )
    print(f"wrote {path}")
    return 0


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "absent"
    return str(triton.__version__)


if __name__ == "__main__":
    raise SystemExit(main())
