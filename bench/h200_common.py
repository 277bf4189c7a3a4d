"""Shared pieces of the H200 benchmarks: device timing, ceilings, the reference model and a
batch of cached users (``Batch``), and the two full recomputes (dense, and jagged on the
fused prefill kernels)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from bench.reference_config import ReferenceWorkload as Workload
from streamrec.cache.block_pool import NoRoom
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.models.attention import self_attention_term, silu_attention
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU, HSTULayer
from streamrec.models.prefill_attention import fused_prefill_attention, fused_prefill_candidates
from streamrec.models.quantization import kv_storage_dtype, model_precision
from streamrec.pipeline.serving_model import ServingModel
from streamrec.schemas.events import Action

BLOCK_SIZE = 16
BASE_TS = 1_700_000_000_000
Step = Callable[[], Any]
WARM_S = 0.03  # seconds of untimed calls before a timing (time_ms)


# ------------------------------------------------------------------ timing


def time_ms(fn: Step, iters: int, warmup: int = 3) -> list[float]:
    """Per-call device times (CUDA events around each call), after ``warmup`` calls and at
    least ``WARM_S`` of calls: from idle (a compile between two variants) the clocks take
    milliseconds to rise, and a sweep's first variant read 10-15 % slow without it."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < WARM_S:
        fn()
        torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def graphed(fn: Step) -> Step:
    """CUDA-graph capture of ``fn`` (inputs fixed); replay cost is one launch, and each
    replay returns the capture's static output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # captured where it warmed up (AOTI runners)
        out = fn()

    def replay() -> Any:
        graph.replay()
        return out

    return replay


def kernel_profile(step: Callable[[], Any], steps: int = 5, top: int = 12) -> list[dict[str, Any]]:
    """GPU time per kernel name in one eager step (no graph: the profiler names each
    launch), the ``top`` largest: the profile behind a speedup or a slowdown."""
    with torch.inference_mode():
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(event.name[:90], [0.0, 0])
            entry[0] += event.device_time
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"kernel": name, "us": round(t / steps, 1), "calls": int(n) // steps}
            for name, (t, n) in ranked]  # fmt: skip


def ceilings(quick: bool) -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and the bf16 matmul rate, measured now."""
    n = (1 << 28) if quick else (1 << 30)  # bf16 elements: 0.5 or 2 GiB
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = min(time_ms(lambda: dst.copy_(src), 10))
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    mm = pct(time_ms(lambda: a @ b, 10), 50)
    return {
        "copy_gb_s": 2 * n * 2 / copy / 1e6,
        "bf16_tflop_s": 2 * m**3 / mm / 1e9,
    }


# ------------------------------------------------------------------ setup


def build_model(w: Workload, seed: int = 0, device: str = "cuda") -> HSTU:
    cfg = HSTUConfig(
        num_items=w.num_items,
        d_model=w.d_model,
        num_layers=w.num_layers,
        num_heads=w.num_heads,
        head_dim=w.head_dim,
        max_seq_len=w.max_seq_len,
        dtype=w.dtype,
    )
    torch.manual_seed(seed)
    model = HSTU(cfg).eval()
    with torch.no_grad():
        for layer in model.layers:
            assert isinstance(layer, HSTULayer)
            layer.pos_bias.normal_(0, 0.3)
            layer.time_bias.normal_(0, 0.3)
    return model.to(device, cfg.torch_dtype)


class Batch:
    """B users with ``history`` cached tokens each in a paged pool, one new event each,
    and ``C`` candidates each; also the dense tensors a full recompute needs.

    Each user's pool already holds a slot for the new event: ``extend`` reads the first
    ``history`` tokens, its K/V are written into slot ``history`` and ``rank`` then reads
    ``history + 1`` tokens, exactly what the full recompute sees. The pool has the dtype
    of the K/V the model returns (FP8 codes for an FP8-KV model) on the model's device.
    """

    def __init__(self, model: HSTU, batch: int, history: int, cands: int, seed: int) -> None:
        cfg = model.config
        gen = torch.Generator().manual_seed(seed)
        dev = model.item_emb.weight.device
        self.batch, self.history, self.cands = batch, history, cands
        total = history + 1
        per_user = math.ceil(total / BLOCK_SIZE)
        kv_dtype = kv_storage_dtype(model_precision(model), cfg.torch_dtype)
        kv_cfg = KVCacheConfig(cfg.num_layers, cfg.num_heads, cfg.head_dim, BLOCK_SIZE, kv_dtype)
        self.cache = KVCache(kv_cfg, num_blocks=batch * per_user + 8, device=dev)
        self.users = [f"u{i}" for i in range(batch)]
        # Interleave users' blocks so no user's cache is contiguous.
        for _ in range(per_user):
            for u in self.users:
                length = self.cache.pool.length(u) if u in self.cache.pool else 0
                grown = self.cache.pool.append(u, min(BLOCK_SIZE, total - length))
                assert not isinstance(grown, NoRoom)
        if kv_dtype == cfg.torch_dtype:  # (no FP8 normal_; the prefill fills what is read)
            self.cache.kv.normal_(0, 1)
        gaps = torch.randint(1000, 10**7, (batch, history), generator=gen)
        hist_ts = BASE_TS + gaps.cumsum(1)  # [B, L]
        self.hist_ts_all = hist_ts.to(dev)
        self.hist_items = torch.randint(1, cfg.num_items, (batch, history), generator=gen)
        self.hist_actions = torch.randint(1, 4, (batch, history), generator=gen)
        for b, u in enumerate(self.users):
            table = np.asarray(self.cache.pool.block_table(u), dtype=np.int64)
            pos = np.arange(history)
            slots = torch.from_numpy(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            self.cache.ts.view(-1)[slots.to(dev)] = hist_ts[b].to(dev)
        self.refresh_tables()
        self._prefill(model)
        new_slots = [
            self.cache.pool.block_table(u)[history // BLOCK_SIZE] * BLOCK_SIZE
            + history % BLOCK_SIZE
            for u in self.users
        ]
        self.new_slots = torch.tensor(new_slots, dtype=torch.int64, device=dev)  # [B]
        now = hist_ts[:, -1] + 60_000
        self.items = torch.randint(1, cfg.num_items, (batch,), generator=gen).to(dev)
        self.actions = torch.ones(batch, dtype=torch.int64, device=dev)
        self.ts = now.to(dev)
        self.offsets = torch.arange(batch + 1, dtype=torch.int64, device=dev)
        self.cand = torch.randint(1, cfg.num_items, (batch, cands), generator=gen).to(dev)
        self.hist_ts = hist_ts.to(dev)
        self.hist_items = self.hist_items.to(dev)
        self.hist_actions = self.hist_actions.to(dev)

    def _prefill(self, model: HSTU) -> None:
        """The cache holds what a prefill of the histories writes (not random values),
        so the incremental outputs can be compared with the full recompute."""
        hist = self.hist_items.shape[1]
        dev = self.hist_ts_all.device
        offsets = torch.arange(self.batch + 1, device=dev, dtype=torch.int64) * hist
        slots = []
        for u in self.users:
            table = np.asarray(self.cache.pool.block_table(u), dtype=np.int64)
            pos = np.arange(hist)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        with torch.no_grad():
            for lo in range(0, self.batch, 8):  # prefill in chunks: [8, N, D] activations
                hi = min(self.batch, lo + 8)
                k, v, _ = model.prefill(
                    self.hist_items[lo:hi].reshape(-1).to(dev),
                    self.hist_actions[lo:hi].reshape(-1).to(dev),
                    self.hist_ts_all[lo:hi].reshape(-1),
                    offsets[: hi - lo + 1],
                )
                self.cache.write(
                    np.concatenate(slots[lo:hi]), k, v, self.hist_ts_all[lo:hi].reshape(-1)
                )

    def refresh_tables(self) -> None:
        self.tables, self.lens = self.cache.batch_tables(self.users)  # lens = history + 1
        self.ext_lens = self.lens - 1

    def incremental(self, model: ServingModel) -> tuple[torch.Tensor, torch.Tensor]:
        """extend (1 new token/user), write its K/V, rank C candidates (100% hits)."""
        kv, ts_pool = self.cache.kv, self.cache.ts
        k, v, emb = model.extend(
            self.items, self.actions, self.ts, self.offsets, kv, ts_pool, self.tables,
            self.ext_lens,
        )  # fmt: skip
        self.cache.write(self.new_slots, k, v, self.ts)
        scores = model.rank(self.cand, self.ts, kv, ts_pool, self.tables, self.lens)
        return emb, scores


def full_recompute(
    model: HSTU,
    items: torch.Tensor,
    actions: torch.Tensor,
    ts: torch.Tensor,
    cand: torch.Tensor,
    query_ts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """No cache: encode every user's whole history + new token, then rank candidates.

    items, actions, ts [B, L] (history with the new event last); cand [B, C]. Dense
    [B, L] rows of the true length (no padding to max_seq_len), the fairest baseline.
    """
    n = model.config.max_seq_len
    x = model._embed(items, actions)  # [B, L, D]
    xc = model._embed(cand, torch.full_like(cand, int(Action.CANDIDATE)))  # [B, C, D]
    length = items.shape[1]
    pos = torch.arange(length, device=items.device)
    rel = (pos.unsqueeze(1) - pos.unsqueeze(0)).unsqueeze(0)  # [1, L, L]
    dt = ts.unsqueeze(2) - ts.unsqueeze(1)  # [B, L, L]
    mask = (rel >= 0).expand(items.shape[0], -1, -1)  # [B, L, L]
    c_rel = (length - pos).view(1, 1, length)  # [1, 1, L]
    c_dt = (query_ts.unsqueeze(1) - ts).unsqueeze(1)  # [B, 1, L]
    c_mask = torch.ones_like(c_dt, dtype=torch.bool)  # [B, 1, L]
    for layer in model.layers:
        assert isinstance(layer, HSTULayer)
        u, v, q, k = layer.project(x)  # [B, L, H, d]
        attn = silu_attention(q, k, v, model._bias(layer, rel, dt).to(x.dtype), mask, n)
        uc, vc, qc, kc = layer.project(xc)  # [B, C, H, d]
        cb = model._bias(layer, c_rel, c_dt).to(x.dtype)  # [B, H, 1, L]
        cattn = silu_attention(qc, k, v, cb, c_mask, n)
        cattn = cattn + self_attention_term(qc, kc, vc, layer.bias0(), n)
        x = layer.output(x, u, attn)
        xc = layer.output(xc, uc, cattn)
    emb = F.normalize(model.norm_out(x[:, -1]), dim=-1)
    return emb, torch.sigmoid(model.task_head(model.norm_out(xc)))


def fused_recompute_layer(
    layer: HSTULayer,
    x: torch.Tensor,
    xc: torch.Tensor,
    ts: torch.Tensor,
    offsets: torch.Tensor,
    query_ts: torch.Tensor,
    edges: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of ``fused_recompute``: x [T, D] jagged histories, xc [B, C, D] candidates.

    Tensors and the layer only (the divisor N = max_seq_len is the row count of
    ``pos_bias``), so one ``torch.compile(dynamic=True)`` of it serves every layer, batch
    and workload.
    """
    n = layer.pos_bias.shape[0]
    u, v, q, k = layer.project(x)  # [T, H, d]
    attn = fused_prefill_attention(q, k, v, ts, offsets, layer.pos_bias, layer.time_bias, edges, n)
    uc, vc, qc, kc = layer.project(xc)  # [B, C, H, d]
    cattn = fused_prefill_candidates(
        qc, kc, vc, query_ts, k, v, ts, offsets, layer.pos_bias, layer.time_bias, edges, n
    )
    return layer.output(x, u, attn), layer.output(xc, uc, cattn)


def fused_recompute(
    model: HSTU,
    items: torch.Tensor,
    actions: torch.Tensor,
    ts: torch.Tensor,
    offsets: torch.Tensor,
    cand: torch.Tensor,
    query_ts: torch.Tensor,
    layer_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = fused_recompute_layer,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``full_recompute`` on the fused kernels: jagged tokens, no [B, L, L] temporaries.

    items, actions, ts [T] (each user's history with the new event last); offsets [B+1];
    cand [B, C]; query_ts [B] (the new event's timestamp). ``layer_fn`` may be a compiled
    ``fused_recompute_layer``.
    """
    edges: torch.Tensor = model.time_edges  # type: ignore[assignment]
    x = model._embed(items, actions)  # [T, D]
    xc = model._embed(cand, torch.full_like(cand, int(Action.CANDIDATE)))  # [B, C, D]
    for layer in model.layers:
        assert isinstance(layer, HSTULayer)
        x, xc = layer_fn(layer, x, xc, ts, offsets, query_ts, edges)
    last = offsets[1:] - 1  # [B]: every user has at least the new event
    emb = F.normalize(model.norm_out(x[last]), dim=-1)
    return emb, torch.sigmoid(model.task_head(model.norm_out(xc)))
