# mypy: disable-error-code="no-untyped-def"
"""Per-row e4m3 quantization: ``x[m] ≈ code[m] * scale[m]`` with ``scale = amax / 448``.

FP8 projection GEMMs (models/fp8_linear.py) quantize every activation row at every call
and each weight row once. In PyTorch that is six kernels per GEMM input (abs, amax,
divide, clamp, divide, cast): on the H200 they took ~1.8 ms of a 7.0 ms HSTU-8L step at
batch 64, more than the e4m3 GEMMs themselves (BENCHMARKS.md, issue 18). On CUDA, when
launched eagerly, one Triton program per row does it in one pass; traced (torch.compile,
AOTInductor) the PyTorch form is used, which Inductor fuses itself.

Both forms compute the same scales and codes on every device: the amax is exact, the scale
is ``amax * fp32(1/448)`` (one rounded product; PyTorch on CUDA turns a division by a
Python scalar into that product and on the CPU does not, so a division would make the
scales depend on the device), and the codes' division is IEEE round-to-nearest
(``div_rn`` in the kernel) as PyTorch's tensor division; a token's codes depend on that
token's row alone, so prefill and extend quantize it alike.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from streamrec.models.fp8 import FP8, FP8_MAX, quantize
from streamrec.models.triton_lang import tl, triton

if triton is not None:
    from triton.language.extra import libdevice
else:  # pragma: no cover - exercised on the CPU CI machine
    libdevice = None

TINY = torch.finfo(torch.float32).tiny  # the scale of an all-zero row (instead of 0)
INV_FP8_MAX = 1.0 / FP8_MAX  # rounded to fp32 alike by PyTorch and by a Triton fp32 argument


def row_scale(x: torch.Tensor) -> torch.Tensor:
    """amax / 448 of each row of x [M, K], fp32 [M, 1] (tiny instead of 0 for zero rows)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    return (amax * INV_FP8_MAX).clamp(min=TINY)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [M, K] e4m3, scale [M, 1] fp32)`` of x [M, K], in PyTorch."""
    scale = row_scale(x)
    return quantize(x, scale), scale


def fused_quantize_usable(x: torch.Tensor) -> bool:
    """The one-pass kernel serves eager CUDA calls on 2-D rows; traced calls keep the
    PyTorch form (fake tensors carry no data for a launch, and Inductor fuses it)."""
    if triton is None or not x.is_cuda or x.dim() != 2:
        return False
    return not (torch.compiler.is_compiling() or is_fake(x))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [M, K] e4m3, scale [M, 1] fp32)`` of x [M, K]: the fused kernel where it
    serves, else ``quantize_rows_reference``."""
    if not fused_quantize_usable(x):
        return quantize_rows_reference(x)
    return launch_quantize_rows(x)


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, codes_ptr, scale_ptr, num_cols, stride_x, tiny, inv_max, BLOCK_K: tl.constexpr
    ):
        """Row ``program_id(0)``: its amax, scale and codes in one pass over the row."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_K)
        mask = offs < num_cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.maximum(amax * inv_max, tl.cast(tiny, tl.float32))  # as row_scale
        codes = tl.clamp(tl.div_rn(x, scale), -448.0, 448.0)
        tl.store(codes_ptr + row * num_cols + offs, codes.to(tl.float8e4nv), mask=mask)
        tl.store(scale_ptr + row, scale)

    def launch_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        codes = torch.empty((rows, cols), dtype=FP8, device=x.device)  # [M, K]
        scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)  # [M, 1]
        if rows:
            block = triton.next_power_of_2(cols)
            _quantize_rows_kernel[(rows,)](
                x, codes, scale, cols, x.stride(0), TINY, INV_FP8_MAX, BLOCK_K=block,
                num_warps=4 if block >= 1024 else 2,
            )  # fmt: skip
        return codes, scale

else:  # pragma: no cover - the CPU CI machine

    def launch_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("the fused row quantizer needs Triton")
