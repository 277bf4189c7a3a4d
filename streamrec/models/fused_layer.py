# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""The two GEMMs of an HSTU layer with their LayerNorm and elementwise parts fused in.

Eagerly a layer of ``extend``/``rank`` costs, besides its attention, seven kernels:
LayerNorm, the uvqk GEMM, SiLU (the split is views), then LayerNorm of the attention, the
u ⊙ product, the output GEMM and the residual add (issue 14). At batch 1 each is a few
microseconds of launch for almost no work; at batch 64 of ``rank`` the SiLU alone moves
the 16k × 2048 projection through HBM twice. One Triton kernel does each half:

- ``norm_linear_silu``: silu(LayerNorm(x) @ W^T + b), [M, K] -> [M, N];
- ``gated_norm_linear_residual``: x + (u ⊙ LayerNorm(a)) @ W^T + b.

Each program normalises its rows on the fly: a first pass over its [BLOCK_M, K] rows
gathers the mean and variance (chunks combined exactly, Chan's formula), the GEMM loop
then normalises each A chunk as it loads it. The LayerNorm output (and the gated
product) is rounded to the input dtype before the dot, as the torch path rounds it; the
bias, SiLU and residual are applied to the fp32 accumulator and rounded once. Shapes
only decide the grid, so both ops export (``triton_op`` + ``wrap_triton``) and capture.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from streamrec.models.triton_lang import tl, triton

OP_PROJECT = "streamrec::norm_linear_silu"
OP_OUTPUT = "streamrec::gated_norm_linear_residual"
# Launch shape: fixed (no branch on the traced row count M), sweepable in the bench.
LAYER_BLOCK_M = 128
LAYER_BLOCK_N = 128
LAYER_BLOCK_K = 64
LAYER_WARPS = 8
LAYER_STAGES = 3


def fused_layer_usable(x: torch.Tensor, norm: nn.LayerNorm, linear: nn.Linear) -> bool:
    """Whether the fused kernels can replace ``linear(norm(x))`` for this call: CUDA and
    Triton, inference (no autograd through a Triton kernel), an affine LayerNorm over a
    width the kernel's K tile divides, and matching dtypes."""
    width = linear.in_features
    return (
        triton is not None
        and x.is_cuda
        and not (torch.is_grad_enabled() and (x.requires_grad or linear.weight.requires_grad))
        and norm.elementwise_affine
        and norm.weight is not None
        and norm.bias is not None
        and linear.bias is not None
        and width % LAYER_BLOCK_K == 0
        and x.dtype == linear.weight.dtype
    )


if triton is not None:

    @triton.jit
    def _norm_linear_kernel(
        a_ptr,  # [M, K] rows to normalise, row stride stride_am
        g_ptr,  # [M, K] gate u (GATED), row stride stride_gm
        lnw_ptr,  # [K]
        lnb_ptr,  # [K]
        w_ptr,  # [N, K] nn.Linear weight, row stride stride_wn
        b_ptr,  # [N]
        r_ptr,  # [M, N] residual (RESIDUAL), row stride stride_rm
        out_ptr,  # [M, N] contiguous
        M,
        N,
        stride_am,
        stride_gm,
        stride_wn,
        stride_rm,
        eps,
        K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GATED: tl.constexpr,
        SILU: tl.constexpr,
        RESIDUAL: tl.constexpr,
        IEEE: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        """One [BLOCK_M, BLOCK_N] tile of the output."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        rmask = rows < M
        cmask = cols < N
        rows64 = rows.to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        # Row statistics, chunk by chunk: Chan's exact combination of (count, mean, M2).
        mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
        m2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for c in tl.static_range(K // BLOCK_K):
            a = tl.load(a_ptr + rows64[:, None] * stride_am + (c * BLOCK_K + offs_k)[None, :],
                        mask=rmask[:, None], other=0.0).to(tl.float32)  # fmt: skip
            c_mean = tl.sum(a, 1) / BLOCK_K
            dev = a - c_mean[:, None]
            delta = c_mean - mean
            mean += delta * (1.0 / (c + 1))
            m2 += tl.sum(dev * dev, 1) + delta * delta * (c * BLOCK_K / (c + 1))
        # (Inductor passes Python floats as fp64 scalars: keep the row math in fp32)
        rstd = (1.0 / tl.sqrt(m2 / K + eps)).to(tl.float32)  # [BM]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            ks = k0 + offs_k  # [BK]
            # (not ``a``: the statistics loop left an fp32 ``a``, and Triton would carry it
            # into this loop with that type)
            x = tl.load(a_ptr + rows64[:, None] * stride_am + ks[None, :], mask=rmask[:, None],
                        other=0.0)  # fmt: skip
            lnw = tl.load(lnw_ptr + ks).to(tl.float32)
            lnb = tl.load(lnb_ptr + ks).to(tl.float32)
            a_n = (x.to(tl.float32) - mean[:, None]) * rstd[:, None] * lnw[None, :] + lnb[None, :]
            a_n = a_n.to(x.dtype)  # the torch path rounds LayerNorm's output
            if GATED:
                u = tl.load(g_ptr + rows64[:, None] * stride_gm + ks[None, :],
                            mask=rmask[:, None], other=0.0)  # fmt: skip
                a_n = (u.to(tl.float32) * a_n.to(tl.float32)).to(x.dtype)
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                        mask=cmask[None, :], other=0.0)  # [BK, BN]  # fmt: skip
            if IEEE:
                acc += tl.dot(a_n, w, input_precision="ieee")
            else:
                acc += tl.dot(a_n, w)
        acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        omask = rmask[:, None] & cmask[None, :]
        if RESIDUAL:
            res = tl.load(r_ptr + rows64[:, None] * stride_rm + cols[None, :], mask=omask,
                          other=0.0)  # fmt: skip
            acc += res.to(tl.float32)
        tl.store(out_ptr + rows64[:, None] * N + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=omask)  # fmt: skip

    def launch_norm_linear(
        a: torch.Tensor,
        gate: torch.Tensor | None,
        ln_weight: torch.Tensor,
        ln_bias: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor,
        residual: torch.Tensor | None,
        silu: bool,
        block_m: int = LAYER_BLOCK_M,
        block_n: int = LAYER_BLOCK_N,
        block_k: int = LAYER_BLOCK_K,
        num_warps: int = LAYER_WARPS,
        num_stages: int = LAYER_STAGES,
    ) -> torch.Tensor:
        """The kernel over 2-D a [M, K] (gate like a, residual [M, N]) -> [M, N]."""
        rows, width = a.shape
        out_features = weight.shape[0]
        out = torch.empty(rows, out_features, dtype=a.dtype, device=a.device)
        grid = ((rows + block_m - 1) // block_m, (out_features + block_n - 1) // block_n)
        g = a if gate is None else gate
        r = out if residual is None else residual
        torch.library.wrap_triton(_norm_linear_kernel)[grid](
            a, g, ln_weight, ln_bias, weight, bias, r, out, rows, out_features, a.stride(0),
            g.stride(0), weight.stride(0), r.stride(0), eps, K=width, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, GATED=gate is not None, SILU=silu,
            RESIDUAL=residual is not None, IEEE=a.dtype == torch.float32, STAGES=num_stages,
            num_warps=num_warps,
        )  # fmt: skip
        return out

    @torch.library.triton_op(OP_PROJECT, mutates_args={})
    def norm_linear_silu(
        x: torch.Tensor,
        ln_weight: torch.Tensor,
        ln_bias: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """silu(LayerNorm(x) @ weight^T + bias) for x [M, K]."""
        return launch_norm_linear(x, None, ln_weight, ln_bias, eps, weight, bias, None, True)

    @torch.library.triton_op(OP_OUTPUT, mutates_args={})
    def gated_norm_linear_residual(
        x: torch.Tensor,
        attn: torch.Tensor,
        gate: torch.Tensor,
        ln_weight: torch.Tensor,
        ln_bias: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """x + (gate ⊙ LayerNorm(attn)) @ weight^T + bias for x [M, N], attn/gate [M, K]."""
        return launch_norm_linear(attn, gate, ln_weight, ln_bias, eps, weight, bias, x, False)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [M, K] with unit stride along K: a view when eager (the chunks of the
    projection), contiguous when traced, so the strides the kernel is traced with are
    the ones Inductor allocates (see ``paged_attention.head_rows``)."""
    flat = t.reshape(-1, t.shape[-1])
    traced = torch.compiler.is_compiling() or is_fake(flat)
    return flat.contiguous() if traced or flat.stride(-1) != 1 else flat


def fused_project(x: torch.Tensor, norm: nn.LayerNorm, linear: nn.Linear) -> torch.Tensor:
    """silu(linear(norm(x))) for x [..., D] in one kernel -> [..., N]."""
    assert norm.weight is not None and norm.bias is not None and linear.bias is not None
    out = torch.ops.streamrec.norm_linear_silu(
        _rows(x), norm.weight, norm.bias, linear.weight, linear.bias, norm.eps
    )
    return out.view(*x.shape[:-1], out.shape[-1])


def fused_output(
    x: torch.Tensor, gate: torch.Tensor, attn: torch.Tensor, norm: nn.LayerNorm, linear: nn.Linear
) -> torch.Tensor:
    """x + linear(gate ⊙ norm(attn)) in one kernel; x [..., D], gate/attn [..., K]."""
    assert norm.weight is not None and norm.bias is not None and linear.bias is not None
    out = torch.ops.streamrec.gated_norm_linear_residual(
        _rows(x), _rows(attn), _rows(gate), norm.weight, norm.bias, linear.weight,
        linear.bias, norm.eps,
    )  # fmt: skip
    return out.view(x.shape)
