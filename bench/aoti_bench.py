"""Eager vs AOTInductor, side by side in one run (issue 5, acceptance 2).

One serving step per batch size: ``extend`` with 1 new token per user over a paged cache
holding ``history`` tokens per user, then ``rank`` of ``candidates`` per user. Both
backends see the same pool, inputs and weights; the first call of each also gives the
equality figure (max norm-relative error of every output, AOTI vs eager).

The pool is filled with random K/V instead of a real prefill: the step's cost does not
depend on the values, and an eager prefill of 64 × 2048 tokens would dominate the run.

H200: ``CXX=/usr/bin/g++ python3 -m bench.aoti_bench --device cuda`` (reference
HSTU-8L, bf16). CPU: ``.venv/bin/python -m bench.aoti_bench --small``.
Writes bench/results/aoti_<device>.json; the package is cached under
``.streamrec-cache/bench-aoti`` so a re-run skips the compile.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from bench._report import print_table, write_results
from bench.reference_config import BATCH_SIZES, REFERENCE_WORKLOADS, SPEEDUP_HISTORY_LEN
from streamrec.models.aoti_export import ExportConfig, build_package
from streamrec.models.aoti_runtime import AOTIModel, load_package
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.pipeline.serving_model import ServingModel

CACHE_DIR = ".streamrec-cache/bench-aoti"
BASE_TS = 1_700_000_000_000


@dataclass(frozen=True)
class BenchShape:
    """Model and traffic of one run."""

    name: str
    model: HSTUConfig
    history: int
    candidates: int
    block_size: int
    iters: int
    warmup: int


def reference_shape(workload: str, iters: int) -> BenchShape:
    ref = next(w for w in REFERENCE_WORKLOADS if w.name == workload)
    cfg = HSTUConfig(
        num_items=ref.num_items, d_model=ref.d_model, num_layers=ref.num_layers,
        num_heads=ref.num_heads, head_dim=ref.head_dim, max_seq_len=ref.max_seq_len,
        dtype=ref.dtype,
    )  # fmt: skip
    return BenchShape(ref.name, cfg, SPEEDUP_HISTORY_LEN, ref.num_candidates, 16, iters, 10)


def small_shape(iters: int) -> BenchShape:
    cfg = HSTUConfig(
        num_items=10_000, d_model=64, num_layers=2, num_heads=2, head_dim=32,
        max_seq_len=256,
    )  # fmt: skip
    return BenchShape("small", cfg, 128, 32, 16, iters, 3)


@dataclass
class StepInputs:
    extend: tuple[torch.Tensor, ...]
    rank: tuple[torch.Tensor, ...]


def make_inputs(shape: BenchShape, batch: int, device: torch.device, seed: int) -> StepInputs:
    """A pool with ``history`` cached tokens per user in shuffled blocks, plus one step."""
    cfg = shape.model
    gen = torch.Generator().manual_seed(seed)
    per_user = -(-(shape.history + 1) // shape.block_size)
    num_blocks = batch * per_user
    pool_shape = (
        cfg.num_layers, 2, num_blocks, shape.block_size, cfg.num_heads, cfg.head_dim,
    )  # fmt: skip
    kv = torch.randn(pool_shape, generator=gen).to(device=device, dtype=cfg.torch_dtype)
    ts_pool = BASE_TS + torch.arange(num_blocks * shape.block_size).view(num_blocks, -1) * 1000
    order = torch.randperm(num_blocks, generator=gen).view(batch, per_user)
    tables = order.to(torch.int32)  # [B, MB]
    lens = torch.full((batch,), shape.history, dtype=torch.int64)
    items = torch.randint(1, cfg.num_items, (batch,), generator=gen)
    actions = torch.randint(1, cfg.num_actions, (batch,), generator=gen)
    ts = torch.full((batch,), BASE_TS + 10**10, dtype=torch.int64)
    offsets = torch.arange(batch + 1, dtype=torch.int64)
    cands = torch.randint(1, cfg.num_items, (batch, shape.candidates), generator=gen)
    pool = [t.to(device) for t in (ts_pool, tables, lens)]
    return StepInputs(
        extend=(*(t.to(device) for t in (items, actions, ts, offsets)), kv, *pool),
        rank=(*(t.to(device) for t in (cands, ts)), kv, *pool),
    )


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-12))


def time_calls(fn: Callable[[], object], shape: BenchShape, device: torch.device) -> list[float]:
    """Milliseconds per call, synchronised, after ``warmup`` untimed calls."""
    for _ in range(shape.warmup):
        fn()
    out = []
    for _ in range(shape.iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append((time.perf_counter() - start) * 1000)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench_batch(
    eager: ServingModel, aoti: AOTIModel, shape: BenchShape, batch: int, device: torch.device
) -> dict[str, object]:
    inputs = make_inputs(shape, batch, device, seed=batch)
    want = (*eager.extend(*inputs.extend), eager.rank(*inputs.rank))
    got = (*aoti.extend(*inputs.extend), aoti.rank(*inputs.rank))
    row: dict[str, object] = {"batch": batch}
    row["max_rel_err"] = max(rel_err(g, w) for g, w in zip(got, want))
    for name, model in (("eager", eager), ("aoti", aoti)):

        def step(m: ServingModel = model) -> None:
            m.extend(*inputs.extend)
            m.rank(*inputs.rank)

        times = time_calls(step, shape, device)
        row[f"{name}_p50_ms"] = statistics.median(times)
        row[f"{name}_p99_ms"] = percentile(times, 0.99)
    row["speedup_p50"] = float(row["eager_p50_ms"]) / float(row["aoti_p50_ms"])  # type: ignore[arg-type]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small CPU-sized model")
    parser.add_argument(
        "--workload", default="HSTU-8L", choices=[w.name for w in REFERENCE_WORKLOADS]
    )
    parser.add_argument("--batch", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--iters", type=int, default=0, help="timed steps (default 50 GPU, 20 CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    iters = args.iters or (50 if device.type == "cuda" else 20)
    shape = small_shape(iters) if args.small else reference_shape(args.workload, iters)
    torch.manual_seed(0)
    model = HSTU(shape.model).to(device=device, dtype=shape.model.torch_dtype).eval()
    tag = json.dumps(asdict(shape.model), sort_keys=True).encode()
    version = "bench-" + hashlib.sha256(tag).hexdigest()[:10]
    start = time.perf_counter()
    package = build_package(
        model, version, CACHE_DIR, ExportConfig(entry_points=("extend", "rank")),
        progress=lambda msg: print(msg, file=sys.stderr, flush=True),
    )  # fmt: skip
    export_s = time.perf_counter() - start
    aoti = load_package(package, device, model, check_values=True)
    rows = []
    with torch.inference_mode():
        for batch in args.batch:
            rows.append(bench_batch(model, aoti, shape, batch, device))
            print(f"batch {batch}: done", file=sys.stderr, flush=True)
    print(
        f"{shape.name} {shape.model.dtype} on {device}: history {shape.history}, 1 new "
        f"token/user, {shape.candidates} candidates/user (ms per extend+rank step)"
    )
    print_table(rows)
    meta: dict[str, object] = {
        "shape": shape.name, "model": asdict(shape.model), "history": shape.history,
        "candidates": shape.candidates, "block_size": shape.block_size, "iters": shape.iters,
        "warmup": shape.warmup, "device": str(device), "export_or_load_s": export_s,
        "package": str(package.directory), "package_timings": package.manifest.get("timings"),
        "attention_backend": model.attention_backend,
    }  # fmt: skip
    suffix = device.type + ("_small" if args.small else "")
    path = write_results(f"aoti_{suffix}", rows, meta)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
