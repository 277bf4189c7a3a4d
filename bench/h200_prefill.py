"""The fused prefill kernels alone on the H200: the ``op = prefill`` rows of the kernel sweep.

- ``prefill``: causal jagged attention of B users with one history length each (1,000 /
  2,048 / 4,096 tokens) at the HSTU reference shape (H = 4, d = 128, bf16, N = 4,096),
  every launch shape of ``PREFILL_LAUNCHES`` plus the default one with the exact SiLU,
  and the dense torch attention of today's prefill at small batches for context.
  TFLOP/s counts the causal work only: 4·H·d·Σ n(n+1)/2 (two matmuls, 2 FLOPs a MAC).
- ``prefill-candidates``: C = 256 candidates per user over a history of 2,048 (the
  candidate rule of the fused full recompute), a few launch shapes.
- ``prefill-skewed`` (``skewed_rows``): the warm-up's mix, B users of the reference's
  log-normal lengths (median 1,000, capped at 4,096; ``history`` = the batch's median),
  the default launch with the time bias from timestamps and from key positions (-thr),
  -thr at 64x16x4x4, -thr-tr (bucket ranges from thresholds) at 64x16x4x4, 64x32x4x3
  and the default launch, and -r168 (registers capped at 168) at 64x16x4x4 and 64x16x4x3.

q, k, v are strided views of one ``[T, 4, H, d]`` buffer, as the layer's projection leaves
them. Each row checks the first user against the fp32 torch reference. Runs inside
``kernel`` or alone: ``python3 -m bench.h200_bench --sections prefill``; the skewed rows
alone, beside those of an older ``prefill_kernels.py`` (impl "triton-before"):
``python3 -m bench.h200_prefill --out rows.json --before old_prefill_kernels.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
from functools import partial
from types import ModuleType
from typing import Any

import numpy as np
import torch

from bench.h200_common import BASE_TS, graphed, pct, time_ms
from bench.reference_config import HSTU_8L, SPEEDUP_HISTORY_LEN
from streamrec.models import prefill_attention as pfa
from streamrec.models import prefill_kernels as pfk
from streamrec.models.attention import relative_bias, silu_attention, time_bucket_edges

HISTORIES = (1000, 2048, 4096)
BATCHES = (1, 8, 64)
# (BLOCK_M, BLOCK_N, warps, stages, target programs) of the candidate kernel.
CAND_LAUNCHES = (
    (pfk.CAND_BLOCK_M, pfk.CAND_BLOCK_N, pfk.CAND_WARPS, pfk.CAND_STAGES,
     pfk.CAND_TARGET_PROGRAMS),
    (128, 64, 8, 2, 512),
    (64, 32, 4, 2, 512),
    (128, 32, 8, 3, 256),
    (128, 32, 8, 2, 1024),
)  # fmt: skip
# Launch shapes timed with the time bias from key positions besides the default.
THR_LAUNCHES = ((128, 32, 8, 2), (64, 16, 4, 4), (64, 32, 4, 3))
NUM_TIME_BUCKETS = 32  # HSTUConfig's default, as build_model uses


class Layer:
    """One layer's biases at the reference shape, random (non-zero so they count)."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        w = HSTU_8L
        self.heads, self.head_dim, self.n = w.num_heads, w.head_dim, w.max_seq_len
        pos = torch.randn(w.max_seq_len, w.num_heads, generator=gen) * 0.3
        time = torch.randn(NUM_TIME_BUCKETS, w.num_heads, generator=gen) * 0.3
        self.pos_bias = pos.to("cuda", torch.bfloat16)
        self.time_bias = time.to("cuda", torch.bfloat16)
        self.edges = time_bucket_edges(NUM_TIME_BUCKETS, 0.6).cuda()

    def tail_fp32(self) -> tuple[Any, ...]:
        return self.pos_bias.float(), self.time_bias.float(), self.edges, self.n


def _histories(batch: int, history: int, gen: torch.Generator) -> torch.Tensor:
    gaps = torch.randint(1000, 10**7, (batch, history), generator=gen)
    return (BASE_TS + gaps.cumsum(1)).reshape(-1).cuda()  # [T], increasing per user


def _qkv(rows: int, layer: Layer, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """u, v, q, k views [rows, H, d] of one projection buffer (rows 4·H·d apart)."""
    proj = torch.randn(rows, 4, layer.heads, layer.head_dim, generator=gen) * 0.5
    proj = proj.to("cuda", torch.bfloat16)
    return proj[:, 0], proj[:, 1], proj[:, 2], proj[:, 3]


def _time(call: Any, iters: int) -> float:
    """p50 device ms of CUDA-graph replays (a Python launch costs more than small runs)."""
    return pct(time_ms(graphed(call), iters), 50)


def _row(op: str, batch: int, history: int, impl: str, launch: str, ms: float,
         flops: float, err: float) -> dict[str, object]:  # fmt: skip
    return {
        "section": "kernel", "op": op, "batch": batch, "history": history, "impl": impl,
        "launch": launch, "ms": round(ms, 4), "tflop_s": round(flops / ms / 1e9, 1),
        "rel_err_vs_fp32": round(err, 5),
    }  # fmt: skip


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ts: torch.Tensor,
                     batch: int, layer: Layer) -> torch.Tensor:  # fmt: skip
    """Today's prefill attention: [B, H, n, n] scores, bias and mask in HBM."""
    n = q.shape[0] // batch
    shape = (batch, n, layer.heads, layer.head_dim)
    pos = torch.arange(n, device=q.device)
    rel = (pos.unsqueeze(1) - pos.unsqueeze(0)).unsqueeze(0)  # [1, n, n]
    ts_b = ts.view(batch, n)
    dt = ts_b.unsqueeze(2) - ts_b.unsqueeze(1)  # [B, n, n]
    bias = relative_bias(rel, dt, layer.pos_bias, layer.time_bias, layer.edges)
    out = silu_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape), bias, rel >= 0,
                         layer.n)  # fmt: skip
    return out.reshape(q.shape)


def _prefill_rows(layer: Layer, batch: int, history: int, iters: int) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(batch * 7 + history)
    ts = _histories(batch, history, gen)
    _, v, q, k = _qkv(batch * history, layer, gen)
    offsets = torch.arange(batch + 1, device="cuda") * history
    first = slice(0, history)
    ref = pfa.jagged_silu_attention_reference(
        q[first].float(), k[first].float(), v[first].float(), ts[first], offsets[:2],
        *layer.tail_fp32(),
    )  # fmt: skip
    flops = 4.0 * layer.heads * layer.head_dim * batch * history * (history + 1) / 2
    rows = []
    loop = pfk.PREFILL_BUCKET_LOOP
    # (launch, fast SiLU, bucket loop, time bias from key positions)
    variants = [(launch, True, loop, False) for launch in pfk.PREFILL_LAUNCHES]
    variants.append((pfk.PREFILL_LAUNCHES[0], False, loop, False))  # exact SiLU (graphs)
    variants.append((pfk.PREFILL_LAUNCHES[0], True, 32, False))  # the compare loop everywhere
    variants.append((pfk.PREFILL_LAUNCHES[0], True, loop, True))  # "-thr"
    # -thr at smaller tiles: 64x16x4x4 keeps 200 registers and 40 KB, two CTAs per SM
    # (bench/kernel_resources.py), where the 8-warp tiles fit one
    variants += [(launch, True, loop, True) for launch in THR_LAUNCHES]
    for launch, fast, bucket_loop, thresholds in variants:
        bm, bn, warps, stages = launch
        call = partial(
            pfk.launch_prefill, q, k, v, ts, offsets, layer.pos_bias, layer.time_bias,
            layer.edges, layer.n, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
            fast=fast, bucket_loop=bucket_loop, thresholds=thresholds,
        )  # fmt: skip
        name = "x".join(map(str, launch)) + ("" if fast else "-exact-silu")
        name += "" if bucket_loop == loop else f"-loop{bucket_loop}"
        name += "-thr" if thresholds else ""
        try:
            err = _rel_err(call()[first], ref)
            ms = _time(call, iters)
        except Exception as exc:  # a launch shape that does not fit (registers, smem)
            print(f"prefill {name} batch {batch} history {history}: {type(exc).__name__}: "
                  f"{exc}"[:300])  # fmt: skip
            torch.cuda.synchronize()
            continue
        rows.append(_row("prefill", batch, history, "triton", name, ms, flops, err))
    if batch <= 8:  # the dense torch path, for context
        dense = partial(_dense_attention, q, k, v, ts, batch, layer)
        try:
            err = _rel_err(dense()[first], ref)
            rows.append(_row("prefill", batch, history, "torch-dense", "-", _time(dense, iters),
                             flops, err))  # fmt: skip
        except Exception as exc:  # out of memory at the largest shapes
            print(f"prefill torch-dense batch {batch} history {history}: {type(exc).__name__}")
            torch.cuda.empty_cache()
    return rows


def skewed_batch(layer: Layer, batch: int) -> tuple[np.ndarray, tuple[torch.Tensor, ...]]:
    """The warm-up's length mix: B users of the reference's log-normal lengths, timestamps
    increasing within each user. Returns the lengths [B] and (q, k, v [T, H, d], ts [T],
    offsets [B+1]) on the GPU."""
    lengths = HSTU_8L.history_lengths(batch, seed=batch)  # [B]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    gen = torch.Generator().manual_seed(batch)
    gaps = torch.randint(1000, 10**7, (int(bounds[-1]),), generator=gen)
    per_user = [BASE_TS + gaps[a:b].cumsum(0) for a, b in itertools.pairwise(bounds)]
    ts = torch.cat(per_user).cuda()  # [T], increasing within each user
    _, v, q, k = _qkv(int(bounds[-1]), layer, gen)
    return lengths, (q, k, v, ts, torch.from_numpy(bounds).cuda())


def skewed_rows(layer: Layer, batch: int, iters: int,
                kernels: ModuleType = pfk) -> list[dict[str, object]]:  # fmt: skip
    """The default launch on the warm-up's length mix, time bias from timestamps and -thr
    (the kernel rows above give every user one length, so a length-dependent gain shows
    only here). ``kernels``: another copy of ``prefill_kernels`` (a tree before a change,
    loaded from its file) for before/after rows in one process, impl "triton-before"."""
    lengths, (q, k, v, ts, offsets) = skewed_batch(layer, batch)
    first = slice(0, int(lengths[0]))
    ref = pfa.jagged_silu_attention_reference(
        q[first].float(), k[first].float(), v[first].float(), ts[first], offsets[:2],
        *layer.tail_fp32(),
    )  # fmt: skip
    flops = 4.0 * layer.heads * layer.head_dim * float((lengths * (lengths + 1) / 2).sum())
    median = int(np.median(lengths))
    rows = []
    default = pfk.PREFILL_LAUNCHES[0]
    # (launch, thresholds, tile_range, register cap): -tr takes a key tile's bucket range
    # from the query tile's first and last rows of thresholds (PREFILL_TILE_RANGE, on since
    # timed: 1.12x); -r168 caps the registers at 168 (three 4-warp CTAs per SM instead of
    # two; no spills in the sm_90a compile), in this tree only
    thr = THR_LAUNCHES[1]
    variants = [
        (default, False, False, 0),
        (default, True, False, 0),
        (thr, True, False, 0),
        (thr, True, True, 0),
        (THR_LAUNCHES[2], True, True, 0),
        (default, True, True, 0),
    ]
    impl = "triton" if kernels is pfk else "triton-before"
    if kernels is pfk:
        variants += [(thr, True, True, 168), ((64, 16, 4, 3), True, True, 168)]
    for launch, thresholds, tile_range, regs in variants:
        bm, bn, warps, stages = launch
        cap = {"max_registers": regs} if regs else {}
        call = partial(kernels.launch_prefill, q, k, v, ts, offsets, layer.pos_bias,
                       layer.time_bias, layer.edges, layer.n, block_m=bm, block_n=bn,
                       num_warps=warps, num_stages=stages, thresholds=thresholds,
                       tile_range=tile_range, **cap)  # fmt: skip
        name = "x".join(map(str, launch)) + ("-thr" if thresholds else "")
        name += ("-tr" if tile_range else "") + (f"-r{regs}" if regs else "")
        err = _rel_err(call()[first], ref)
        rows.append(_row("prefill-skewed", batch, median, impl, name, _time(call, iters),
                         flops, err))  # fmt: skip
    return rows


def _candidate_rows(layer: Layer, batch: int, iters: int) -> list[dict[str, object]]:
    history, cands = SPEEDUP_HISTORY_LEN + 1, HSTU_8L.num_candidates
    gen = torch.Generator().manual_seed(batch)
    ts = _histories(batch, history, gen)
    _, v, _, k = _qkv(batch * history, layer, gen)
    _, vc, qc, kc = (t.unflatten(0, (batch, cands)) for t in _qkv(batch * cands, layer, gen))
    offsets = torch.arange(batch + 1, device="cuda") * history
    query_ts = ts.view(batch, history)[:, -1].contiguous()
    ref = pfa.jagged_candidate_attention_reference(
        qc[:1].float(), kc[:1].float(), vc[:1].float(), query_ts[:1], k[:history].float(),
        v[:history].float(), ts[:history], offsets[:2], *layer.tail_fp32(),
    )  # fmt: skip
    flops = 4.0 * layer.heads * layer.head_dim * batch * cands * (history + 1)
    rows = []
    for bm, bn, warps, stages, target in CAND_LAUNCHES:
        call = partial(
            pfk.launch_candidates, qc, kc, vc, query_ts, k, v, ts, offsets, layer.pos_bias,
            layer.time_bias, layer.edges, layer.n, block_m=bm, block_n=bn, num_warps=warps,
            num_stages=stages, target_programs=target,
        )  # fmt: skip
        name = f"{bm}x{bn}x{warps}x{stages}x{target}"
        try:
            err = _rel_err(call()[:1], ref)
            ms = _time(call, iters)
        except Exception as exc:
            print(f"prefill-candidates {name} batch {batch}: {type(exc).__name__}: {exc}"[:300])
            torch.cuda.synchronize()
            continue
        rows.append(_row("prefill-candidates", batch, history, "triton", name, ms, flops, err))
    return rows


def prefill_sweep(quick: bool, iters: int) -> list[dict[str, object]]:
    """Rows ``op`` = prefill (histories x batches x launch shapes) and prefill-candidates."""
    layer = Layer(seed=0)
    rows: list[dict[str, object]] = []
    for history in [1000] if quick else HISTORIES:
        for batch in [8] if quick else BATCHES:
            rows += _prefill_rows(layer, batch, history, iters)
            torch.cuda.empty_cache()
    for batch in [8] if quick else BATCHES:
        rows += _candidate_rows(layer, batch, iters)
    best: dict[tuple[str, int, int], dict[str, object]] = {}
    for row in rows:
        key = (str(row["op"]), int(row["batch"]), int(row["history"]))  # type: ignore[call-overload]
        if key not in best or float(row["ms"]) < float(best[key]["ms"]):  # type: ignore[arg-type]
            best[key] = row
    for (op, batch, history), row in sorted(best.items()):
        print(f"best {op} batch {batch} history {history}: {row['impl']} {row['launch']} "
              f"{row['ms']} ms, {row['tflop_s']} TFLOP/s, "
              f"rel err {row['rel_err_vs_fp32']}")  # fmt: skip
    return rows


def _load_kernels(path: str) -> ModuleType:
    """Another copy of ``prefill_kernels`` from its file (a tree before a change)."""
    spec = importlib.util.spec_from_file_location("prefill_kernels_before", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--before {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the prefill-skewed rows at batch 64")
    parser.add_argument("--out", required=True, help="JSON file of the rows")
    parser.add_argument("--before", help="an older prefill_kernels.py, timed beside this one")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    layer = Layer(seed=0)
    rows = skewed_rows(layer, 64, args.iters)
    if args.before and os.path.exists(args.before):
        rows += skewed_rows(layer, 64, args.iters, kernels=_load_kernels(args.before))
    for r in rows:
        print(r["op"], r["batch"], r["history"], r["impl"], r["launch"], r["ms"], r["tflop_s"],
              r["rel_err_vs_fp32"])  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "device": torch.cuda.get_device_name()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
