"""Retrieval top-256 over 1M items x 512 (bf16) on the H200: mm + topk, the fused
kernels and the score scan (what the op runs).

All run inside CUDA graphs (``graphed``: one replay per call), with 16 exclusions per
user and the first 17 rows blocked (the model's padding and OOV rows), as
``HSTU.retrieve`` does. Rows: ``op`` = ``retrieve`` with ``impl`` ``mm_topk``,
``mm_only`` (the GEMM alone: the scan's floor), ``fused`` (``retrieval.launch_retrieval``),
``fused_branch`` or ``fused_masked`` (the same tile with the other append of
``region_append.py``: branched where the default masks, masked where it branches),
``fused_resident`` (``retrieval.resident_config``: the users' tile in shared memory)
or ``scan`` (``score_scan.launch_score_scan``): µs per call and per user, speedup against
mm + topk, TFLOP/s of the GEMM part, how many rows differ from topk's — ties at the k-th
score — and candidates kept per user; then ``retrieve_sweep`` rows: other tile shapes of
the fused kernels at one batch. Target (issue 14): <= 3 µs per user at batch 256.

    python -m bench.retrieval_bench [--batches 1 8 64 256] [--iters 30] [--out DIR]

Writes bench/results/h200_retrieval.json (and DIR/h200_retrieval.json); about a minute
(most of it compiling the kernels of each tile shape). ``--k 1 --dim 64`` (and ``--dim
512``) time the shapes of greedy generation instead (a draft's proposal, the target's
verify of γ + 1 positions per user), into ``h200_retrieval_k1_d64.json`` and so on: which
of the two implementations each should use.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench._report import print_table, write_results
from bench.h200_common import graphed, pct, time_ms
from streamrec.models import retrieval, score_scan
from streamrec.models.topk_merge import MERGE_WINDOW

NUM_ITEMS = 1_000_000
DIM = 512
K = 256
NUM_EXCLUDED = 16
FIRST = 17
# block_b, block_v, block_k, warps, stages, programs per SM, flat, branch (first: default)
SWEEP = (
    (128, 128, 64, 8, 3, 2, False, False),  # the default to the twentieth session
    (128, 128, 64, 8, 3, 2, False, True),
    (128, 256, 64, 8, 3, 2, False, True),  # the default for batches > 64 (21st session)
    (128, 256, 64, 8, 3, 1, False, True),
    (128, 256, 64, 8, 4, 2, False, True),
    (128, 256, 64, 8, 3, 2, True, True),
    (256, 128, 64, 8, 3, 1, False, True),
    (64, 128, 64, 4, 4, 2, True, True),
)  # (the other tile shapes lost in the fourteenth and fifteenth sessions' sweeps)
# block_b, block_v, warps, stages of the resident select (resident_select.py; it lost to
# the tile kernel in the twenty-first session)
RESIDENT_SWEEP = ((128, 32, 8, 3),)
# 1 tile in this many sampled for the threshold, at the batch's default tile shape
EVERY_SWEEP = (16, 8, 4, 2)


def _inputs(table: torch.Tensor, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    dev = table.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    users = F.normalize(torch.randn(batch, table.shape[1], device=dev, generator=gen), dim=-1)
    exclude = torch.randint(0, table.shape[0], (batch, NUM_EXCLUDED), device=dev, generator=gen)
    return users.to(table.dtype), exclude


def _us(fn: Callable[[], Any], iters: int) -> float:
    return pct(time_ms(graphed(fn), iters), 50) * 1000.0


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    return sum(len(set(x.tolist()) - set(y.tolist())) for x, y in zip(a, b))


def batch_rows(
    table: torch.Tensor, batch: int, iters: int, k: int = K
) -> tuple[list[dict[str, object]], float]:
    """The rows of one batch size (mm + topk, mm alone, the fused kernels, the op's score
    scan), and mm + topk's µs per call."""
    users, exclude = _inputs(table, batch, seed=batch)
    rows: list[dict[str, object]] = []
    base = _us(lambda: retrieval.retrieve_reference(users, table, exclude, k, FIRST), iters)
    want = retrieval.retrieve_reference(users, table, exclude, k, FIRST)[1]
    flop = 2.0 * batch * table.shape[0] * table.shape[1]
    default = retrieval.default_config(batch, table.dtype, table.shape[1])
    other = dataclasses.replace(default, branch=not default.branch)  # the other append

    def row(impl: str, us: float, **extra: object) -> dict[str, object]:
        return {"op": "retrieve", "impl": impl, "batch": batch, "us": round(us, 1),
                "us_per_user": round(us / batch, 2), "speedup_vs_mm_topk": round(base / us, 2),
                "tflops": round(flop / us / 1e6, 1), **extra}  # fmt: skip

    rows.append(row("mm_topk", base))
    rows.append(row("mm_only", _us(lambda: users @ table[FIRST:].t(), iters)))
    impls: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {
        "fused": partial(retrieval.launch_retrieval, users, table, exclude, k, FIRST),
        "fused_branch" if other.branch else "fused_masked": partial(
            retrieval.launch_retrieval, users, table, exclude, k, FIRST, other
        ),
        "scan": partial(score_scan.launch_score_scan, users, table, exclude, k, FIRST),
    }
    resident = retrieval.resident_config(batch, table.dtype, table.shape[1])
    if resident is not None:  # the users' tile in shared memory (resident_select.py)
        impls["fused_resident"] = partial(
            retrieval.launch_retrieval, users, table, exclude, k, FIRST, resident
        )
    for impl, run in impls.items():
        try:
            us = _us(run, iters)
            _, got, counts = run()
            rows.append(
                row(impl, us, rows_differ=_differ(got, want),
                    candidates_per_user=round(float(counts.sum(1).float().mean()), 0))
            )  # fmt: skip
        except Exception:  # report and go on: the other rows still count
            traceback.print_exc()
    return rows, base


def sweep_rows(
    table: torch.Tensor, batch: int, iters: int, base_us: float, k: int = K
) -> list[dict[str, object]]:
    users, exclude = _inputs(table, batch, seed=batch)
    runs: list[tuple[str, retrieval.LaunchConfig, int | None]] = []
    for bb, bv, bk, warps, stages, per_sm, flat, branch in SWEEP:
        name = f"B{bb} V{bv} K{bk} w{warps} s{stages} p{per_sm}{' flat' * flat}{' branch' * branch}"
        cfg = retrieval.LaunchConfig(bb, bv, bk, warps, stages, per_sm, flat, branch)
        runs.append((name, cfg, None))
    for bb, bv, warps, stages in RESIDENT_SWEEP:
        name = f"B{bb} V{bv} w{warps} s{stages} resident branch"
        cfg = retrieval.LaunchConfig(bb, bv, 64, warps, stages, 1, branch=True, resident=True)
        runs.append((name, cfg, None))
    default = retrieval.default_config(batch, table.dtype, table.shape[1])
    runs += [(f"default, sample 1 in {every}", default, every) for every in EVERY_SWEEP]
    rows: list[dict[str, object]] = []
    for name, cfg, every in runs:
        try:
            run = partial(
                retrieval.launch_retrieval, users, table, exclude, k, FIRST, cfg, every=every
            )
            us = _us(run, iters)
        except Exception:
            traceback.print_exc()
            continue
        rows.append(
            {"op": "retrieve_sweep", "impl": "fused", "batch": batch, "us": round(us, 1),
             "us_per_user": round(us / batch, 2), "speedup_vs_mm_topk": round(base_us / us, 2),
             "config": name}
        )  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--sweep-batch", type=int, default=256, help="0: no tile sweep")
    parser.add_argument("--out", default=None, help="also write the JSON into this directory")
    parser.add_argument("--k", type=int, default=K, help="items per user")
    parser.add_argument("--dim", type=int, default=DIM, help="embedding width")
    args = parser.parse_args()
    name = (
        "h200_retrieval"
        if (args.k, args.dim) == (K, DIM)
        else (f"h200_retrieval_k{args.k}_d{args.dim}")
    )
    t0 = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    table = F.normalize(torch.randn(NUM_ITEMS, args.dim, device="cuda", generator=gen), dim=-1)
    table = table.bfloat16()
    rows: list[dict[str, object]] = []
    with torch.no_grad():
        base: dict[int, float] = {}
        for batch in args.batches:
            batch_out, base[batch] = batch_rows(table, batch, args.iters, args.k)
            rows += batch_out
            print_table(batch_out)
        if args.sweep_batch:
            sweep_base = base.get(args.sweep_batch, float("nan"))
            rows += sweep_rows(table, args.sweep_batch, args.iters, sweep_base, args.k)
    meta: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "shape": {"items": NUM_ITEMS, "dim": args.dim, "k": args.k, "excluded": NUM_EXCLUDED},
        "dtype": "bfloat16",
        "launch": {
            "default": {
                b: str(retrieval.default_config(b, torch.bfloat16, args.dim)) for b in args.batches
            },
            "sample_every": retrieval.sample_every(args.k),
            "merge_window": MERGE_WINDOW,
        },
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    path = write_results(name, rows, meta)
    if args.out:
        write_results(name, rows, meta, Path(args.out))
    print(f"wrote {path}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
