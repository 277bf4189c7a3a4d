"""FP8 projection GEMMs (models/fp8_linear.py): error against the bf16/fp32 GEMM, a
token's output independent of the other tokens, and ``torch._scaled_mm`` on the H200."""

from __future__ import annotations

import pytest
import torch

from streamrec.models.fp8 import FP8
from streamrec.models.fp8_linear import FP8Linear, scaled_mm_usable


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def make_linear(k: int, n: int, seed: int = 0, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():  # rows of very different magnitude: per-channel scales matter
        lin.weight.mul_(torch.logspace(-2, 1, n).unsqueeze(1))
    return lin


@torch.no_grad()
def test_close_to_the_full_precision_gemm() -> None:
    lin = make_linear(64, 48)
    fp8 = FP8Linear(lin)
    assert fp8.weight.dtype == FP8 and fp8.weight_scale.shape == (1, 48)
    # tokens of very different magnitude: per-token scales matter too
    x = torch.randn(3, 7, 64) * torch.logspace(-3, 2, 7).view(1, 7, 1)
    got, want = fp8(x), lin(x)
    assert got.shape == want.shape == (3, 7, 48) and got.dtype == x.dtype
    assert rel_err(got, want) < 0.04  # 2 x e4m3 rounding (<= 2^-4 each), averaged over K
    for t in range(7):  # every token, not just the large ones
        assert rel_err(got[:, t], want[:, t]) < 0.06


@torch.no_grad()
def test_the_fallback_computes_the_dequantized_product() -> None:
    lin = make_linear(32, 16, seed=1, bias=False)
    fp8 = FP8Linear(lin)
    x = torch.randn(5, 32)
    scale = x.abs().amax(dim=1, keepdim=True) / 448.0
    xq = (x / scale).to(FP8).float() * scale
    want = xq @ fp8.dequantized_weight().t()
    torch.testing.assert_close(fp8(x), want, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_a_tokens_output_does_not_depend_on_the_batch() -> None:
    """Per-token activation scales: the same token quantizes the same way in a prefill of
    the whole history and in an extend of one token (incremental == recompute)."""
    fp8 = FP8Linear(make_linear(32, 24, seed=2))
    x = torch.randn(9, 32) * torch.logspace(-2, 2, 9).unsqueeze(1)
    whole = fp8(x)
    for t in range(9):
        assert torch.equal(fp8(x[t : t + 1]), whole[t : t + 1])


@torch.no_grad()
def test_zero_rows_stay_zero_and_bf16_inputs_give_bf16() -> None:
    fp8 = FP8Linear(make_linear(16, 16, seed=3, bias=False))
    x = torch.zeros(2, 16)
    x[1] = torch.randn(16)
    out = fp8(x)
    assert torch.equal(out[0], torch.zeros(16)) and out[1].abs().sum() > 0
    assert fp8(x.bfloat16()).dtype == torch.bfloat16
    assert not scaled_mm_usable(x.bfloat16(), 16, 16)  # CPU: the fallback


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_scaled_mm_matches_the_fallback_on_cuda(tokens: int) -> None:
    lin = make_linear(512, 2048, seed=4).cuda().bfloat16()
    fp8 = FP8Linear(lin)
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    assert scaled_mm_usable(x, 512, 2048)
    got = fp8(x)
    cpu = FP8Linear(make_linear(512, 2048, seed=4).bfloat16())
    want = cpu(x.cpu())  # the same codes through the fp32 fallback
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, 2048)
    assert rel_err(got.cpu(), want) < 1e-2
    assert rel_err(got.cpu(), lin.cpu()(x.cpu())) < 0.06  # e4m3 x e4m3: ~0.037 on the CPU
