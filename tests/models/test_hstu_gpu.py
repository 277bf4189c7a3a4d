"""Exactness of incremental inference on CUDA (issue 3, acceptance 2), fp32 and bf16.

The same three checks as the CPU tests, on the real KV cache (``streamrec.cache``) and
with the fused Triton kernels in the attention: prefill(history) equals prefill(prefix)
followed by extends of 0..40 tokens per user (K/V and user embeddings), rank over the incremental
cache equals rank over a cache built by full recompute, and rank leaves the cache bytes
unchanged. The observed errors are printed (run with ``-s``) and recorded in
BENCHMARKS.md; the tolerances are the ones chosen there.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from streamrec.cache.block_pool import NoRoom
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.schemas.events import NUM_ACTIONS

# Relative error bounds: fp32 on the GPU (IEEE dots in the kernels, no TF32) and bf16,
# where both paths round every intermediate to 8 mantissa bits.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
BLOCK_SIZE = 16


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def _model(dtype: str) -> HSTU:
    cfg = HSTUConfig(
        num_items=2_000,
        d_model=128,
        num_layers=3,
        num_heads=2,
        head_dim=64,
        max_seq_len=512,
        num_time_buckets=32,
        dtype=dtype,
    )
    torch.manual_seed(0)
    model = HSTU(cfg).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.pos_bias.normal_(0, 0.5)
            layer.time_bias.normal_(0, 0.5)
    return model.to("cuda", cfg.torch_dtype)


def _jagged(hist: list[np.ndarray], lens: list[int], start: list[int]) -> tuple[torch.Tensor, ...]:
    rows = np.concatenate([h[s : s + n] for h, s, n in zip(hist, start, lens)])  # [T, 3]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    t = torch.from_numpy(rows.T.copy()).cuda()
    return t[0], t[1], t[2], torch.from_numpy(offsets).cuda()


def _write(cache: KVCache, users: list[str], counts: list[int], k, v, ts) -> None:
    slots = []
    for user, n in zip(users, counts):
        got = cache.pool.append(user, n)
        assert not isinstance(got, NoRoom)
        slots.append(np.asarray(got, dtype=np.int64))
    cache.write(np.concatenate(slots), k, v, ts)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@torch.inference_mode()
def test_incremental_equals_full_recompute_on_cuda(dtype: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _model(dtype)
    cfg = model.config
    rng = random.Random(1)
    gen = np.random.default_rng(1)
    num_users = 8
    full = [rng.randint(40, cfg.max_seq_len) for _ in range(num_users)]
    full[0], full[1] = cfg.max_seq_len, 5 * BLOCK_SIZE
    hist = []
    for n in full:
        ts = 1_700_000_000_000 + np.cumsum(gen.integers(0, 10**7, n))
        items = gen.integers(cfg.first_item_row, cfg.num_items, n)
        hist.append(np.stack([items, gen.integers(1, NUM_ACTIONS, n), ts], 1).astype(np.int64))
    prefix = [rng.randint(1, n - 1) for n in full]
    prefix[1] = 3 * BLOCK_SIZE
    users = [f"u{b}" for b in range(num_users)]
    kv_cfg = KVCacheConfig(cfg.num_layers, cfg.num_heads, cfg.head_dim, BLOCK_SIZE, cfg.torch_dtype)
    blocks = num_users * (cfg.max_seq_len // BLOCK_SIZE + 1)
    inc = KVCache(kv_cfg, blocks, "cuda")
    items, actions, ts, offsets = _jagged(hist, prefix, [0] * num_users)
    k, v, _ = model.prefill(items, actions, ts, offsets)
    _write(inc, users, prefix, k, v, ts)

    done, emb_err = list(prefix), 0.0
    while done != full:
        # 1..40 new tokens per user in one call (a backlog), and users with none
        step = [min(n - d, rng.choice([0, 1, 1, 2, 5, 17, 40])) for d, n in zip(done, full)]
        if not any(step):
            continue
        items, actions, ts, offsets = _jagged(hist, step, done)
        tables, lens = inc.batch_tables(users)
        k, v, user_emb = model.extend(items, actions, ts, offsets, inc.kv, inc.ts, tables, lens)
        _write(inc, users, step, k, v, ts)
        moved = [b for b in range(num_users) if step[b]]
        for b in moved:
            done[b] += step[b]
        ref = model.prefill(
            *_jagged([hist[b] for b in moved], [done[b] for b in moved], [0] * len(moved))
        )[2]
        emb_err = max(emb_err, rel_err(user_emb[moved], ref))
        idle = [b for b in range(num_users) if not step[b]]
        assert torch.equal(user_emb[idle], torch.zeros_like(user_emb[idle]))

    items, actions, ts, offsets = _jagged(hist, full, [0] * num_users)
    k_ref, v_ref, _ = model.prefill(items, actions, ts, offsets)
    rec = KVCache(kv_cfg, blocks, "cuda")
    _write(rec, users, full, k_ref, v_ref, ts)
    k_err = max(rel_err(inc.read(u)[0], rec.read(u)[0]) for u in users)
    v_err = max(rel_err(inc.read(u)[1], rec.read(u)[1]) for u in users)

    cands = torch.randint(cfg.first_item_row, cfg.num_items, (num_users, 64), device="cuda")
    query_ts = torch.tensor([int(h[-1, 2]) for h in hist], device="cuda")
    before = inc.kv.clone()
    got = model.rank(cands, query_ts, inc.kv, inc.ts, *inc.batch_tables(users))
    want = model.rank(cands, query_ts, rec.kv, rec.ts, *rec.batch_tables(users))
    rank_err = rel_err(got, want)
    print(
        f"\n{dtype} on {torch.cuda.get_device_name()}: user_emb {emb_err:.2e}, K {k_err:.2e}, "
        f"V {v_err:.2e}, rank {rank_err:.2e} (tolerance {TOLERANCE[dtype]:.0e})"
    )
    assert torch.equal(inc.kv, before)  # rank writes nothing
    for err in (emb_err, k_err, v_err, rank_err):
        assert err < TOLERANCE[dtype]
