"""FP8 projection GEMMs: ``y = x W^T + b`` with W and x in e4m3 (``model.weight_dtype``).

The weight is quantized once, per output channel (``W[n] ≈ code[n] * w_scale[n]``); the
activations per token at every call (``x[m] ≈ code[m] * x_scale[m]``), so a token's
output depends on that token's row alone, exactly as in the bf16 GEMM: prefill and extend
of the same token quantize it the same way, and incremental still equals recompute.

On Hopper-class GPUs (compute capability >= 8.9) with bf16 activations the product runs
as ``torch._scaled_mm`` with row-wise scales (``scale_a [M, 1]``, ``scale_b [1, N]``,
fp32; mat2 column-major; bf16 bias and output; K and N multiples of 16; the same schema
in torch 2.11 and 2.13). Everywhere else (the CPU, fp32 models) a plain fp32 matmul of
the dequantized codes computes the same quantized product, so CPU tests and a CPU
AOTInductor package exercise the same numerics with an fp32 accumulator.
"""

from __future__ import annotations

import torch
from torch import nn

from streamrec.models.row_quantizer import quantize_rows, quantize_rows_reference

_MIN_CAPABILITY = (8, 9)


def scaled_mm_usable(x: torch.Tensor, in_features: int, out_features: int) -> bool:
    """Whether ``torch._scaled_mm`` (row-wise) serves this call; shape and device only."""
    if not x.is_cuda or x.dtype != torch.bfloat16 or in_features % 16 or out_features % 16:
        return False
    return torch.cuda.get_device_capability(x.device) >= _MIN_CAPABILITY


class FP8Linear(nn.Module):
    """A frozen ``nn.Linear`` in e4m3: ``weight [N, K]`` codes, ``weight_scale [1, N]``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        with torch.no_grad():
            codes, scale = quantize_rows_reference(linear.weight.detach())  # [N, K], [N, 1]
            self.register_buffer("weight", codes.contiguous())  # [N, K] fp8
            self.register_buffer("weight_scale", scale.t().contiguous())  # [1, N] fp32
            bias = None if linear.bias is None else linear.bias.detach().clone()
            self.register_buffer("bias", bias)  # [N] in the model dtype, or None
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the GEMM effectively uses, fp32 [N, K] (bounds, tests)."""
        weight: torch.Tensor = self.weight  # type: ignore[assignment]
        scale: torch.Tensor = self.weight_scale  # type: ignore[assignment]
        return weight.float() * scale.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        weight: torch.Tensor = self.weight  # type: ignore[assignment]
        w_scale: torch.Tensor = self.weight_scale  # type: ignore[assignment]
        bias: torch.Tensor | None = self.bias  # type: ignore[assignment]
        rows = x.reshape(-1, self.in_features)  # [M, K]
        codes, x_scale = quantize_rows(rows)  # [M, K] fp8, [M, 1] fp32
        if scaled_mm_usable(x, self.in_features, self.out_features):
            out = torch._scaled_mm(
                codes, weight.t(), scale_a=x_scale, scale_b=w_scale,
                bias=None if bias is None else bias.to(torch.bfloat16),
                out_dtype=torch.bfloat16,
            )  # fmt: skip
        else:  # the same quantized product with an fp32 accumulator
            out = (codes.float() @ weight.float().t()) * (x_scale * w_scale)
            if bias is not None:
                out = out + bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3"
