"""The e4m3 KV format (models/fp8.py): power-of-two scales, exact round trips, a bound
that no input can exceed."""

from __future__ import annotations

import math

import pytest
import torch

from streamrec.models.fp8 import (
    FP8,
    FP8_MAX,
    KVScales,
    dequantize,
    gather_blocks,
    power_of_two_scale,
    projection_bound,
    quantize,
)
from streamrec.models.quantization import apply_precision, kv_scales
from streamrec.models.serving_precision import ServingPrecision
from tests.models.test_hstu import random_model


def all_codes() -> torch.Tensor:
    """Every finite e4m3fn code (the two NaN encodings left out)."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    return codes[~codes.float().isnan()]


def test_power_of_two_scale_maps_the_bound_into_the_top_binade() -> None:
    bound = torch.tensor([1e-30, 1e-3, 0.5, 1.0, 3.5, 448.0, 449.0, 1e6])
    scale = power_of_two_scale(bound)
    assert scale.dtype == torch.float32
    exponent = torch.log2(scale)
    assert torch.equal(exponent, exponent.round())  # powers of two
    ratio = bound / scale
    assert (ratio <= FP8_MAX).all()
    assert (ratio[1:] > FP8_MAX / 2).all()


@pytest.mark.parametrize("exponent", [-20, -7, 0, 5])
def test_a_power_of_two_scale_round_trips_every_code_exactly(exponent: int) -> None:
    codes = all_codes()
    scale = torch.tensor(2.0**exponent)
    for dtype in (torch.float32, torch.bfloat16):
        values = dequantize(codes, scale, dtype)
        again = quantize(values, scale)
        assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8)), dtype


def test_quantize_saturates_and_rounds_to_nearest() -> None:
    scale = torch.tensor(0.5)
    x = torch.tensor([1e9, -1e9, 0.0, 1.0, 8.5])
    got = dequantize(quantize(x, scale), scale, torch.float32)
    assert got[0] == FP8_MAX * 0.5 and got[1] == -FP8_MAX * 0.5
    assert got[2] == 0.0 and got[3] == 1.0
    # 8.5 / 0.5 = 17 lies between the codes 16 and 18: ties go to even (16)
    assert got[4] == 8.0
    normal = torch.linspace(0.01, FP8_MAX * 0.5, 9999)  # normal e4m3 after / 0.5
    rel = (dequantize(quantize(normal, scale), scale, torch.float32) / normal - 1).abs()
    assert rel.max() <= 2**-4 + 1e-7


def test_the_bound_holds_for_inputs_aligned_with_each_row() -> None:
    """The worst input for row j has LN(x) along W_j * gamma: the bound must hold there
    and not be loose by more than sqrt(D) (it is Cauchy-Schwarz, tight up to the mean)."""
    torch.manual_seed(0)
    d_model, rows = 32, 24
    norm = torch.nn.LayerNorm(d_model)
    lin = torch.nn.Linear(d_model, rows)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        norm.bias.normal_(0, 0.3)
    bound = projection_bound(lin.weight, lin.bias, norm.weight, norm.bias)
    direction = lin.weight * norm.weight  # [rows, D]
    worst = direction - direction.mean(dim=1, keepdim=True)  # zero mean, as LN's output
    x = torch.cat([worst, -worst, torch.randn(500, d_model) * 10])
    with torch.no_grad():
        out = torch.nn.functional.silu(lin(norm(x)))  # [N, rows]
    assert (out.abs() <= bound).all()
    tightest = (out.abs().amax(dim=0) / bound).min()
    assert tightest > 1 / math.sqrt(d_model)


def test_kv_scales_of_a_model_are_never_exceeded() -> None:
    model = random_model(3)
    apply_precision(model, ServingPrecision(kv_dtype="fp8_e4m3"))
    scales = kv_scales(model).scale
    assert scales.shape == (model.config.num_layers, 2, model.config.num_heads)
    assert model.kv_quant is not None and torch.equal(model.kv_quant.scale, scales)
    x = torch.randn(400, model.config.d_model) * 50  # LayerNorm makes the scale irrelevant
    with torch.no_grad():
        for idx, layer in enumerate(model.layers):
            _u, v, _q, k = layer.project(x)  # [N, H, d]
            for which, t in ((0, k), (1, v)):
                ratio = t.abs().amax(dim=(0, 2)) / scales[idx, which]
                assert (ratio <= FP8_MAX).all()
                assert (ratio > 1.0).all()  # values land in e4m3's normal range


def test_cached_form_store_and_load_agree() -> None:
    scale = torch.tensor([[[2.0**-7, 2.0**-3], [2.0**-5, 1.0]]])  # [1, 2, H=2]
    kvq = KVScales(scale)
    k = torch.randn(5, 2, 4) * torch.tensor([0.5, 20.0])[:, None]
    v = torch.randn(5, 2, 4) * torch.tensor([2.0, 100.0])[:, None]
    kc, vc = kvq.cached_form(0, k, v)
    k8, v8 = kvq.store(k[None], v[None])
    assert k8.dtype == FP8 and k8.shape == (1, 5, 2, 4)
    ks8, vs8 = kvq.store(kc[None], vc[None])  # quantizing the cached form changes nothing
    assert torch.equal(ks8.view(torch.uint8), k8.view(torch.uint8))
    assert torch.equal(vs8.view(torch.uint8), v8.view(torch.uint8))
    kl, vl = kvq.load(0, k8[0], v8[0], torch.float32)
    assert torch.equal(kl, kc) and torch.equal(vl, vc)
    assert float((kc - k).norm() / k.norm()) < 0.05


def test_gather_blocks_reads_fp8_through_bytes() -> None:
    pool = (torch.randn(6, 3, 2) * 10).to(FP8)  # [NB, BS, d]
    blocks = torch.tensor([[4, 1], [0, 0]])
    got = gather_blocks(pool, blocks)
    assert got.dtype == FP8 and got.shape == (2, 2, 3, 2)
    assert torch.equal(got.float(), pool.float()[blocks])
    plain = torch.randn(6, 3, 2)
    assert torch.equal(gather_blocks(plain, blocks), plain[blocks])
