"""The fused kernels over FP8 K/V (issue 18): decode, candidates and prefill read e4m3
codes with the layer's per-head scales and must give what they give over the
dequantized values (the torch references dequantize).

``gpu`` tests run on CUDA (fp32 and bf16) and, at small shapes and fp32 only, on the CPU
interpreter:

    TRITON_INTERPRET=1 PYTHONPATH=$PWD /work/triton-venv/bin/python -m pytest \\
        -c /dev/null --noconftest -o markers=gpu -p no:cacheprovider -q -m gpu \\
        tests/models/test_fp8_attention.py

Tolerances as in test_paged_attention.py / test_prefill_attention.py: fp32 1e-5 against
the reference; bf16 1e-2 against fp32 math on the same codes, and no worse than 2x the
torch bf16 path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.errors import ModelError
from streamrec.models import candidate_attention as ca
from streamrec.models import paged_attention as pa
from streamrec.models import prefill_attention as pfa
from streamrec.models.fp8 import FP8, dequantize, power_of_two_scale, quantize
from streamrec.models.quantization import apply_precision
from streamrec.models.serving_precision import ServingPrecision
from tests.models.kernel_device import kernel_device
from tests.models.prefill_cases import make_jagged
from tests.models.test_hstu_gpu import _model
from tests.models.test_paged_attention import (
    BATCHES,
    BF16_TOL,
    FP32_TOL,
    ON_GPU,
    Case,
    edge_lengths,
    make_case,
    mixed_case,
    new_token_counts,
    per_user_errors,
    rel_err,
)
from tests.triton_interpreter import INTERPRET


def fp8_codes(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [2, ..., H, d] -> (codes, scale [2, H]): one power of two per (K/V, head) that
    maps the head's largest finite value near the top of e4m3 (NaN slots stay NaN)."""
    finite = kv.float().nan_to_num(0.0).abs()
    amax = finite.flatten(1, -3).amax(dim=(1, 3))  # [2, H]
    scale = power_of_two_scale(amax)
    per_head = scale.view(2, *([1] * (kv.dim() - 3)), scale.shape[1], 1)
    return quantize(kv, per_head), scale


def dequantized(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    per_head = scale.view(2, *([1] * (codes.dim() - 3)), scale.shape[1], 1)
    return dequantize(codes, per_head, dtype)


def decode_args(c: Case, kv: torch.Tensor) -> tuple[object, ...]:
    return (c.q, c.pos, c.ts, c.users, c.q_start, c.k_new, c.v_new, kv[0], kv[1], c.ts_pool,
            c.tables, c.lens, c.pos_bias, c.time_bias, c.edges, c.divisor)  # fmt: skip


def cand_args(c: Case, kv: torch.Tensor) -> tuple[object, ...]:
    return (c.per_user(c.q), c.per_user(c.k_new), c.per_user(c.v_new), c.first(c.pos),
            c.first(c.ts), kv[0], kv[1], c.ts_pool, c.tables, c.lens, c.pos_bias,
            c.time_bias, c.edges, c.divisor)  # fmt: skip


def fused(c: Case, kv: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if c.rank:
        return ca.fused_candidate_attention(
            c.per_user(c.q), c.per_user(c.k_new), c.per_user(c.v_new), c.first(c.pos),
            c.first(c.ts), kv, c.ts_pool, c.tables, c.lens, c.pos_bias, c.time_bias,
            c.edges, c.divisor, scale,
        ).reshape(c.q.shape)  # fmt: skip
    return pa.fused_token_attention(
        c.q, c.k_new, c.v_new, c.pos, c.ts, c.users, c.q_start, kv, c.ts_pool, c.tables,
        c.lens, c.pos_bias, c.time_bias, c.edges, c.divisor, scale,
    )  # fmt: skip


def reference(c: Case, kv: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if c.rank:
        return ca.candidate_attention_reference(*cand_args(c, kv), scale).reshape(c.q.shape)
    return pa.paged_silu_attention_reference(*decode_args(c, kv), scale)


# ------------------------------------------------------------------------ CPU


def test_the_references_dequantize_the_codes() -> None:
    for rank in (False, True):
        c = make_case([0, 5, 16, 40], 3 if rank else [2, 0, 5, 3], rank, "cpu", seed=3)
        codes, scale = fp8_codes(c.kv)
        assert codes.dtype == FP8
        want = reference(c, dequantized(codes, scale, torch.float32), None)
        assert torch.equal(reference(c, codes, scale), want)


def test_kernel_inputs_need_their_scales_and_only_those() -> None:
    c = make_case([5, 20], [1, 2], False, "cpu", seed=4)
    codes, scale = fp8_codes(c.kv)
    with pytest.raises(ModelError, match="need kv_scale fp32"):
        pa.check_inputs(c.q, codes[0])
    with pytest.raises(ModelError, match="need no kv_scale"):
        pa.check_inputs(c.q, c.kv[0], scale)
    with pytest.raises(ModelError, match="kv_scale fp32"):
        pa.check_inputs(c.q, codes[0], scale[:, :1])
    pa.check_inputs(c.q, codes[0], scale)
    q = torch.randn(7, 2, 16)
    with pytest.raises(ModelError, match="need kv_scale"):
        pfa.check_inputs(q, q.to(FP8), q.to(FP8), 64, 32)
    pfa.check_inputs(q, q.to(FP8), q.to(FP8), 64, 32, torch.ones(2, 2))


# ------------------------------------------------------------- GPU / interpreter


@pytest.mark.gpu
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("rank", [False, True])
def test_fp8_ops_match_the_reference_fp32(
    batch: int, rank: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = kernel_device(monkeypatch)
    queries = 32 if rank else new_token_counts(batch, batch)
    c = make_case(edge_lengths(batch, batch), queries, rank, device, seed=100 + batch)
    codes, scale = fp8_codes(c.kv)
    err = rel_err(fused(c, codes, scale), reference(c, codes, scale))
    print(f"fp8 kv, fp32 batch={batch} rank={rank}: rel err {err:.2e}")
    assert err < FP32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("rank", [False, True])
def test_fp8_ops_bf16_error(batch: int, rank: bool) -> None:
    if not ON_GPU:
        pytest.skip("needs CUDA (bf16 is not checked on the interpreter)")
    queries = 32 if rank else new_token_counts(batch, batch)
    low = make_case(edge_lengths(batch, batch), queries, rank, "cuda", seed=batch).to(
        torch.bfloat16
    )
    codes, scale = fp8_codes(low.kv)
    exact = low.to(torch.float32)
    want = reference(exact, codes, scale)  # fp32 math on the same codes
    got_err = rel_err(fused(low, codes, scale), want)
    torch_err = rel_err(reference(low, codes, scale), want)
    print(f"fp8 kv, bf16 batch={batch} rank={rank}: op {got_err:.2e}, torch {torch_err:.2e}")
    assert got_err < BF16_TOL
    assert got_err <= 2 * torch_err + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("mixed", [False, True])
def test_fp8_decode_splits_are_deterministic(mixed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 codes on both bodies of the decode kernel (one-token chunks on the vector body,
    longer ones on tensor cores, ``mixed``: users with 0/1/2/5/17/40 new tokens), each
    user against the reference over the dequantized values, one key range or many, with
    and without the vector body's prefetch and Triton's pipeline over it."""
    device = kernel_device(monkeypatch)
    if mixed:
        c = mixed_case(device, seed=13)
    else:
        c = make_case([0, 17, 40, 33], [2, 0, 19, 1], rank=False, device=device, seed=11)
    codes, scale = fp8_codes(c.kv)
    want = reference(c, codes, scale)
    for block_n, warps, target, acc2d, prefetch, stages in [
        (16, 2, 1, False, False, 1), (32, 4, 4096, True, False, 1),
        (16, 4, 4096, True, True, 1), (32, 4, 1, True, False, 3),
    ]:  # fmt: skip
        run = (block_n, warps, target, True, acc2d)
        launch = {"kv_scale": scale, "prefetch": prefetch, "stages": stages}
        got = pa.launch_decode(*decode_args(c, codes), *run, **launch)  # type: ignore[arg-type]
        assert max(per_user_errors(c, got, want)) < FP32_TOL, (run, prefetch, stages)
        again = pa.launch_decode(*decode_args(c, codes), *run, **launch)  # type: ignore[arg-type]
        assert torch.equal(got, again)


@pytest.mark.gpu
def test_fp8_candidate_launch_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    device = kernel_device(monkeypatch)
    c = make_case([0, 17, 40, 70], 19, rank=True, device=device, seed=12)
    codes, scale = fp8_codes(c.kv)
    want = reference(c, codes, scale)
    for launch in [(16, 16, 4, 2, 1), (64, 32, 4, 2, 1024)]:
        got = ca.launch_candidates(*cand_args(c, codes), *launch, kv_scale=scale)  # type: ignore[arg-type]
        assert rel_err(got.view_as(c.q), want) < FP32_TOL, launch


@pytest.mark.gpu
@pytest.mark.parametrize("strided", [False, True])
def test_fp8_prefill_matches_the_reference(strided: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    device = kernel_device(monkeypatch)
    lens = [0, 1, 15, 16, 17, 40, 3] if INTERPRET else [0, 1, 63, 64, 65, 700, 2049, 3]
    head_dim = 16 if INTERPRET else 64
    case = make_jagged(lens, device, seed=21, head_dim=head_dim, strided=strided)
    codes, scale = fp8_codes(torch.stack([case.k, case.v]))
    k8, v8 = codes[0], codes[1]
    tail = case.tail()
    want = pfa.jagged_silu_attention_reference(case.q, k8, v8, case.ts, case.offsets, *tail,
                                               scale)  # type: ignore[arg-type]  # fmt: skip
    if INTERPRET:
        got = pfa.launch_prefill(case.q, k8, v8, case.ts, case.offsets, *tail,  # type: ignore[arg-type]
                                 block_m=16, block_n=16, num_warps=1, kv_scale=scale)  # fmt: skip
    else:
        got = pfa.fused_prefill_attention(case.q, k8, v8, case.ts, case.offsets, *tail,  # type: ignore[arg-type]
                                          kv_scale=scale)  # fmt: skip
    err = rel_err(got, want)
    print(f"fp8 kv prefill fp32 strided={strided}: rel err {err:.2e}")
    assert err < FP32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@torch.inference_mode()
def test_fp8_model_fused_equals_torch_path(dtype: str) -> None:
    """The model on its fused FP8 kernels against the same model on the torch path."""
    if not ON_GPU:
        pytest.skip("needs CUDA")
    fast = apply_precision(_model(dtype), ServingPrecision(kv_dtype="fp8_e4m3"))
    slow = apply_precision(_model(dtype), ServingPrecision(kv_dtype="fp8_e4m3"))
    slow.attention_backend = "torch"
    slow.fused_layers = False
    cfg = fast.config
    gen = torch.Generator().manual_seed(3)
    lens = [300, 17, 64, 1]
    total = sum(lens)
    items = torch.randint(cfg.first_item_row, cfg.num_items, (total,), generator=gen).cuda()
    actions = torch.randint(1, 5, (total,), generator=gen).cuda()
    ts = (1_700_000_000_000 + torch.randint(0, 10**7, (total,), generator=gen).cumsum(0)).cuda()
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    tol = 1e-3 if dtype == "float32" else 5e-2  # bf16: rounding differences move codes
    k_f, _, emb_f = fast.prefill(items, actions, ts, offsets)
    k_s, v_s, emb_s = slow.prefill(items, actions, ts, offsets)
    assert k_f.dtype == FP8 and rel_err(emb_f, emb_s) < tol
    geometry = KVCacheConfig(cfg.num_layers, cfg.num_heads, cfg.head_dim, 16, FP8)
    cache = KVCache(geometry, 64, "cuda")
    slots = [cache.pool.append(f"u{b}", n) for b, n in enumerate(lens)]
    cache.write(np.concatenate([np.asarray(s, dtype=np.int64) for s in slots]), k_s, v_s, ts)
    tables, cached = cache.batch_tables([f"u{b}" for b in range(4)])
    args = (items[:4], actions[:4], ts[-4:] + 1000, torch.arange(5, device="cuda"), cache.kv,
            cache.ts, tables, cached)  # fmt: skip
    got, want = fast.extend(*args), slow.extend(*args)
    assert rel_err(got[2], want[2]) < tol
    cands = torch.randint(cfg.first_item_row, cfg.num_items, (4, 32), device="cuda")
    query_ts = ts[-4:] + 2000
    got_r = fast.rank(cands, query_ts, cache.kv, cache.ts, tables, cached)
    want_r = slow.rank(cands, query_ts, cache.kv, cache.ts, tables, cached)
    print(f"fp8 model {dtype}: prefill {rel_err(emb_f, emb_s):.2e} extend "
          f"{rel_err(got[2], want[2]):.2e} rank {rel_err(got_r, want_r):.2e}")  # fmt: skip
    assert rel_err(got_r, want_r) < tol
