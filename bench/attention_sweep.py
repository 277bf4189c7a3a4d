"""The fused attention kernels alone on one HSTU-8L layer's paged pool (issue 8, 13, 14).

``h200_bench --sections kernel`` calls ``sweep_batch`` once per batch size; each call
times, in CUDA-graph replay (device time only):

- ``extend``: the decode kernel for n = 1, 4, 16 new tokens per user (each token against
  its user's 2,048 cached keys and the user's new keys up to itself): at n = 1 the
  one-token body, its launch shapes swept; at n = 4, 16 the tensor-core chunks (a user's
  tokens share each cached key tile), their shape swept (launch ``...-m16n16``: tokens
  per chunk, keys per tile). ``kv_pct_copy`` is one read of every user's cached K/V
  against the measured copy bandwidth (the decode target, ≥ 85 % at batch 64).
- ``rank``: the key-bias and candidate kernels (256 candidates per user, their own key
  folded in), launch shapes swept; ``tflop_s`` counts the two GEMMs (the target, ≥ 400
  at batch 64).
- ``extend_step_1layer`` / ``rank_step_1layer``: the model's whole step on this 1-layer
  model with the layer halves (LayerNorm + GEMM + SiLU, the output tail) fused or not:
  device time and the number of kernels launched.
- ``baseline`` rows (with ``--baseline-kernels``): the previous kernels as the model used
  them, in the same run: the old decode kernel plus the dense ``[T, T]`` new-token
  attention for extend (or, given a later ``paged_attention.py`` whose decode kernel
  takes the new tokens itself, that kernel alone); the old candidate kernel plus the
  separate self term for rank (that file's, when it has one).

Each row carries the relative error of its output against the fp32 dense reference.
The model is HSTU-8L's layer shape with one layer and a small catalog: the kernels read
one layer's pool, so the other seven layers and the 1M-item table would only cost
set-up time.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.h200_common import Batch, build_model, graphed, pct, time_ms
from bench.reference_config import HSTU_8L, SPEEDUP_HISTORY_LEN
from streamrec.models import candidate_attention as ca
from streamrec.models import fused_layer as fl
from streamrec.models import multi_query_attention as mqa
from streamrec.models import paged_attention as pa
from streamrec.models.attention import self_attention_term
from streamrec.models.hstu import HSTU, HSTULayer, NewTokenGeometry

NEW_TOKENS = (1, 4, 16)
# ts_pool, block_tables, cached_lens, pos_bias, time_bias, edges: every launch's tail
Tail = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# (block_n, warps, target programs, 2-D accumulator[, prefetch[, stages]]); the first is
# the op's default.
EXTEND_VARIANTS: list[tuple[int, ...]] = [
    (pa.DECODE_BLOCK_N, pa.DECODE_WARPS, pa.TARGET_PROGRAMS, pa.DECODE_ACC2D),
    (64, 4, 1024, True), (16, 4, 1024, True), (32, 2, 1024, True), (64, 8, 1024, True),
    (32, 4, 2048, True), (64, 2, 1024, False), (32, 4, 1024, True), (32, 4, 4096, True),
    (64, 4, 4096, True),
    # the next tile's loads before this tile's math (launch suffix x1): 16-key tiles keep
    # 123 registers (4 programs/SM), 32-key ones take 224 (2); kernel_resources --kernel decode
    (16, 4, 1024, True, True), (32, 4, 1024, True, True), (16, 4, 2048, True, True),
    # Triton's pipeline over the one-token loop, 2 and 3 stages (paged_attention.DECODE_STAGES;
    # launch suffix x0x2 / x0x3): 152 registers at 32-key tiles against 128
    (pa.DECODE_BLOCK_N, pa.DECODE_WARPS, pa.TARGET_PROGRAMS, True, False, 2),
    (pa.DECODE_BLOCK_N, pa.DECODE_WARPS, pa.TARGET_PROGRAMS, True, False, 3),
    (16, 4, 1024, True, False, 3),
]  # fmt: skip
# (new tokens, key tile) of the decode kernel's tensor-core chunks, timed at n > 1; the
# first is the op's default (multi_query_attention.py).
CHUNK_VARIANTS: list[tuple[int, int]] = [(mqa.CHUNK_M, mqa.CHUNK_N), (16, 32), (16, 64), (32, 16)]
# (block_m, block_n, warps, stages, target programs); the first is the op's default.
RANK_VARIANTS: list[tuple[int, int, int, int, int]] = [
    (ca.CAND_BLOCK_M, ca.CAND_BLOCK_N, ca.CAND_WARPS, ca.CAND_STAGES, ca.CAND_TARGET_PROGRAMS),
    (128, 64, 8, 3, 256), (128, 32, 8, 2, 256), (128, 128, 8, 2, 256), (64, 64, 4, 3, 256),
    (128, 64, 4, 2, 256), (64, 128, 4, 2, 256), (128, 64, 8, 2, 1024), (256, 32, 8, 2, 256),
]  # fmt: skip


def sweep_model() -> HSTU:
    """HSTU-8L's layer shape (D 512, 4 heads x 128, N 4096, bf16), one layer."""
    return build_model(dataclasses.replace(HSTU_8L, num_layers=1, num_items=4096))


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def _timed(call: Callable[[], torch.Tensor], label: str) -> tuple[torch.Tensor, float] | None:
    """(output, p50 ms of graph replay), or None when the launch does not fit."""
    try:
        out = call()
        return out, pct(time_ms(graphed(call), 20), 50)
    except Exception as exc:  # a launch shape that does not fit (registers, smem)
        print(f"kernel {label}: {type(exc).__name__}: {exc}"[:300])
        torch.cuda.synchronize()
        return None


class SweepLayer:
    """One batch of cached users and the layer-0 tensors every launch takes."""

    def __init__(self, model: HSTU, batch: int) -> None:
        layer = model.layers[0]
        assert isinstance(layer, HSTULayer)
        self.model, self.layer, self.batch = model, layer, batch
        cfg = model.config
        self.heads, self.head_dim, self.n = cfg.num_heads, cfg.head_dim, cfg.max_seq_len
        self.data = Batch(model, batch, SPEEDUP_HISTORY_LEN, HSTU_8L.num_candidates, seed=1)
        self.k_cache, self.v_cache = self.data.cache.kv[0, 0], self.data.cache.kv[0, 1]
        self.device = self.k_cache.device
        edges: torch.Tensor = model.time_edges  # type: ignore[assignment]
        self.edges = edges
        d = self.data
        self.tail: Tail = (d.cache.ts, d.tables, d.lens, layer.pos_bias, layer.time_bias, edges)

    def tail_with(self, lens: torch.Tensor) -> Tail:
        d, layer = self.data, self.layer
        return (d.cache.ts, d.tables, lens, layer.pos_bias, layer.time_bias, self.edges)

    def fp32_tail(self, lens: torch.Tensor) -> tuple[Any, ...]:
        d, layer = self.data, self.layer
        return (
            self.k_cache.float(), self.v_cache.float(), d.cache.ts, d.tables, lens,
            layer.pos_bias.float(), layer.time_bias.float(), self.edges, self.n,
        )  # fmt: skip

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=self.k_cache.dtype)


def extend_inputs(lay: SweepLayer, n: int) -> dict[str, torch.Tensor]:
    """n new tokens per user after its 2,048 cached ones: positions, timestamps, owners."""
    batch = lay.batch
    g = batch * n
    users = torch.arange(batch, device=lay.device).repeat_interleave(n)  # [G]
    slot = torch.arange(g, device=lay.device) % n
    ext_lens = lay.data.ext_lens
    return {
        "q": lay.randn(g, lay.heads, lay.head_dim),
        "k": lay.randn(g, lay.heads, lay.head_dim),
        "v": lay.randn(g, lay.heads, lay.head_dim),
        "users": users,
        "first": users * n,
        "pos": ext_lens[users] + slot,
        "ts": lay.data.ts[users] + slot * 1000,
        "lens": ext_lens,
    }


def extend_rows(
    lay: SweepLayer, ceil: dict[str, float], baseline: Any, quick: bool
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    hd = lay.heads * lay.head_dim
    for n in NEW_TOKENS:
        x = extend_inputs(lay, n)
        g = x["q"].shape[0]
        users_ref = max(1, min(lay.batch, 128 // n))
        sub = users_ref * n  # whole users, so their own keys are all inside the slice
        ref = pa.paged_silu_attention_reference(
            x["q"][:sub].float(), x["pos"][:sub], x["ts"][:sub], x["users"][:sub],
            x["first"][:sub], x["k"][:sub].float(), x["v"][:sub].float(),
            *lay.fp32_tail(x["lens"]),
        )  # fmt: skip
        kv_bytes = int(x["lens"].sum()) * hd * 2 * 2  # K and V of one layer, bf16
        flops = 4.0 * g * (SPEEDUP_HISTORY_LEN + (n + 1) / 2) * hd
        head = (x["q"], x["pos"], x["ts"], x["users"], x["first"], x["k"], x["v"])
        body = (lay.k_cache, lay.v_cache, *lay.tail_with(x["lens"]), lay.n)
        calls: list[tuple[str, str, Callable[[], torch.Tensor]]] = []
        if baseline is not None:
            calls.append(("baseline", "previous", _baseline_extend(lay, x, baseline)))
        if n == 1:  # every chunk is one token: the vector body's launch shapes
            variants = EXTEND_VARIANTS[:3] if quick else EXTEND_VARIANTS
            chunks = CHUNK_VARIANTS[:1]
        else:  # the tensor-core chunks' shape at the default vector launch
            variants = EXTEND_VARIANTS[:1]
            chunks = CHUNK_VARIANTS[:2] if quick else CHUNK_VARIANTS
        for var in variants:
            for block_m, chunk_n in chunks:
                launch = "x".join(str(int(v)) for v in var)
                if n > 1:
                    launch += f"-m{block_m}n{chunk_n}"
                calls.append(("triton", launch, _bind(
                    pa.launch_decode, *head, *body, *var[:3], True, var[3], None, block_m,
                    chunk_n, len(var) > 4 and bool(var[4]),
                    int(var[5]) if len(var) > 5 else pa.DECODE_STAGES,
                )))  # fmt: skip
        for impl, launch, call in calls:
            timed = _timed(call, f"extend n={n} {launch}")
            if timed is None:
                continue
            out, ms = timed
            rows.append({
                "section": "kernel", "op": "extend", "batch": lay.batch, "new_tokens": n,
                "impl": impl, "launch": launch, "ms": round(ms, 4),
                "us_per_user": round(1000 * ms / lay.batch, 2),
                "kv_gb_s": round(kv_bytes / ms / 1e6, 1),
                "kv_pct_copy": round(100 * kv_bytes / ms / 1e6 / ceil["copy_gb_s"], 1),
                "tflop_s": round(flops / ms / 1e9, 1),
                "rel_err_vs_fp32": round(_rel_err(out[:sub], ref), 5),
            })  # fmt: skip
    return rows


def _bind(fn: Callable[..., torch.Tensor], *args: Any) -> Callable[[], torch.Tensor]:
    return lambda: fn(*args)


def _baseline_extend(
    lay: SweepLayer, x: dict[str, torch.Tensor], old: Any
) -> Callable[[], torch.Tensor]:
    """What extend did per layer before: the old decode kernel over the cache (fp32 out,
    cast) plus the new tokens among each other as one dense [T, T] over the batch; or,
    for a ``paged_attention.py`` whose decode kernel takes the new tokens itself (b056ebb
    up to the one-program-per-token kernel before the tensor-core chunks), that kernel
    as the op ran it."""
    pos, ts, users = x["pos"], x["ts"], x["users"]
    if "q_start" in inspect.signature(old.launch_decode).parameters:
        head = (x["q"], pos, ts, users, x["first"], x["k"], x["v"])
        return _bind(old.launch_decode, *head, lay.k_cache, lay.v_cache,
                     *lay.tail_with(x["lens"]), lay.n)  # fmt: skip
    rel = (pos.unsqueeze(1) - pos.unsqueeze(0)).unsqueeze(0)  # [1, T, T]
    dt = (ts.unsqueeze(1) - ts.unsqueeze(0)).unsqueeze(0)  # [1, T, T]
    mask = (users.unsqueeze(1) == users.unsqueeze(0)) & (rel[0] >= 0)
    geo = NewTokenGeometry(None, rel, dt, mask.unsqueeze(0))

    def call() -> torch.Tensor:
        cached = old.launch_decode(
            x["q"], pos, ts, users, lay.k_cache, lay.v_cache, *lay.tail_with(x["lens"]), lay.n
        ).to(x["q"].dtype)
        fresh = lay.model._new_token_attention(lay.layer, x["q"], x["k"], x["v"], geo)
        return cached + fresh

    return call


def rank_rows(
    lay: SweepLayer, ceil: dict[str, float], baseline: Any, quick: bool
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    hd = lay.heads * lay.head_dim
    c = HSTU_8L.num_candidates
    shape = (lay.batch, c, lay.heads, lay.head_dim)
    q, k_own, v_own = lay.randn(*shape), lay.randn(*shape), lay.randn(*shape)
    d = lay.data
    users_ref = 1  # 256 queries: the dense fp32 reference gathers the cache per query
    ref = ca.candidate_attention_reference(
        q[:users_ref].float(), k_own[:users_ref].float(), v_own[:users_ref].float(),
        d.lens[:users_ref], d.ts[:users_ref], *lay.fp32_tail(d.lens),
    )  # fmt: skip
    flops = 4.0 * lay.batch * c * (SPEEDUP_HISTORY_LEN + 1) * hd
    head = (q, k_own, v_own, d.lens, d.ts, lay.k_cache, lay.v_cache, *lay.tail, lay.n)
    calls: list[tuple[str, str, Callable[[], torch.Tensor]]] = []
    if baseline is not None:
        bias0 = lay.layer.bias0()

        def old_rank() -> torch.Tensor:
            cached = baseline.launch_candidates(
                q, d.lens, d.ts, lay.k_cache, lay.v_cache, *lay.tail, lay.n
            ).to(q.dtype)
            return cached + self_attention_term(q, k_own, v_own, bias0, lay.n)

        calls.append(("baseline", "previous", old_rank))
    for var in RANK_VARIANTS[:2] if quick else RANK_VARIANTS:
        launch = "x".join(map(str, var))
        calls.append(("triton", launch, _bind(ca.launch_candidates, *head, *var)))
    for impl, launch, call in calls:
        timed = _timed(call, f"rank {launch}")
        if timed is None:
            continue
        out, ms = timed
        rows.append({
            "section": "kernel", "op": "rank", "batch": lay.batch, "impl": impl,
            "launch": launch, "ms": round(ms, 4), "us_per_user": round(1000 * ms / lay.batch, 2),
            "tflop_s": round(flops / ms / 1e9, 1),
            "tflop_pct_peak": round(100 * flops / ms / 1e9 / ceil["bf16_tflop_s"], 1),
            "rel_err_vs_fp32": round(_rel_err(out[:users_ref], ref), 5),
        })  # fmt: skip
    return rows


def _kernel_launches(fn: Callable[[], Any]) -> int:
    """CUDA kernels (and memsets/copies) one eager call of ``fn`` launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_time_total > 0)


def layer_rows(lay: SweepLayer) -> list[dict[str, object]]:
    """One whole 1-layer step (extend of 1 token per user; rank of 256 candidates), the
    layer halves fused or not (issue 14 item 5): device time and kernels launched."""
    rows: list[dict[str, object]] = []
    model, d = lay.model, lay.data
    kv, ts_pool = d.cache.kv, d.cache.ts
    steps: dict[str, Callable[[], Any]] = {
        "extend": lambda: model.extend(
            d.items, d.actions, d.ts, d.offsets, kv, ts_pool, d.tables, d.ext_lens
        ),
        "rank": lambda: model.rank(d.cand, d.ts, kv, ts_pool, d.tables, d.lens),
    }
    for op, step in steps.items():
        for fused in (False, True):
            model.fused_layers = fused
            try:
                launches = _kernel_launches(step)
                ms = pct(time_ms(graphed(step), 20), 50)
            except Exception as exc:  # report and keep the other rows
                print(f"layer step {op} fused={fused}: {type(exc).__name__}: {exc}"[:300])
                torch.cuda.synchronize()
                continue
            rows.append({
                "section": "kernel", "op": f"{op}_step_1layer", "batch": lay.batch,
                "impl": "fused-layers" if fused else "torch-layers", "ms": round(ms, 4),
                "us_per_user": round(1000 * ms / lay.batch, 2), "kernels": launches,
            })  # fmt: skip
    model.fused_layers = True
    return rows


# (block_m, block_n, block_k, warps, stages) of the fused LayerNorm + GEMM kernel.
LAYER_VARIANTS: list[tuple[int, int, int, int, int]] = [
    (fl.LAYER_BLOCK_M, fl.LAYER_BLOCK_N, fl.LAYER_BLOCK_K, fl.LAYER_WARPS, fl.LAYER_STAGES),
    (64, 128, 64, 4, 3), (128, 256, 64, 8, 3), (128, 64, 64, 4, 3),
]  # fmt: skip


def layer_gemm_rows(lay: SweepLayer) -> list[dict[str, object]]:
    """The uvqk half of a layer at rank's row count (B·256 candidates): the fused kernel
    per launch shape against LayerNorm + cuBLAS GEMM + SiLU, TFLOP/s of the GEMM."""
    rows: list[dict[str, object]] = []
    layer = lay.layer
    m = lay.batch * HSTU_8L.num_candidates
    x = lay.randn(m, layer.uvqk.in_features)
    n, lin = layer.norm_in, layer.uvqk
    flops = 2.0 * m * lin.in_features * lin.out_features
    want = torch.nn.functional.silu(lin(n(x)))
    calls: list[tuple[str, str, Callable[[], torch.Tensor]]] = [
        ("torch", "layernorm+addmm+silu", lambda: torch.nn.functional.silu(lin(n(x))))
    ]
    for var in LAYER_VARIANTS:
        calls.append(("triton", "x".join(map(str, var)), _bind(
            fl.launch_norm_linear, x, None, n.weight, n.bias, n.eps, lin.weight, lin.bias,
            None, True, *var,
        )))  # fmt: skip
    for impl, launch, call in calls:
        timed = _timed(call, f"layer project {launch}")
        if timed is None:
            continue
        out, ms = timed
        rows.append({
            "section": "kernel", "op": "layer_project", "batch": lay.batch, "rows": m,
            "impl": impl, "launch": launch, "ms": round(ms, 4),
            "tflop_s": round(flops / ms / 1e9, 1),
            "rel_diff_vs_torch": round(_rel_err(out, want.float()), 5),
        })  # fmt: skip
    return rows


def sweep_batch(
    model: HSTU,
    batch: int,
    ceil: dict[str, float],
    baseline: Any = None,
    quick: bool = False,
    ops: Sequence[str] = ("extend", "rank", "layer"),
) -> list[dict[str, object]]:
    """The extend, rank and layer rows (``ops``) of one batch size (the pool is freed
    afterwards)."""
    lay = SweepLayer(model, batch)
    rows = extend_rows(lay, ceil, baseline, quick) if "extend" in ops else []
    if "rank" in ops:
        rows += rank_rows(lay, ceil, baseline, quick)
    if "layer" in ops:
        rows += layer_rows(lay)
    if "layer" in ops and batch >= 16:  # rank's row counts: where the GEMM is the cost
        rows += layer_gemm_rows(lay)
    del lay
    torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict[str, object]]) -> list[str]:
    """One line per (op, batch, new tokens): the best launch, its ratio to the baseline."""
    groups: dict[tuple[str, int, int], list[dict[str, object]]] = {}
    for row in rows:
        if row.get("section") != "kernel" or row.get("op") not in ("extend", "rank"):
            continue
        key = (str(row["op"]), int(str(row["batch"])), int(str(row.get("new_tokens", 0))))
        groups.setdefault(key, []).append(row)
    lines = []
    steps = [r for r in rows if str(r.get("op", "")).endswith("_step_1layer")]
    for r in steps:
        lines.append(f"{r['op']} batch {r['batch']} {r['impl']}: {r['ms']} ms, "
                     f"{r['kernels']} kernels")  # fmt: skip
    for r in rows:
        if r.get("op") == "layer_project":
            lines.append(f"layer_project batch {r['batch']} {r['impl']} {r['launch']}: "
                         f"{r['ms']} ms, {r['tflop_s']} TFLOP/s")  # fmt: skip
    for (op, batch, n), group in sorted(groups.items()):
        ours = [r for r in group if r["impl"] == "triton"]
        base = [r for r in group if r["impl"] == "baseline"]
        if not ours:
            continue
        best = min(ours, key=lambda r: float(str(r["ms"])))
        figure = (
            f"{best['kv_pct_copy']}% of copy" if op == "extend" else f"{best['tflop_s']} TFLOP/s"
        )
        ratio = ""
        if base:
            ratio = f", {float(str(base[0]['ms'])) / float(str(best['ms'])):.2f}x previous"
        tokens = f" n={n}" if op == "extend" else ""
        lines.append(
            f"best {op}{tokens} batch {batch}: {best['launch']} {best['ms']} ms "
            f"({best['us_per_user']} us/user, {figure}{ratio})"
        )
    return lines
