"""FP8 serving against bf16 on the H200, one run (issue 18): capacity, kernels, step.

- ``capacity``: users of 2,048 tokens an HSTU-8L pool of 100 GiB holds (the pool is sized
  by bytes per block, so this is exact arithmetic; target >= 1.9x).
- ``decode``: the decode kernel alone on one HSTU-8L layer's pool (1 new token per user,
  2,048 cached each), bf16 pool against e4m3 codes, at batch 64 and 256: p50 of CUDA-graph
  replay, K/V bytes read per second (target: >= 1.6x faster at batch 64). A few launch
  shapes per dtype; the speedup row compares the best of each.
- ``rank``: the candidate kernels (256 candidates per user) on the same pools.
- ``step``: the whole incremental step of HSTU-8L (extend, cache write, rank; 1M items)
  replayed from a CUDA graph, bf16 against FP8 KV, FP8 weights and both (target: >= 1.3x
  at batch 64); each variant's user embeddings against bf16's (the quantization error).

Rows ``{op, batch, variant, speedup_vs_bf16, ...}`` go to ``bench/results/h200_fp8.json``
(and ``$OUT``); a short table is printed last. Every part is guarded: an error is printed
and the run goes on. ``--smoke`` runs the same calls at toy shapes on the CPU (with
``TRITON_INTERPRET=1`` and the Triton venv the kernels run on the interpreter).

    python3 -m bench.fp8_bench                 # H200, ~1-2 min
    TRITON_INTERPRET=1 PYTHONPATH=$PWD /work/triton-venv/bin/python -m bench.fp8_bench --smoke
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.h200_common import Batch, build_model, ceilings, graphed, kernel_profile, pct, time_ms
from bench.reference_config import HSTU_8L, SPEEDUP_HISTORY_LEN, ReferenceWorkload
from streamrec.cache.capacity import capacity_report
from streamrec.cache.kv_cache import KVCacheConfig
from streamrec.models import candidate_attention as ca
from streamrec.models import paged_attention as pa
from streamrec.models.fp8 import FP8, power_of_two_scale, quantize
from streamrec.models.hstu import HSTU, HSTULayer
from streamrec.models.quantization import apply_precision
from streamrec.models.serving_precision import ServingPrecision

RESULTS = Path(__file__).parent / "results" / "h200_fp8.json"
GIB = 2**30
BATCHES = (64, 256)
STEP_VARIANTS = (
    ("fp8 kv", ServingPrecision(kv_dtype="fp8_e4m3")),
    ("fp8 weights", ServingPrecision(weight_dtype="fp8")),
    ("fp8 kv + weights", ServingPrecision(kv_dtype="fp8_e4m3", weight_dtype="fp8")),
)
# (block_n, warps, target programs, 2-D accumulator): the op's default first; an e4m3
# tile is half the bytes, so wider key tiles are tried too. (Each is one Triton compile
# per dtype: the list stays short to keep the run within two minutes.)
DECODE_LAUNCHES = [
    (pa.DECODE_BLOCK_N, pa.DECODE_WARPS, pa.TARGET_PROGRAMS, pa.DECODE_ACC2D),
    (64, 4, 1024, True), (64, 8, 1024, True),
    # e4m3 read at 43 % of the copy rate with the bf16 shape (H200, 2026-12-01): more
    # bytes in flight per program, and more programs
    (128, 4, 1024, True), (64, 4, 2048, True),
    # the next tile's loads before this tile's math (paged_attention.DECODE_PREFETCH): the
    # e4m3 one-token body waits on its loads (3 programs/SM, 8 KB per tile)
    (16, 4, 1024, True, True), (32, 4, 1024, True, True),
    # Triton's own pipeline over that loop, 3 stages (paged_attention.DECODE_STAGES)
    (pa.DECODE_BLOCK_N, pa.DECODE_WARPS, pa.TARGET_PROGRAMS, True, False, 3),
    (16, 4, 1024, True, False, 3),
]  # fmt: skip
# (block_m, block_n, warps, stages, target programs)
RANK_LAUNCHES = [
    (ca.CAND_BLOCK_M, ca.CAND_BLOCK_N, ca.CAND_WARPS, ca.CAND_STAGES, ca.CAND_TARGET_PROGRAMS),
    (128, 128, 8, 2, 256), (128, 64, 8, 2, 256),
    # the FP8 launch with a third stage (its block-table loads copied asynchronously, as
    # the third stage did for bf16's 64x64x4x3; sm_90a: 623 SASS, 129 KB shared)
    (128, 128, 8, 3, 256),
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a run uses: the H200 shapes, or toy ones on the CPU (``--smoke``)."""

    workload: ReferenceWorkload
    batches: tuple[int, ...]
    history: int
    cands: int
    device: str
    iters: int = 20

    @classmethod
    def for_run(cls, smoke: bool) -> Setup:
        if not smoke:
            return cls(HSTU_8L, BATCHES, SPEEDUP_HISTORY_LEN, HSTU_8L.num_candidates, "cuda")
        toy = dataclasses.replace(
            HSTU_8L, num_layers=2, d_model=64, num_heads=2, head_dim=32, max_seq_len=128,
            num_items=300, num_candidates=5, dtype="float32", history_median=40,
        )  # fmt: skip
        return cls(toy, (2, 3), 40, 5, "cpu", iters=1)


def interpreter_scalars() -> None:
    """The Triton interpreter's numpy-2 scalar patch of the kernel tests, for ``--smoke``."""
    from types import SimpleNamespace

    from tests.triton_interpreter import patch_scalars

    patch_scalars(SimpleNamespace(setattr=setattr))  # type: ignore[arg-type]


def timed_ms(fn: Callable[[], Any], setup: Setup) -> float:
    """p50 ms of CUDA-graph replay on the GPU; one wall-clock call on the CPU."""
    if setup.device == "cuda":
        return pct(time_ms(graphed(fn), setup.iters), 50)
    start = time.perf_counter()
    fn()
    return 1000.0 * (time.perf_counter() - start)


def guarded(name: str, fn: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    try:
        return fn()
    except Exception as exc:  # report and go on: one failed part must not cost the run
        print(f"{name} failed: {type(exc).__name__}: {exc}"[:600])
        traceback.print_exc(limit=4)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return []


def model_for(setup: Setup, layers: int | None = None) -> HSTU:
    """The workload's model (seeded: two calls give the same weights) on the device."""
    w = setup.workload
    if layers is not None:
        w = dataclasses.replace(w, num_layers=layers, num_items=4096)
    return build_model(w, device=setup.device)


# ------------------------------------------------------------------ capacity


def capacity_rows(setup: Setup) -> list[dict[str, Any]]:
    w = setup.workload
    users = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", FP8)):
        kv = KVCacheConfig(w.num_layers, w.num_heads, w.head_dim, 16, dtype)
        users[name] = capacity_report(kv, SPEEDUP_HISTORY_LEN, 100 * GIB)[0].users or 0
    return [{
        "op": "capacity", "batch": None, "variant": "fp8 kv",
        "speedup_vs_bf16": round(users["fp8"] / users["bf16"], 3),
        "history_len": SPEEDUP_HISTORY_LEN, "users_per_100gib_bf16": users["bf16"],
        "users_per_100gib_fp8": users["fp8"],
    }]  # fmt: skip


# ------------------------------------------------------------------ kernels


def _fp8_layer(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One layer's bf16 pool -> e4m3 codes and [2, H] power-of-two scales (per head)."""
    scale = torch.stack(
        [power_of_two_scale(t.float().abs().amax(dim=(0, 1, 3))) for t in (k, v)]
    )  # [2, H]
    per = scale[:, None, None, :, None]
    return quantize(k, per[0]).contiguous(), quantize(v, per[1]).contiguous(), scale


def _best(label: str, calls: list[tuple[str, Callable[[], torch.Tensor]]], setup: Setup,
          ref: torch.Tensor, sub: int) -> dict[str, Any] | None:  # fmt: skip
    """Fastest launch of ``calls`` (label, fn) with its error on the first ``sub`` rows."""
    best: dict[str, Any] | None = None
    for launch, call in calls:
        try:
            out = call()
            ms = timed_ms(call, setup)
        except Exception as exc:  # a launch shape that does not fit (registers, smem)
            print(f"{label} {launch}: {type(exc).__name__}: {exc}"[:300])
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            continue
        err = float((out[:sub].float() - ref).norm() / ref.norm())
        print(f"{label} {launch}: {ms:.4f} ms, rel err vs fp32 {err:.2e}")
        if best is None or ms < best["ms"]:
            best = {"launch": launch, "ms": ms, "rel_err_vs_fp32": err}
    return best


def kernel_rows(setup: Setup, ceil: dict[str, float]) -> list[dict[str, Any]]:
    model = model_for(setup, layers=1)
    layer = model.layers[0]
    assert isinstance(layer, HSTULayer)
    cfg = model.config
    hd = cfg.num_heads * cfg.head_dim
    edges: torch.Tensor = model.time_edges  # type: ignore[assignment]
    rows: list[dict[str, Any]] = []
    for batch in setup.batches:
        data = Batch(model, batch, setup.history, setup.cands, seed=1)
        k_b, v_b = data.cache.kv[0, 0], data.cache.kv[0, 1]  # [NB, BS, H, d]
        k_8, v_8, scale = _fp8_layer(k_b, v_b)
        lens, dev, dtype = data.ext_lens, k_b.device, k_b.dtype
        tail = (data.cache.ts, data.tables, lens, layer.pos_bias, layer.time_bias, edges)
        users = torch.arange(batch, device=dev)
        q = torch.randn(batch, cfg.num_heads, cfg.head_dim, device=dev, dtype=dtype)
        kn, vn = torch.randn_like(q), torch.randn_like(q)
        head = (q, lens[users], data.ts, users, users, kn, vn)
        sub, rsub = min(batch, 64), min(batch, 4)
        deq = (k_8.float() * scale[0, :, None], v_8.float() * scale[1, :, None])
        pb, tb, n = layer.pos_bias.float(), layer.time_bias.float(), cfg.max_seq_len
        ref = {  # fp32 math on each pool's own values, first ``sub`` users
            name: pa.paged_silu_attention_reference(
                q[:sub].float(), lens[:sub], data.ts[:sub], users[:sub], users[:sub],
                kn[:sub].float(), vn[:sub].float(), *values, data.cache.ts, data.tables,
                lens, pb, tb, edges, n,
            )
            for name, values in (("bf16", (k_b.float(), v_b.float())), ("fp8", deq))
        }  # fmt: skip
        found = {}
        for name, pool, kv_scale in (("bf16", (k_b, v_b), None), ("fp8", (k_8, v_8), scale)):
            calls = [
                ("x".join(str(int(x)) for x in var),
                 _bind(pa.launch_decode, *head, *pool, *tail, cfg.max_seq_len, *var[:3], True,
                       var[3], kv_scale=kv_scale, prefetch=len(var) > 4 and bool(var[4]),
                       stages=int(var[5]) if len(var) > 5 else pa.DECODE_STAGES))
                for var in DECODE_LAUNCHES
            ]  # fmt: skip
            found[name] = _best(f"decode {name} batch {batch}", calls, setup, ref[name], sub)
        rows += _speedup_rows("decode", batch, found, int(lens.sum()) * hd * 2, ceil)
        del ref
        cands = torch.randn(batch, setup.cands, cfg.num_heads, cfg.head_dim, device=dev,
                            dtype=dtype)  # fmt: skip
        own_k, own_v = torch.randn_like(cands), torch.randn_like(cands)
        found = {}
        for name, pool, kv_scale in (("bf16", (k_b, v_b), None), ("fp8", (k_8, v_8), scale)):
            deq_pool = (k_b.float(), v_b.float()) if kv_scale is None else deq
            # (the candidate reference gathers [C, N, H, d] per user: ~1 GiB each)
            want = ca.candidate_attention_reference(
                cands[:rsub].float(), own_k[:rsub].float(), own_v[:rsub].float(),
                lens[:rsub], data.ts[:rsub], *deq_pool, data.cache.ts, data.tables[:rsub],
                lens[:rsub], pb, tb, edges, n,
            )  # fmt: skip
            calls = [
                ("x".join(map(str, var)) + ("" if f16 or kv_scale is None else "-bf16dots"),
                 _bind(ca.launch_candidates, cands, own_k, own_v, lens, data.ts, *pool,
                       *tail, cfg.max_seq_len, *var, kv_scale=kv_scale, fp16_dots=f16))
                for var in RANK_LAUNCHES
                for f16 in ((True, False) if kv_scale is not None else (True,))
            ]  # fmt: skip
            found[name] = _best(f"rank {name} batch {batch}", calls, setup, want, rsub)
            del want
        rows += _speedup_rows("rank", batch, found, int(lens.sum()) * hd * 2, ceil)
        del data, k_8, v_8
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def _bind(fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> Callable[[], Any]:
    return lambda: fn(*args, **kwargs)


def _speedup_rows(
    op: str, batch: int, found: dict[str, dict[str, Any] | None], elements: int,
    ceil: dict[str, float],
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per op and batch: the best launch of each dtype, K/V bytes per second."""
    bf16, fp8 = found.get("bf16"), found.get("fp8")
    if bf16 is None or fp8 is None:
        return []
    row: dict[str, Any] = {
        "op": op, "batch": batch, "variant": "fp8 kv",
        "speedup_vs_bf16": round(bf16["ms"] / fp8["ms"], 3),
    }  # fmt: skip
    for name, best, elem in (("bf16", bf16, 2), ("fp8", fp8, 1)):
        gb_s = elements * elem / best["ms"] / 1e6
        row.update({
            f"{name}_ms": round(best["ms"], 4), f"{name}_launch": best["launch"],
            f"{name}_kv_gb_s": round(gb_s, 1),
            f"{name}_kv_pct_copy": round(100 * gb_s / ceil["copy_gb_s"], 1),
            f"{name}_rel_err_vs_fp32": round(best["rel_err_vs_fp32"], 5),
        })  # fmt: skip
    return [row]


# ------------------------------------------------------------------ step


def step_rows(setup: Setup) -> list[dict[str, Any]]:
    """The whole incremental step per variant, each on its own pool (filled by its own
    prefill of the same histories); user embeddings compared with bf16's."""
    base = model_for(setup)
    models = {"bf16": base}
    for name, precision in STEP_VARIANTS:
        try:
            models[name] = apply_precision(copy.deepcopy(base), precision)
        except Exception as exc:  # e.g. out of memory: the other variants still run
            print(f"step {name}: {type(exc).__name__}: {exc}"[:300])
    rows: list[dict[str, Any]] = []
    kernels: dict[str, list[dict[str, Any]]] = {}
    for batch in setup.batches:
        results: dict[str, tuple[float, torch.Tensor]] = {}
        for name, model in models.items():
            try:
                data = Batch(model, batch, setup.history, setup.cands, seed=2)
                step = partial(data.incremental, model)
                with torch.inference_mode():
                    emb, _ = step()
                    ms = timed_ms(step, setup)
                results[name] = (ms, emb.float())
                print(f"step {name} batch {batch}: {ms:.3f} ms")
                if setup.device == "cuda" and batch == setup.batches[0]:
                    kernels[name] = kernel_profile(step)
                del data, step
            except Exception as exc:  # report and go on with the other variants
                print(f"step {name} batch {batch}: {type(exc).__name__}: {exc}"[:400])
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        if "bf16" not in results:
            continue
        bf16_ms, bf16_emb = results["bf16"]
        for name, (ms, emb) in results.items():
            if name == "bf16":
                continue
            err = float((emb - bf16_emb).norm() / bf16_emb.norm())
            rows.append({
                "op": "step", "batch": batch, "variant": name,
                "speedup_vs_bf16": round(bf16_ms / ms, 3), "bf16_ms": round(bf16_ms, 3),
                "fp8_ms": round(ms, 3), "user_emb_rel_err_vs_bf16": round(err, 4),
            })  # fmt: skip
    for name, top in kernels.items():  # where each variant's step time goes (batch 64)
        print(f"step kernels {name} batch {setup.batches[0]} (us per step, calls):")
        for entry in top:
            print(f"  {entry['us']:9.1f} {entry['calls']:4d}  {entry['kernel']}")
        rows.append({"op": "step_kernels", "batch": setup.batches[0], "variant": name,
                     "speedup_vs_bf16": None, "kernels": top})  # fmt: skip
    return rows


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="toy shapes on the CPU")
    parser.add_argument("--sections", nargs="+", default=["capacity", "kernel", "step"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    setup = Setup.for_run(args.smoke)
    started = time.perf_counter()
    if args.smoke and os.environ.get("TRITON_INTERPRET") == "1":
        interpreter_scalars()
    ceil = {"copy_gb_s": float("nan")}
    if setup.device == "cuda":
        ceil = (guarded("ceilings", lambda: [ceilings(quick=True)]) or [ceil])[0]
    rows: list[dict[str, Any]] = []
    if "capacity" in args.sections:
        rows += guarded("capacity", lambda: capacity_rows(setup))
    if "kernel" in args.sections:
        rows += guarded("kernel", lambda: kernel_rows(setup, ceil))
    if "step" in args.sections:
        rows += guarded("step", lambda: step_rows(setup))
    payload = {
        "device": torch.cuda.get_device_name() if setup.device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__, "copy_gb_s": ceil.get("copy_gb_s"), "rows": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    # (toy figures of a smoke run stay out of bench/results/)
    out = Path(tempfile.gettempdir(), "h200_fp8_smoke.json") if args.smoke else args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=2) + "\n"
    out.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_text(text)
    shown = ("_ms", "_gb_s", "_100gib_bf16", "_100gib_fp8", "_vs_bf16")
    print(f"\n{'op':<9}{'batch':>6}  {'variant':<18}{'speedup':>9}  detail")
    for row in rows:
        detail = {k: v for k, v in row.items() if k.endswith(shown) and k != "speedup_vs_bf16"}
        if row["speedup_vs_bf16"] is None:
            continue
        print(f"{row['op']:<9}{row['batch'] or '-':>6}  {row['variant']:<18}"
              f"{row['speedup_vs_bf16']:>8.2f}x  {detail}")  # fmt: skip
    print(f"wrote {out} ({payload['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
