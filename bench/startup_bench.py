"""Time from process start to ready to serve, with the AOTI packages already compiled.

A fresh Python process does what the worker's start does before it joins the consumer
group: import, load the model directory (HSTU-8L, 1M items, bf16) onto the GPU, open the
AOTI packages and bind them to those weights, allocate the KV pool (half the free
memory, as the worker's defaults) and the pinned host tier, and capture every CUDA graph
the worker captures (extend buckets 1 … 1024 tokens, rank buckets 1 … 64 users, 256
candidates). Each phase is timed; ``ready_s`` counts from the moment the parent started
the process. After the clock stops, every entry point is checked against the eager module (bf16:
max |Δ| of the outputs) and prefill / retrieve are timed on both backends.

    CXX=/usr/bin/g++ python3 -m bench.startup_bench            # H200, ~1 min warm
    python3 -m bench.startup_bench --backend eager             # same without packages

Target (issue 15): ready within 30 s. The packages come from ``bench.aoti_packages``
(compiled here first if missing; that compile is reported apart, not in ``ready_s``).
The weights file is read from the page cache (the parent wrote or read it just before).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench._report import print_table, profile_text
from bench.aoti_packages import CACHE_DIR, prepare, reference_model_dir, save_results, workload
from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache, KVCacheConfig, free_memory_bytes
from streamrec.models.checkpoint import load_checkpoint
from streamrec.pipeline.micro_batcher import BatcherConfig
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.pipeline.serving_model import ServingModel
from streamrec.worker.config import CacheConfig, ModelConfig
from streamrec.worker.model_loader import (
    LoadedModel,
    graphed_serving_model,
    load_serving_model,
    resolve_device,
)

NUM_CANDIDATES = 256  # the reference workload's


def model_config(model_dir: Path, cache_dir: Path, backend: str) -> ModelConfig:
    aoti = backend == "aoti"
    return ModelConfig(
        model_dir=model_dir,
        aoti_cache_dir=cache_dir if aoti else cache_dir / "none",
        device="cuda",
        backend="aoti" if aoti else "eager",
    )


def serve_start(
    cfg: ModelConfig, started: float, profile_to: Path | None = None
) -> dict[str, object]:
    """The worker's start, phase by phase (runs in the fresh process); ``profile_to``:
    a cProfile of the ``open_packages`` phase, written there as text (top 40, cumulative)."""
    phases: dict[str, float] = {"interpreter_and_imports": time.time() - started}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        phases[name] = now - since
        return now

    t = time.perf_counter()
    device = resolve_device(cfg.device)
    torch.cuda.init()
    torch.empty(1, device=device)
    t = lap("cuda_init", t)
    checkpoint = load_checkpoint(cfg.model_dir, device=device)
    torch.cuda.synchronize()
    t = lap("load_checkpoint", t)
    weights_bytes = torch.cuda.memory_allocated(device)
    scoring = ScoringConfig(num_candidates=NUM_CANDIDATES)
    prof = cProfile.Profile() if profile_to else None
    if prof:
        prof.enable()
    model, backend = load_serving_model(cfg, checkpoint, device, scoring)
    t = lap("open_packages", t)
    if prof and profile_to:
        prof.disable()
        profile_to.write_text(profile_text(prof, 40))
    after_packages = torch.cuda.memory_allocated(device)
    loaded = LoadedModel(checkpoint=checkpoint, model=model, backend=backend, device=device)
    hstu, c = checkpoint.config, CacheConfig()
    geometry = KVCacheConfig(
        hstu.num_layers, hstu.num_heads, hstu.head_dim, c.block_size, hstu.torch_dtype
    )
    budget = int(c.kv_budget_fraction * free_memory_bytes(device))
    cache = KVCache(geometry, geometry.num_blocks_for(budget), device)
    host = HostTier.from_budget(cache, c.host_tier_bytes)
    torch.cuda.synchronize()
    t = lap("kv_pool_and_host_tier", t)
    max_users = BatcherConfig().max_batch_users
    graphed = graphed_serving_model(loaded, cache, cfg, max_users, NUM_CANDIDATES)
    torch.cuda.synchronize()
    lap("capture_graphs", t)
    ready_at = time.time()
    assert graphed is not None
    return {
        "backend": backend,
        "ready_s": round(ready_at - started, 2),
        **{f"{k}_s": round(v, 2) for k, v in phases.items()},
        "graphs": graphed.stats.captures,
        "graphs_failed": graphed.stats.failed,
        "weights_gb_on_device": round(weights_bytes / 1e9, 3),
        "packages_gb_on_device": round((after_packages - weights_bytes) / 1e9, 3),
        "kv_blocks": cache.pool.num_blocks,
        "host_blocks": host.num_blocks,
        **check_against_eager(loaded, cache, graphed),
    }


def _ms(call: Callable[[], object], reps: int = 5) -> float:
    """Median wall ms of ``call`` (synchronised), after one untimed call."""
    call()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return round(sorted(times)[reps // 2], 3)


@torch.no_grad()
def check_against_eager(
    loaded: LoadedModel, cache: KVCache, served: ServingModel
) -> dict[str, float]:
    """After the clock: 8 users with 300 cached tokens each. extend + rank through the
    served (graph-replayed) model, prefill + retrieve through it directly, each against
    the eager module: max |Δ| of the outputs, and the ms of prefill / retrieve on both
    (a traced prefill pads every history to max_seq_len; eager pads to the longest)."""
    eager = loaded.checkpoint.model
    cfg = eager.config
    users = [f"u{i}" for i in range(8)]
    gen = torch.Generator().manual_seed(0)
    for u in users:
        cache.pool.append(u, 300)
    tables, lens = cache.batch_tables(users)
    used = tables.long().unique()
    cache.kv[:, :, used] = torch.randn(
        cfg.num_layers, 2, used.numel(), *cache.kv.shape[3:], generator=gen
    ).to(cache.kv)
    cache.ts[used] = 1_700_000_000_000
    dev = loaded.device
    items = torch.randint(1, cfg.num_items, (8,), generator=gen).to(dev)
    actions = torch.ones(8, dtype=torch.int64, device=dev)
    ts = torch.full((8,), 1_700_000_100_000, dtype=torch.int64, device=dev)
    offsets = torch.arange(9, dtype=torch.int64, device=dev)
    cand = torch.randint(1, cfg.num_items, (8, NUM_CANDIDATES), generator=gen).to(dev)
    args = (items, actions, ts, offsets, cache.kv, cache.ts, tables, lens)
    want_emb = eager.extend(*args)[2]
    out = {"max_abs_err_user_emb": _err(served.extend(*args)[2], want_emb)}
    rank_args = (cand, ts, cache.kv, cache.ts, tables, lens)
    out["max_abs_err_rank"] = _err(served.rank(*rank_args), eager.rank(*rank_args))
    hist = 300 * 8
    p_args = (
        torch.randint(1, cfg.num_items, (hist,), generator=gen).to(dev),
        torch.randint(1, cfg.num_actions, (hist,), generator=gen).to(dev),
        1_700_000_000_000 + torch.arange(hist, device=dev) * 1000,
        torch.arange(9, dtype=torch.int64, device=dev) * 300,
    )
    out["max_abs_err_prefill_emb"] = _err(served.prefill(*p_args)[2], eager.prefill(*p_args)[2])
    exclude = torch.full((8, 1), -1, dtype=torch.int64, device=dev)
    got_s, got_i = served.retrieve(want_emb, NUM_CANDIDATES, exclude)
    want_s, want_i = eager.retrieve(want_emb, NUM_CANDIDATES, exclude)
    out["max_abs_err_retrieve"] = _err(got_s, want_s)
    out["retrieve_top1_agree"] = float((got_i[:, 0] == want_i[:, 0]).float().mean())
    for name, model in (("served", served), ("eager", eager)):
        out[f"prefill_8x300_ms_{name}"] = _ms(lambda m=model: m.prefill(*p_args))  # type: ignore[misc]
        out[f"retrieve_8_ms_{name}"] = _ms(
            lambda m=model: m.retrieve(want_emb, NUM_CANDIDATES, exclude)  # type: ignore[misc]
        )
    return out


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return round(float((got.float() - want.float()).abs().max()), 5)


def run_child(
    model_dir: Path, cache_dir: Path, backend: str, profile_to: Path | None = None
) -> dict[str, object]:
    """``serve_start`` in a fresh interpreter; the clock starts before it is spawned."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "startup.json"
        profile = ["--child-profile", str(profile_to)] if profile_to else []
        started = time.time()
        proc = subprocess.run(
            [sys.executable, "-m", "bench.startup_bench", "--child", str(started),
             "--model-dir", str(model_dir), "--cache-dir", str(cache_dir),
             "--backend", backend, "--child-out", str(out), *profile],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"startup child failed ({proc.returncode}): {proc.stderr[-3000:]}")
        result: dict[str, object] = json.loads(out.read_text())
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workload", default="HSTU-8L", choices=["HSTU-8L", "HSTU-3L"])
    parser.add_argument("--backend", nargs="+", default=["aoti"], choices=["aoti", "eager"])
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    parser.add_argument("--out", default=None, help="also write the JSON here ($OUT)")
    parser.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-profile", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile", action="store_true",
        help="cProfile the open_packages phase: startup_open_profile_<backend>.txt in --out",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.child is not None:
        cfg = model_config(args.model_dir, args.cache_dir, args.backend[0])
        result = serve_start(cfg, args.child, args.child_profile)
        args.child_out.write_text(json.dumps(result, default=str))
        return 0
    if not torch.cuda.is_available():
        parser.error("the start-up bench serves on the GPU")
    start = time.perf_counter()
    model_dir = reference_model_dir(workload(args.workload))
    setup_s = time.perf_counter() - start
    compile_s = 0.0
    if "aoti" in args.backend:
        start = time.perf_counter()
        prepare([args.workload], args.cache_dir)
        compile_s = time.perf_counter() - start
    torch.cuda.empty_cache()
    rows = []
    for backend in args.backend:
        try:
            profile = None
            if args.profile:
                profile = Path(args.out or ".") / f"startup_open_profile_{backend}.txt"
            row = run_child(model_dir, args.cache_dir, backend, profile)
            rows.append({"workload": args.workload, **row})
            if profile and profile.exists():
                print("\n".join(profile.read_text().splitlines()[:48]))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"startup with {backend}: {exc}")
    print(f"{args.workload}: model dir {setup_s:.0f} s, packages (compile/check) {compile_s:.0f} s")
    print_table([{k: v for k, v in r.items() if k != "graphs_failed"} for r in rows])
    meta = {"model_dir": str(model_dir), "setup_s": setup_s, "packages_s": compile_s}
    save_results(f"startup_{args.workload.lower()}", rows, meta, args.out)
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
