"""Fused jagged causal SiLU attention for prefill, and the candidate rule over its K/V.

A cache miss (and the full-recompute baseline) encodes whole histories. The dense path
pads every user to a ``[B, W]`` grid and materialises ``[B, H, W, W]`` scores, biases and
masks in HBM; the ops here run Triton kernels (``prefill_kernels``) that walk the jagged
tokens (values ``[T, H, d]`` + offsets ``[B+1]``) in tensor-core tiles, compute the
relative-position and time bias in registers, accumulate in fp32 and skip every tile
above the diagonal.

- ``jagged_silu_attention``: causal attention of every user's tokens (prefill).
- ``jagged_silu_attention_candidates``: C candidates of user b at position ``len_b`` with
  the user's newest timestamp; they attend to all of b's tokens and to themselves (the
  self term is folded into the kernel), never to each other (the rank rule of a full
  recompute).

Both are ``triton_op`` + ``wrap_triton`` with shape-only grids, so they export into
AOTInductor. The torch references below are the oracles of the tests; without Triton (the
CPU CI machine) only they exist and ``triton_available()`` is False.
"""

from __future__ import annotations

import itertools

import torch

from streamrec.errors import ModelError
from streamrec.models.attention import (
    relative_bias,
    self_attention_term,
    silu_attention,
    time_bucket_edge_values,
)
from streamrec.models.fp8 import check_kv_scale, dequantize
from streamrec.models.paged_attention import dense, fused_attention_enabled
from streamrec.models.prefill_kernels import (
    CAND_LAUNCH,
    FP32_LAUNCH,
    POS_PAD,
    PREFILL_BLOCK_M,
    PREFILL_BLOCK_N,
    PREFILL_LAUNCHES,
    PREFILL_THR_LAUNCH,
    PREFILL_THRESHOLDS,
    triton_available,
)

OP_PREFILL = "streamrec::jagged_silu_attention"
OP_CANDIDATES = "streamrec::jagged_silu_attention_candidates"
# Largest edge for which a cell's edge compare is exact in fp64 with room to spare.
MAX_EDGE_MS = 2**52


def time_cells_exact(num_buckets: int, width: float) -> bool:
    """Whether the cell table of the kernels reproduces ``bucketize`` for these edges:
    every quarter-octave cell holds at most one edge (true for widths >= ln 1.25).
    Plain ints, no tensor: it runs while ``torch.export`` traces prefill, where a
    tensor's ``tolist`` is a data-dependent guard (seen failing on the H200)."""
    edges = time_bucket_edge_values(num_buckets, width)
    if not edges:
        return True
    if edges[0] < 1 or edges[-1] >= MAX_EDGE_MS:
        return False
    # The cell of integer e: exponent and the two bits after the leading one.
    cells = [(e.bit_length() - 1) * 4 + (((e << 2) >> (e.bit_length() - 1)) & 3) for e in edges]
    return len(set(cells)) == len(cells)


# ------------------------------------------------------------------ references


def jagged_silu_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ts: torch.Tensor,
    offsets: torch.Tensor,
    pos_bias: torch.Tensor,
    time_bias: torch.Tensor,
    edges: torch.Tensor,
    divisor: int,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal SiLU attention of each user's tokens, one dense block per user: the oracle.

    q, k, v [T, H, d] (k, v FP8 codes with ``kv_scale [2, H]``); ts [T] int64; offsets
    [B+1]. Returns [T, H, d]. Eager only (one host read of the offsets).
    """
    if kv_scale is not None:  # FP8 codes -> values
        k = dequantize(k, kv_scale[0].unsqueeze(-1), q.dtype)
        v = dequantize(v, kv_scale[1].unsqueeze(-1), q.dtype)
    out = torch.zeros_like(q)
    bounds = offsets.tolist()
    for start, end in itertools.pairwise(bounds):
        if end == start:
            continue
        pos = torch.arange(end - start, device=q.device)
        rel = pos.unsqueeze(1) - pos.unsqueeze(0)  # [n, n]
        dt = ts[start:end].unsqueeze(1) - ts[start:end].unsqueeze(0)  # [n, n]
        bias = relative_bias(rel, dt, pos_bias, time_bias, edges).to(q.dtype)  # [H, n, n]
        rows = slice(start, end)
        out[rows] = silu_attention(
            q[None, rows], k[None, rows], v[None, rows], bias[None], (rel >= 0)[None], divisor
        )[0]
    return out


def jagged_candidate_attention_reference(
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    query_ts: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ts: torch.Tensor,
    offsets: torch.Tensor,
    pos_bias: torch.Tensor,
    time_bias: torch.Tensor,
    edges: torch.Tensor,
    divisor: int,
) -> torch.Tensor:
    """User b's candidates (position len_b, timestamp query_ts[b]) over b's tokens + self.

    qc, kc, vc [B, C, H, d]; query_ts [B]; k, v [T, H, d]; ts [T]. Returns [B, C, H, d].
    """
    bias0 = pos_bias[0] + time_bias[0]  # [H]
    out = self_attention_term(qc, kc, vc, bias0, divisor)
    bounds = offsets.tolist()
    for b, (start, end) in enumerate(itertools.pairwise(bounds)):
        if end == start:
            continue
        rel = (end - start - torch.arange(end - start, device=qc.device)).view(1, -1)  # [1, n]
        dt = (query_ts[b] - ts[start:end]).view(1, -1)  # [1, n]
        bias = relative_bias(rel, dt, pos_bias, time_bias, edges).to(qc.dtype)  # [H, 1, n]
        mask = torch.ones(1, 1, end - start, dtype=torch.bool, device=qc.device)
        hist = silu_attention(
            qc[b : b + 1], k[None, start:end], v[None, start:end], bias[None], mask, divisor
        )
        out[b] = out[b] + hist[0]
    return out


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_m: int,
    block_n: int,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Eager-side validation: a compiled kernel would silently read garbage instead."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ModelError(
            f"prefill attention wants q, k, v [T, H, d] alike, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.dtype != v.dtype:
        raise ModelError(f"prefill attention wants k, v of one dtype, got {k.dtype}, {v.dtype}")
    check_kv_scale(k.dtype, kv_scale, q.shape[1])
    head_dim = q.shape[-1]
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ModelError(f"prefill attention needs a power-of-two head_dim >= 16, got {head_dim}")
    if block_m % block_n or max(block_m, block_n) > POS_PAD:
        raise ModelError(
            f"BLOCK_M={block_m} must be a multiple of BLOCK_N={block_n}, both <= {POS_PAD}"
        )


if triton_available():
    from streamrec.models.prefill_kernels import launch_candidates, launch_prefill

    @torch.library.triton_op(OP_PREFILL, mutates_args={})
    def jagged_silu_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ts: torch.Tensor,
        offsets: torch.Tensor,
        pos_bias: torch.Tensor,
        time_bias: torch.Tensor,
        edges: torch.Tensor,
        divisor: int,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal SiLU attention of every user's tokens (q, k, v [T, H, d] jagged)."""
        launch = PREFILL_THR_LAUNCH if PREFILL_THRESHOLDS else PREFILL_LAUNCHES[0]
        if q.dtype == torch.float32:
            launch = FP32_LAUNCH
        return launch_prefill(
            q, k, v, ts, offsets, pos_bias, time_bias, edges, divisor, *launch,
            kv_scale=kv_scale, thresholds=PREFILL_THRESHOLDS,
        )  # fmt: skip

    @torch.library.triton_op(OP_CANDIDATES, mutates_args={})
    def jagged_silu_attention_candidates(
        qc: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        query_ts: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ts: torch.Tensor,
        offsets: torch.Tensor,
        pos_bias: torch.Tensor,
        time_bias: torch.Tensor,
        edges: torch.Tensor,
        divisor: int,
    ) -> torch.Tensor:
        """C candidates per user (qc [B, C, H, d]) over the user's jagged K/V and self."""
        launch = FP32_LAUNCH if qc.dtype == torch.float32 else CAND_LAUNCH
        return launch_candidates(
            qc, kc, vc, query_ts, k, v, ts, offsets, pos_bias, time_bias, edges, divisor,
            *launch,
        )  # fmt: skip


def fused_prefill_enabled(
    backend: str, x: torch.Tensor, head_dim: int, num_time_buckets: int, bucket_width: float
) -> bool:
    """Whether prefill of tokens on x's device runs the fused op (same switch as the
    paged ops: "auto" when it can run, "triton" insists, "torch" never), and the cell
    table reproduces the model's time buckets exactly."""
    if not fused_attention_enabled(backend, x.new_empty((0, head_dim))):
        return False
    if time_cells_exact(num_time_buckets, bucket_width):
        return True
    if backend == "triton":
        raise ModelError(
            f"the fused prefill needs time buckets at least ln(1.25) wide, got "
            f"time_bucket_width={bucket_width} with {num_time_buckets} buckets"
        )
    return False


def fused_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ts: torch.Tensor,
    offsets: torch.Tensor,
    pos_bias: torch.Tensor,
    time_bias: torch.Tensor,
    edges: torch.Tensor,
    divisor: int,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Jagged causal attention (q, k, v [T, H, d]; offsets [B+1]) through the fused op;
    k, v may be FP8 codes with the layer's ``kv_scale [2, H]``."""
    check_inputs(q, k, v, PREFILL_BLOCK_M, PREFILL_BLOCK_N, kv_scale)
    ts, offsets = dense(ts, offsets)
    return torch.ops.streamrec.jagged_silu_attention(
        q, k, v, ts, offsets, pos_bias, time_bias, edges, divisor, kv_scale
    )


def fused_prefill_candidates(
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    query_ts: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ts: torch.Tensor,
    offsets: torch.Tensor,
    pos_bias: torch.Tensor,
    time_bias: torch.Tensor,
    edges: torch.Tensor,
    divisor: int,
) -> torch.Tensor:
    """Candidates (qc, kc, vc [B, C, H, d]) over jagged K/V [T, H, d] and themselves."""
    check_inputs(k, k, v, CAND_LAUNCH[0], CAND_LAUNCH[1])
    if qc.dim() != 4 or qc.shape != kc.shape or qc.shape != vc.shape or qc.shape[2:] != k.shape[1:]:
        raise ModelError(
            f"candidate attention wants qc, kc, vc [B, C, H, d] matching k [T, H, d], got "
            f"{tuple(qc.shape)}, {tuple(kc.shape)}, {tuple(vc.shape)}, {tuple(k.shape)}"
        )
    query_ts, ts, offsets = dense(query_ts, ts, offsets)
    return torch.ops.streamrec.jagged_silu_attention_candidates(
        qc, kc, vc, query_ts, k, v, ts, offsets, pos_bias, time_bias, edges, divisor
    )
