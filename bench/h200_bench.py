"""Issue 8 on the H200, side by side in one run: cache speedup, kernels, hit rates, roofline.

Sections (``--sections``):
  kernel   the fused kernels alone, history 2048, batch 1/8/64, launch shapes swept, vs the
           previous kernels (--baseline-kernels) and the fp32 reference: attention
           (bench/attention_sweep.py: extend with 1/4/16 new tokens per user, % of copy
           bandwidth; rank with 256 candidates, TFLOP/s) plus prefill
  attention  the attention part of kernel alone
  speedup  (a) full recompute (dense: eager / torch.compile; jagged on the fused prefill
           kernels: CUDA graph, compiled + CUDA graph; the best taken) vs the
           incremental step (extend 1 token + rank 256 candidates over the paged cache,
           100% hits) for HSTU-3L/8L at batch 1/8/64/256, p50/p99; (b) incremental with
           the torch attention vs the fused op, eager vs CUDA-graph replay; with ``--paths
           ... aoti`` also the AOTI packages (``incremental-aoti-eager`` / ``-graph``) and
           both backends as the worker serves them (``-graphedmodel``)
  prefill  the fused prefill kernels alone (bench/h200_prefill.py), also run by kernel
  hitrate  (c) HSTU-8L batch 64: hit rates 100/90/50/0 %, misses onloaded from the
           pinned host tier (streamrec.cache.host_tier) inside the timed step
  aoti     (b) eager vs AOTInductor packages of extend and rank (HSTU-8L), bf16 error
Every section also records the measured ceilings (copy GB/s, bf16 TFLOP/s) for (d).

    CXX=/usr/bin/g++ python3 -m bench.h200_bench            # all sections
    python3 -m bench.h200_bench --sections kernel --quick   # smoke test
"""

from __future__ import annotations

import argparse
import json
import time
import types
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench._report import print_table, write_results
from bench.aoti_packages import CACHE_DIR as AOTI_CACHE_DIR
from bench.aoti_packages import SPEEDUP_ENTRY_POINTS, reference_model_dir
from bench.attention_sweep import summary as sweep_summary
from bench.attention_sweep import sweep_batch, sweep_model
from bench.h200_common import (
    BLOCK_SIZE,
    Batch,
    build_model,
    ceilings,
    full_recompute,
    fused_recompute,
    fused_recompute_layer,
    graphed,
    pct,
    time_ms,
)
from bench.h200_prefill import prefill_sweep
from bench.reference_config import BATCH_SIZES, HSTU_3L, HSTU_8L, SPEEDUP_HISTORY_LEN
from bench.reference_config import ReferenceWorkload as Workload
from streamrec.cache.block_pool import NoRoom
from streamrec.cache.host_tier import HostTier
from streamrec.models import candidate_attention as ca
from streamrec.models import multi_query_attention as mqa
from streamrec.models import paged_attention as pa
from streamrec.models import prefill_kernels as pfk
from streamrec.models.aoti_export import ExportConfig, export_model
from streamrec.models.aoti_runtime import AOTIModel, load_package
from streamrec.models.checkpoint import load_checkpoint
from streamrec.models.hstu import HSTU
from streamrec.pipeline.graphed_model import GraphConfig, GraphedModel
from streamrec.pipeline.serving_model import ServingModel

SPEEDUP_PATHS = ("recompute", "torch", "triton", "aoti")

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
    quick: bool,
    ceil: dict[str, float],
    baseline: Any = None,
    prefill: bool = True,
    batches: Sequence[int] = (1, 8, 64),
    ops: Sequence[str] = ("extend", "rank", "layer"),
) -> list[dict[str, object]]:
    """The fused kernels alone on one layer's pool, launch shapes swept, vs the previous
    kernels (``bench/attention_sweep.py``): extend with 1, 4, 16 new tokens per user
    (decode kernel, % of copy bandwidth) and rank with 256 candidates per user
    (candidate kernel, TFLOP/s), each checked against the fp32 dense reference."""
    rows: list[dict[str, object]] = []
    model = sweep_model()
    for batch in [16] if quick else batches:
        rows += sweep_batch(model, batch, ceil, baseline, quick, ops)
    for line in sweep_summary(rows):
        print(line)
    if prefill:  # op = prefill / prefill-candidates rows ("attention": extend/rank only)
        rows += prefill_sweep(quick, 20)
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


def fused_recompute_paths(
    model: HSTU, jagged: tuple[torch.Tensor, ...], cand: torch.Tensor, query_ts: torch.Tensor,
    iters: int, compiled_layer: Any,
) -> tuple[dict[str, list[float]], torch.Tensor | None]:  # fmt: skip
    """The full recompute on the fused prefill kernels (jagged), CUDA-graph replayed, eager
    and with the layer compiled by Inductor: timings and the scores (None if it failed)."""
    results: dict[str, list[float]] = {}
    scores = None
    items, actions, ts, offsets = jagged
    plain = partial(fused_recompute, model, items, actions, ts, offsets, cand, query_ts)
    paths: list[tuple[str, Any]] = [("recompute-fused-graph", plain)]
    if compiled_layer is not None:
        paths.append(("recompute-fused-compiled-graph", partial(plain, layer_fn=compiled_layer)))
    for name, fn in paths:
        try:
            got = fn()[1].float()
            results[name] = time_ms(graphed(fn), iters)
            scores = got if scores is None else scores
        except Exception as exc:  # report and keep the other paths
            print(f"{name} failed: {type(exc).__name__}: {exc}"[:400])
            torch.cuda.synchronize()
    return results, scores


def speedup_aoti_model(model: HSTU, model_dir: Path, cache_dir: Path) -> AOTIModel:
    """The extend and rank packages of ``model_dir`` (compiled unless bench.aoti_packages
    did it), single-threaded runners bound to ``model``'s own weights."""
    package = export_model(
        model_dir, "cuda", cache_dir, config=ExportConfig(entry_points=SPEEDUP_ENTRY_POINTS),
        progress=print, jobs=len(SPEEDUP_ENTRY_POINTS),
    )  # fmt: skip
    return load_package(package, torch.device("cuda"), model, entry_points=SPEEDUP_ENTRY_POINTS)


def aoti_incremental(
    model: HSTU, aoti: AOTIModel, data: Batch, iters: int
) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    """The incremental step on the AOTI packages: called directly
    (``incremental-aoti-eager``, input checks included) and captured whole in one CUDA
    graph like ``incremental-triton-graph`` (``incremental-aoti-graph``); then both
    backends as the worker serves them (``-graphedmodel``: GraphedModel's per-call graphs
    and bucket padding; AOTI loaded as worker/model_loader.py loads it, without value
    checks, so no host synchronisation per replay). Returns timings and rank outputs."""
    results: dict[str, list[float]] = {}
    outputs: dict[str, torch.Tensor] = {}

    def probs(m: ServingModel) -> torch.Tensor:
        return data.incremental(m)[1].float().view(data.batch, -1, model.config.num_tasks)

    results["incremental-aoti-eager"] = time_ms(partial(data.incremental, aoti), iters)
    outputs["aoti-eager"] = probs(aoti)
    results["incremental-aoti-graph"] = time_ms(
        graphed(partial(data.incremental, aoti.unchecked())), iters
    )
    outputs["aoti-graph"] = probs(aoti)  # the graph replays the same calls
    config = GraphConfig(
        max_blocks=-(-model.config.max_seq_len // BLOCK_SIZE) + 1,
        num_candidates=data.cands,
        buckets=(data.batch,),
    )
    for name, backend in (("triton", model), ("aoti", aoti.unchecked())):
        served = GraphedModel(backend, data.cache.kv, data.cache.ts, config)
        served.warm_up()
        outputs[f"{name}-graphedmodel"] = probs(served)
        results[f"incremental-{name}-graphedmodel"] = time_ms(
            partial(data.incremental, served), iters
        )
        if served.stats.eager_calls or served.stats.failed:
            print(f"graphedmodel {name}: {served.stats}")
    return results, outputs


def speedup_section(
    workloads: list[Workload], batches: list[int], iters: int, compile_baseline: bool,
    ceil: dict[str, float], compile_incremental: bool = False, compile_fused: bool = True,
    paths: tuple[str, ...] = ("recompute", "torch", "triton"), aoti_cache: Path = AOTI_CACHE_DIR,
) -> list[dict[str, object]]:  # fmt: skip
    rows: list[dict[str, object]] = []
    # One compile serves every layer, batch and workload (tensors-only signature, dynamic).
    compiled_layer = torch.compile(fused_recompute_layer, dynamic=True) if compile_fused else None
    for w in workloads:
        model_dir = reference_model_dir(w) if "aoti" in paths else None
        # The AOTI packages are compiled for the reference model directory's weights.
        model = load_checkpoint(model_dir, "cuda").model if model_dir else build_model(w)
        aoti = None
        if model_dir is not None:
            try:
                aoti = speedup_aoti_model(model, model_dir, aoti_cache)
            except Exception as exc:  # report and keep the other paths
                print(f"{w.name}: no AOTI packages: {type(exc).__name__}: {exc}"[:2000])
        compiled = (
            torch.compile(full_recompute, dynamic=False)
            if compile_baseline and "recompute" in paths
            else None
        )
        for batch in batches:
            data = Batch(model, batch, SPEEDUP_HISTORY_LEN, w.num_candidates, seed=batch)
            items = torch.cat([data.hist_items, data.items[:, None]], 1)  # [B, L+1]
            actions = torch.cat([data.hist_actions, data.actions[:, None]], 1)
            ts = torch.cat([data.hist_ts, data.ts[:, None]], 1)
            cand = data.cand
            args = (model, items, actions, ts, cand, data.ts)
            starts = torch.arange(batch + 1, device="cuda") * items.shape[1]  # [B+1]
            jagged = (items.reshape(-1), actions.reshape(-1), ts.reshape(-1), starts)
            results: dict[str, list[float]] = {}
            outputs: dict[str, torch.Tensor] = {}
            with torch.no_grad():
                if "recompute" in paths:
                    fused_results, fused_scores = fused_recompute_paths(
                        model, jagged, cand, data.ts, iters, compiled_layer
                    )
                    results.update(fused_results)
                else:
                    fused_scores = None
                try:  # dense [B, H, L, L] temporaries: tens of GB at batch 256
                    base_iters = max(3, iters // 4) if batch >= 64 else iters
                    base_iters, warm = (2, 1) if batch >= 256 else (base_iters, 3)
                    dense = partial(full_recompute, *args)
                    if "recompute" in paths:
                        results["recompute-eager"] = time_ms(dense, base_iters, warm)
                    if compiled is not None:
                        compiled(*args)
                        results["recompute-compile"] = time_ms(
                            lambda: compiled(*args),  # noqa: B023
                            base_iters, warm,
                        )  # fmt: skip
                    outputs["dense"] = dense()[1].float()
                except torch.OutOfMemoryError:
                    print(f"{w.name} batch {batch}: dense recompute out of memory")
                    torch.cuda.empty_cache()
                if fused_scores is not None:
                    outputs["fused"] = fused_scores
                # The incremental step is checked against the dense recompute, else the fused.
                reference = outputs.get("dense", fused_scores)
                if reference is not None:
                    outputs["recompute"] = reference
                for backend in [b for b in ("torch", "triton") if b in paths]:
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
                if aoti is not None:
                    try:
                        timed, probs = aoti_incremental(model, aoti, data, iters)
                        results.update(timed)
                        outputs.update(probs)
                    except Exception as exc:  # report and keep the other paths
                        print(f"{w.name} batch {batch}: aoti paths failed: "
                              f"{type(exc).__name__}: {exc}"[:2000])  # fmt: skip
                        torch.cuda.synchronize()
            # the best of every recompute path: dense, compiled, fused
            bases = [k for k in results if k.startswith("recompute")]
            best_base = min(bases, key=lambda k: pct(results[k], 50)) if bases else None
            flops, nbytes = step_flops_bytes(w, batch, SPEEDUP_HISTORY_LEN)
            floor_ms = max(flops / ceil["bf16_tflop_s"] / 1e9, nbytes / ceil["copy_gb_s"] / 1e6)
            for name, samples in results.items():
                p50 = pct(samples, 50)
                row: dict[str, object] = {
                    "section": "speedup", "workload": w.name, "batch": batch, "path": name,
                    "p50_ms": round(p50, 3), "p99_ms": round(pct(samples, 99), 3),
                    "floor_ms": round(floor_ms, 3),
                }  # fmt: skip
                if best_base is not None:
                    row["speedup_vs_best_recompute"] = round(pct(results[best_base], 50) / p50, 2)
                    row["best_recompute"] = best_base
                # a path's own output where it has one (aoti-*, *-graphedmodel), else its
                # attention backend's eager output (the graph replays the same calls)
                own = name.removeprefix("incremental-")
                got = outputs.get(own, outputs.get(own.split("-")[0]))
                if name.startswith("incremental") and got is not None and "recompute" in outputs:
                    err = (got - outputs["recompute"]).abs().max()
                    row["max_abs_err_vs_recompute"] = round(float(err), 4)
                elif (
                    name.startswith("recompute-fused") and "fused" in outputs and "dense" in outputs
                ):
                    err = (outputs["fused"] - outputs["dense"]).abs().max()
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


def aoti_section(batches: list[int], iters: int, cache_dir: Path) -> list[dict[str, object]]:
    """Eager vs AOTInductor packages (extend and rank exported with the fused op), both
    called directly (no CUDA graph; the graph-replayed paths are in the speedup section)."""
    rows: list[dict[str, object]] = []
    model_dir = reference_model_dir(HSTU_8L)
    model = load_checkpoint(model_dir, "cuda").model
    aoti = speedup_aoti_model(model, model_dir, cache_dir)
    manifest = json.loads((aoti.package_dir / "manifest.json").read_text())
    for name in SPEEDUP_ENTRY_POINTS:
        rows.append({"section": "aoti", "entry_point": name, **manifest["timings"][name]})
    for batch in batches:
        data = Batch(model, batch, SPEEDUP_HISTORY_LEN, HSTU_8L.num_candidates, seed=batch)
        with torch.no_grad():
            eager = time_ms(partial(data.incremental, model), iters)
            compiled = time_ms(partial(data.incremental, aoti), iters)
            want = data.incremental(model)[1].float()
            got = data.incremental(aoti)[1].float()
        rows.append({
            "section": "aoti", "workload": HSTU_8L.name, "batch": batch,
            "eager_p50_ms": round(pct(eager, 50), 3),
            "aoti_p50_ms": round(pct(compiled, 50), 3),
            "aoti_p99_ms": round(pct(compiled, 99), 3),
            "speedup": round(pct(eager, 50) / pct(compiled, 50), 2),
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
        choices=["kernel", "attention", "prefill", "speedup", "hitrate", "aoti", "profile"],
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
    parser.add_argument(
        "--no-compile-fused", action="store_true",
        help="time the fused recompute eager in a CUDA graph only (no torch.compile)",
    )  # fmt: skip
    parser.add_argument(
        "--paths", nargs="+", default=["recompute", "torch", "triton"], choices=SPEEDUP_PATHS,
        help="speedup paths: recompute baselines, incremental with torch / fused attention, "
        "AOTI packages (compiled into --aoti-cache-dir unless bench.aoti_packages did it)",
    )  # fmt: skip
    parser.add_argument("--aoti-cache-dir", type=Path, default=AOTI_CACHE_DIR)
    parser.add_argument(
        "--kernel-ops", nargs="+", default=["extend", "rank", "layer"],
        choices=["extend", "rank", "layer"], help="kernel/attention sections: which rows",
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
        if section in ("kernel", "attention"):
            with torch.no_grad():
                base = load_baseline(args.baseline_kernels) if args.baseline_kernels else None
                rows += kernel_section(
                    args.quick, ceil, base, section == "kernel",
                    [b for b in (1, 8, 64) if b in args.batches], args.kernel_ops,
                )  # fmt: skip
        elif section == "speedup":
            rows += speedup_section(
                workloads, args.batches, args.iters, not args.no_compile, ceil,
                args.compile_incremental, not args.no_compile_fused, tuple(args.paths),
                args.aoti_cache_dir,
            )  # fmt: skip
        elif section == "prefill":
            with torch.no_grad():
                rows += prefill_sweep(args.quick, args.iters)
        elif section == "hitrate":
            rows += hitrate_section(max(args.batches), args.iters)
        elif section == "profile":
            rows += profile_section(args.batches)
        else:
            rows += aoti_section(args.batches, args.iters, args.aoti_cache_dir)
        print(f"section {section}: {time.perf_counter() - start:.0f} s", flush=True)
        own = "kernel" if section in ("prefill", "attention") else section
        print_table([r for r in rows if r["section"] == own])
    meta: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _triton_version(),
        "ceilings": ceil,
        "history": SPEEDUP_HISTORY_LEN,
        "launch": {
            "decode": (pa.DECODE_BLOCK_N, pa.DECODE_WARPS, pa.TARGET_PROGRAMS, pa.DECODE_ACC2D),
            "decode_chunk": (mqa.CHUNK_M, mqa.CHUNK_N),
            "candidates": (
                ca.CAND_BLOCK_M,
                ca.CAND_BLOCK_N,
                ca.CAND_WARPS,
                ca.CAND_STAGES,
                ca.CAND_TARGET_PROGRAMS,
            ),
            "prefill": pfk.PREFILL_LAUNCHES[0],
            "prefill_candidates": (*pfk.CAND_LAUNCH, pfk.CAND_TARGET_PROGRAMS),
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
