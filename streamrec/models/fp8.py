"""FP8 (e4m3) keys and values: the scales of the KV cache and the one quantizer.

With ``cache.kv_dtype = "fp8_e4m3"`` the pool stores every cached key and value as
``float8_e4m3fn`` (1 byte instead of 2) and a scale per (layer, K/V, head) turns a code
into a value: ``x = code * scale``. The scales are chosen so that incremental inference
still equals full recompute (DESIGN §3): both must see *the same* quantized K/V, so the
quantization of a token must depend on that token alone, never on which other tokens
happened to share its block or its step.

Why not a data-driven scale per (block, head)? A block fills over several appends. A
scale from the amax of the rows present at the first write is not the scale a prefill of
the whole history computes (it sees the full block), and re-quantizing earlier rows when
a later row raises the amax rounds them twice, so the cached codes would depend on the
step boundaries, which a recompute cannot reproduce. Per-(token, head) scales avoid that
but cost 4 bytes per 64 codes (6 % of the pool, and the 1.9x capacity target).

So the scale is a **strict bound**, fixed by the weights: ``k = silu(W LN(x) + b)`` and
LayerNorm's normalized vector has norm at most ``sqrt(D)``, hence (Cauchy–Schwarz)
``|k_j| <= sqrt(D) * ||W_j * gamma||_2 + |W_j . beta + b_j|`` for every input. The scale
is the smallest power of two that maps the head's bound to at most 448 (the e4m3 max):

- nothing ever saturates, whatever the input;
- e4m3 is floating point, so a loose bound costs no relative precision: every value
  above 2^-13 of the bound is a normal number with 3 mantissa bits (relative error
  <= 2^-4), and the ones below have an absolute error under 2^-17 of the bound;
- a power-of-two scale makes dequantization exact, so ``quantize(dequantize(c)) == c``:
  the model may hand the cache either form and the stored codes are the same.

A model-version change invalidates every cache entry (DESIGN rule 5), and with it the
scales. The pool's geometry is unchanged; only its dtype is, so the kernels dequantize in
registers with one scale per head (``KVScales.scale[layer]``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from streamrec.errors import ModelError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# Headroom on the bound for the rounding of LayerNorm's output in the model dtype and,
# with FP8 projection weights, of its per-token FP8 quantization (relative error 2^-4).
_BOUND_MARGIN = 1.125


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def check_kv_scale(kv_dtype: torch.dtype, kv_scale: torch.Tensor | None, heads: int) -> None:
    """An FP8 K/V operand of a kernel needs its layer's scales (fp32 [2, H], contiguous),
    any other dtype none: a mismatch would read codes as values or the reverse."""
    ok = is_fp8(kv_dtype) == (kv_scale is not None)
    if ok and kv_scale is not None:
        shape_ok = tuple(kv_scale.shape) == (2, heads) and kv_scale.is_contiguous()
        ok = shape_ok and kv_scale.dtype == torch.float32
    if not ok:
        got = None if kv_scale is None else (kv_scale.dtype, tuple(kv_scale.shape))
        want = f"kv_scale fp32 [2, {heads}]" if is_fp8(kv_dtype) else "no kv_scale"
        raise ModelError(f"{kv_dtype} keys/values need {want}, got {got}")


def power_of_two_scale(bound: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ``s`` with ``bound / s <= FP8_MAX`` (fp32, same shape)."""
    tiny = torch.finfo(torch.float32).tiny
    return torch.exp2(torch.ceil(torch.log2(bound.float().clamp(min=tiny) / FP8_MAX)))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3 code of ``x / scale`` (saturating); ``scale`` broadcasts to ``x``."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale).to(dtype)


def projection_bound(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gamma: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """Bound on ``|silu(W LN(x) + b)|`` per output row, over every input x: [N] fp32.

    weight [N, D] (dequantized when FP8); gamma, beta [D] (LayerNorm's affine). silu is
    at least -0.279, so its magnitude is bounded by max(pre-activation bound, 0.279).
    """
    w = weight.float()
    spread = (w * gamma.float()).norm(dim=1) * math.sqrt(w.shape[1])  # [N]
    offset = w @ beta.float()  # [N]
    if bias is not None:
        offset = offset + bias.float()
    return torch.clamp(spread + offset.abs(), min=0.28) * _BOUND_MARGIN


class KVScales(nn.Module):
    """Per-(layer, K/V, head) power-of-two scales of an FP8 KV cache: ``scale [Lyr, 2, H]``.

    A non-persistent buffer: derived from the weights (``streamrec.models.precision``),
    never saved with them, bound into AOTI packages like any other constant.
    """

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        if scale.dim() != 3 or scale.shape[1] != 2:
            raise ValueError(f"KVScales wants scale [Lyr, 2, H], got {tuple(scale.shape)}")
        self.register_buffer("scale", scale.float().contiguous(), persistent=False)

    def _head_scale(self, layer: int, which: int) -> torch.Tensor:
        scale: torch.Tensor = self.scale  # type: ignore[assignment]
        return scale[layer, which].unsqueeze(-1)  # [H, 1]: broadcasts over [..., H, d]

    def layer_scale(self, layer: int) -> torch.Tensor:
        """The kernels' operand: ``[2, H]`` fp32 (K, V) of one layer, contiguous."""
        scale: torch.Tensor = self.scale  # type: ignore[assignment]
        return scale[layer]

    def codes(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [..., H, d] of ``layer`` as e4m3 codes."""
        return quantize(k, self._head_scale(layer, 0)), quantize(v, self._head_scale(layer, 1))

    def cached_form(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [..., H, d] as attention sees them once cached: quantized, dequantized."""
        ks, vs = self._head_scale(layer, 0), self._head_scale(layer, 1)
        return (
            dequantize(quantize(k, ks), ks, k.dtype),
            dequantize(quantize(v, vs), vs, v.dtype),
        )

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes of every layer's k, v [Lyr, T, H, d], as the pool stores them (exact for
        values already in ``cached_form``)."""
        scale: torch.Tensor = self.scale  # type: ignore[assignment]
        ks = scale[:, 0].unsqueeze(1).unsqueeze(-1)  # [Lyr, 1, H, 1]
        vs = scale[:, 1].unsqueeze(1).unsqueeze(-1)
        return quantize(k, ks), quantize(v, vs)

    def load(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached codes k, v [..., H, d] of ``layer`` -> values in ``dtype``."""
        ks, vs = self._head_scale(layer, 0), self._head_scale(layer, 1)
        return dequantize(k, ks, dtype), dequantize(v, vs, dtype)


def gather_blocks(pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``pool[blocks]`` for any pool dtype: FP8 through a uint8 view of the same bytes
    (index kernels lack FP8 on some devices and torch versions)."""
    if not is_fp8(pool.dtype):
        return pool[blocks]
    return pool.view(torch.uint8)[blocks].view(pool.dtype)
