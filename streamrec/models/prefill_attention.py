# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""Fused jagged causal SiLU attention for prefill, and the candidate rule over its K/V.

A cache miss (and the full-recompute baseline) encodes whole histories. The dense path
pads every user to a ``[B, W]`` grid and materialises ``[B, H, W, W]`` scores, biases and
masks in HBM; here a Triton kernel walks the jagged tokens (values ``[T, H, d]`` +
offsets ``[B+1]``) in ``BLOCK_M × BLOCK_N`` tensor-core tiles, keeps scores in registers,
accumulates in fp32 and skips every tile above the diagonal.

The bias is computed in the kernel per (query, key) pair, so it must be cheap and exact:

- relative position: one gather ``pos_bias[i - j, h]`` (the table stays in L1/L2);
- time: ``bucketize(|ts_i - ts_j|, edges)`` with integer edges (``attention.py``). The
  timestamps are converted to fp64 (exact below 2^53 ms), so ``|dt|`` is exact; the
  exponent and the top two mantissa bits of ``|dt|`` name one of ``NUM_CELLS`` cells
  (a quarter octave each) that holds at most one edge (checked by ``time_cells_exact``).
  A small per-call table gives per cell that edge and the per-head bias below and above
  it, so the bucket's bias costs two independent gathers and one exact compare, and
  equals the reference bit for bit.

Programs are laid out jagged: user b's query tiles occupy program ids
``offsets[b] // BLOCK_M + b + (0 … tiles_b - 1)`` (disjoint for consecutive users, at most
one idle id per user), so the grid depends on the shapes only (``T // BLOCK_M + B + 1``)
and the ops export. Each user's heaviest (last) tile runs first.

Candidates (the rank rule in a full recompute): C candidates of user b sit at position
``len_b`` with the user's newest timestamp; they attend to all of b's tokens and to
themselves (the self term is folded into the kernel), never to each other. Their bias is
per key only, so one bias row serves the whole candidate tile; small batches are cut along
the keys (fp32 atomics), as SiLU attention has no softmax and partial sums add.
"""

from __future__ import annotations

import itertools
import math

import torch

from streamrec.errors import ModelError
from streamrec.models.attention import (
    relative_bias,
    self_attention_term,
    silu_attention,
    time_bucket_edges,
)
from streamrec.models.paged_attention import fast_silu_allowed, fused_attention_enabled

try:  # Triton ships with CUDA builds of torch only.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on the CPU CI machine
    triton = None
    tl = None

OP_PREFILL = "streamrec::jagged_silu_attention"
OP_CANDIDATES = "streamrec::jagged_silu_attention_candidates"
# Cells of |dt|: fp64 exponent (0 … 63 above 1 ms) x 4 quarter octaves.
NUM_CELLS = 256
# Launch shapes (bench/h200_bench.py sweeps them; see BENCHMARKS.md for the H200 figures).
PREFILL_BLOCK_M = 128
PREFILL_BLOCK_N = 64
PREFILL_WARPS = 8
PREFILL_STAGES = 2
# (BLOCK_M, BLOCK_N, warps, stages) the kernel sweep times; the defaults above come first.
PREFILL_LAUNCHES = (
    (PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_WARPS, PREFILL_STAGES),
    (128, 64, 8, 3),
    (128, 32, 8, 2),
    (128, 128, 8, 2),
    (64, 64, 4, 2),
    (64, 32, 4, 3),
)
# fp32 inputs (IEEE fp32 dots on CUDA cores, for exactness tests): tiles that fit in
# shared memory at head_dim 128.
FP32_LAUNCH = (64, 32, 4, 2)
CAND_BLOCK_M = 128
CAND_BLOCK_N = 64
CAND_WARPS = 8
CAND_STAGES = 2
CAND_TARGET_PROGRAMS = 512
CAND_LAUNCH = (CAND_BLOCK_M, CAND_BLOCK_N, CAND_WARPS, CAND_STAGES)
# Users whose tile origins one program scans per step when it looks up its own user.
USER_CHUNK = 256
# Largest edge for which a cell's edge compare is exact in fp64 with room to spare.
MAX_EDGE_MS = 2**52


def triton_available() -> bool:
    """True when the fused ops are registered (Triton imported)."""
    return triton is not None


def time_cells_exact(num_buckets: int, width: float) -> bool:
    """Whether the cell table of the kernels reproduces ``bucketize`` for these edges:
    every quarter-octave cell holds at most one edge (true for widths >= ln 1.25)."""
    edges = time_bucket_edges(num_buckets, width).tolist()
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
) -> torch.Tensor:
    """Causal SiLU attention of each user's tokens, one dense block per user: the oracle.

    q, k, v [T, H, d]; ts [T] int64; offsets [B+1]. Returns [T, H, d]. Eager only (one
    host read of the offsets).
    """
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


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int, block_n: int):
    """Eager-side validation: a compiled kernel would silently read garbage instead."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ModelError(
            f"prefill attention wants q, k, v [T, H, d] alike, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    head_dim = q.shape[-1]
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ModelError(f"prefill attention needs a power-of-two head_dim >= 16, got {head_dim}")
    if block_m % block_n:
        raise ModelError(f"BLOCK_M={block_m} must be a multiple of BLOCK_N={block_n}")


def _heads_strided(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last two axes are dense [H, d] (the projection's views are),
    else a contiguous copy: the kernels take the other strides as arguments."""
    if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return x
    return x.contiguous()


if triton is not None:

    @triton.jit
    def _silu_half(x, FAST: tl.constexpr):
        """silu(2x) in fp32, from half the pre-activation (the tables hold rab / 2): with
        FAST one tanh.approx, silu(2x) = x + x·tanh(x), whose 2^-11 relative error is below
        the bf16 rounding of the weights that follows; else the exact x·2·sigmoid(2x)."""
        if FAST:
            t = tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
            )
            return x + x * t
        else:
            return (2.0 * x * tl.sigmoid(2.0 * x)).to(tl.float32)

    @triton.jit
    def _scores(q, k, IEEE: tl.constexpr):
        """q [M, D] · k [N, D]ᵀ in fp32 (IEEE fp32 products for fp32 inputs, no TF32)."""
        if IEEE:
            return tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            return tl.dot(q, tl.trans(k))

    @triton.jit
    def _accumulate(acc, w, v, IEEE: tl.constexpr):
        """acc + w [M, N] (fp32) · v [N, D]; low-precision v: w rounded to v's dtype once."""
        if IEEE:
            return acc + tl.dot(w, v.to(tl.float32), input_precision="ieee")
        else:
            return acc + tl.dot(w.to(v.dtype), v)

    @triton.jit
    def _bucket(x, cell_edge_ptr, cell_base_ptr, NUM_CELLS: tl.constexpr):
        """bucketize(x, edges, right=True) for x >= 0, fp64 (an exact integer of ms), any
        shape. The cell of x is read from its fp64 bits (exponent and two mantissa bits: no
        rounding); the cell holds at most one edge, so the bucket is the cell's base plus
        one compare with that edge."""
        bits = x.to(tl.int64, bitcast=True)
        cell = ((bits >> 50) & 0x1FFF).to(tl.int32) - 4092  # 4092 = 1023 (exponent bias) * 4
        cell = tl.minimum(tl.maximum(cell, 0), NUM_CELLS - 1)
        above = x >= tl.load(cell_edge_ptr + cell)  # the edge is huge in a cell without one
        return tl.load(cell_base_ptr + cell) + above.to(tl.int32)

    @triton.jit
    def _min_max(lo_a, hi_a, lo_b, hi_b):
        return tl.minimum(lo_a, lo_b), tl.maximum(hi_a, hi_b)

    @triton.jit
    def _add_time_bias(bias, ts_q, ts_k, q_lo, q_hi, edges_ptr, tb_row, cell_edge_ptr,
                       cell_base_ptr, NUM_CELLS: tl.constexpr):  # fmt: skip
        """bias [BM, BN] + time_bias[bucket(|ts_i - ts_j|)] / 2 of one head, exactly.

        The tile's |dt| lie in [near, far] (from the query range [q_lo, q_hi] and the key
        range), so its buckets lie in [b_lo, b_hi]: one bucket for most tiles (a scalar
        add), else one fp64 compare and select per edge inside the range. No gathers.
        """
        k_lo, k_hi = tl.reduce((ts_k, ts_k), 0, _min_max)
        near = tl.maximum(tl.maximum(q_lo - k_hi, k_lo - q_hi), 0.0)
        far = tl.maximum(q_hi - k_lo, k_hi - q_lo)
        b_lo = _bucket(near, cell_edge_ptr, cell_base_ptr, NUM_CELLS)
        b_hi = _bucket(far, cell_edge_ptr, cell_base_ptr, NUM_CELLS)
        t_lo = tl.load(tb_row + b_lo)
        if b_lo < b_hi:
            adt = tl.abs(ts_q[:, None] - ts_k[None, :])  # [BM, BN] fp64, exact
            t = tl.zeros(bias.shape, dtype=tl.float32) + t_lo
            for b in range(b_lo + 1, b_hi + 1):  # bucket >= b iff |dt| >= edges[b - 1]
                edge = tl.load(edges_ptr + b - 1).to(tl.float64)
                t = tl.where(adt >= edge, tl.load(tb_row + b), t)
            bias = bias + t
        else:
            bias = bias + t_lo
        return bias

    @triton.jit
    def _key_rab(rel, dt, pos_row, tb_row, cell_edge_ptr, cell_base_ptr, NUM_POS: tl.constexpr,
                 NUM_CELLS: tl.constexpr):  # fmt: skip
        """rab / 2 of one head per key (the candidates' bias row): two small gathers."""
        rel = tl.minimum(tl.maximum(rel, 0), NUM_POS - 1)
        bucket = _bucket(tl.abs(dt), cell_edge_ptr, cell_base_ptr, NUM_CELLS)
        return tl.load(pos_row + rel) + tl.load(tb_row + bucket)

    @triton.jit
    def _bias_table_kernel(
        pos_bias_ptr,  # [NUM_POS, H]
        edges_ptr,  # [NUM_TIME - 1] int64
        time_bias_ptr,  # [NUM_TIME, H]
        pos_out_ptr,  # [H, NUM_POS] fp32: pos_bias / 2, transposed
        tb_out_ptr,  # [H, NUM_TIME] fp32: time_bias / 2, transposed
        cell_edge_ptr,  # [NUM_CELLS] fp64: the edge inside each cell (huge if none)
        cell_base_ptr,  # [NUM_CELLS] int32: the buckets below each cell
        H: tl.constexpr,
        NUM_POS: tl.constexpr,
        NUM_TIME: tl.constexpr,
        NT_P2: tl.constexpr,
        NUM_CELLS: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """One head's rows (and, head 0, the cells c = 4o + f: [2^o(1 + f/4), 2^o(1 + (f+1)/4)).
        Halving is exact, so twice the sum of two halves is the reference's fp32 sum."""
        h = tl.program_id(0)
        for p0 in range(0, NUM_POS, CHUNK):
            p = p0 + tl.arange(0, CHUNK)
            pmask = p < NUM_POS
            row = tl.load(pos_bias_ptr + p * H + h, mask=pmask, other=0.0).to(tl.float32)
            tl.store(pos_out_ptr + h * NUM_POS + p, row * 0.5, mask=pmask)
        t = tl.arange(0, NT_P2)
        tmask = t < NUM_TIME
        row = tl.load(time_bias_ptr + t * H + h, mask=tmask, other=0.0).to(tl.float32)
        tl.store(tb_out_ptr + h * NUM_TIME + t, row * 0.5, mask=tmask)
        c = tl.arange(0, NUM_CELLS)
        octave = (c // 4).to(tl.int64)
        pow2 = ((octave + 1023) << 52).to(tl.float64, bitcast=True)  # 2^octave, exact
        lower = pow2 * (1.0 + (c % 4).to(tl.float64) * 0.25)  # [NC], exact
        emask = t < NUM_TIME - 1
        edges = tl.load(edges_ptr + t, mask=emask, other=0).to(tl.float64)  # exact < 2^53
        below = (edges[None, :] < lower[:, None]) & emask[None, :]  # [NC, NT_P2]
        base = tl.sum(below.to(tl.int32), 1)  # [NC] buckets entirely below the cell
        has_edge = base < NUM_TIME - 1
        edge = tl.load(edges_ptr + base, mask=has_edge, other=0).to(tl.float64)
        first = (c >= 0) & (h == 0)
        tl.store(cell_edge_ptr + c, tl.where(has_edge, edge, 1e300), mask=first)
        tl.store(cell_base_ptr + c, base, mask=first)

    @triton.jit
    def _key_tile(k_ptr, v_ptr, ts_ptr, start, cols, end, h, stride_k, stride_v,
                  D: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
        """K, V [BN, D] and fp64 timestamps [BN] of one user's keys ``cols``; with MASKED,
        keys at or past ``end`` read as zeros (a zero V row adds nothing)."""
        tok = (start + cols).to(tl.int64)
        kv = tok[:, None] * stride_k + h * D + tl.arange(0, D)[None, :]
        vv = tok[:, None] * stride_v + h * D + tl.arange(0, D)[None, :]
        if MASKED:
            kmask = cols < end
            k = tl.load(k_ptr + kv, mask=kmask[:, None], other=0.0)
            v = tl.load(v_ptr + vv, mask=kmask[:, None], other=0.0)
            ts_k = tl.load(ts_ptr + tok, mask=kmask, other=0).to(tl.float64)
        else:
            k = tl.load(k_ptr + kv)
            v = tl.load(v_ptr + vv)
            ts_k = tl.load(ts_ptr + tok).to(tl.float64)
        return k, v, ts_k

    @triton.jit
    def _prefill_tile(
        acc, q, rows, ts_q, q_lo, q_hi, n0, n, start, h, k_ptr, v_ptr, ts_ptr, pos_row, tb_row,
        edges_ptr, cell_edge_ptr, cell_base_ptr, stride_k, stride_v, half_scale,
        D: tl.constexpr, NUM_POS: tl.constexpr, NUM_CELLS: tl.constexpr,
        BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr, IEEE: tl.constexpr, FAST: tl.constexpr,
    ):  # fmt: skip
        """acc + Σ_j silu(q·k_j/√d + rab) v_j over keys n0 … n0+BLOCK_N-1 (times N)."""
        cols = n0 + tl.arange(0, BLOCK_N)  # [BN] positions in the user
        # (diagonal tiles: keys past the user's end read as zeros and are masked below)
        k, v, ts_k = _key_tile(k_ptr, v_ptr, ts_ptr, start, cols, n, h, stride_k, stride_v, D,
                               DIAGONAL)  # fmt: skip
        if DIAGONAL:  # keys past the end take key n0's timestamp: they stretch no range
            ts_k = tl.where(cols < n, ts_k, tl.load(ts_ptr + start + n0).to(tl.float64))
        s = _scores(q, k, IEEE)  # [BM, BN] fp32
        rel = rows[:, None] - cols[None, :]  # >= 1 below the diagonal; padding rows clamped
        if DIAGONAL:
            rel = tl.maximum(rel, 0)
        bias = tl.load(pos_row + tl.minimum(rel, NUM_POS - 1))
        bias = _add_time_bias(bias, ts_q, ts_k, q_lo, q_hi, edges_ptr, tb_row, cell_edge_ptr,
                              cell_base_ptr, NUM_CELLS)  # fmt: skip
        w = _silu_half((s * half_scale).to(tl.float32) + bias, FAST)
        if DIAGONAL:
            w = tl.where(cols[None, :] <= rows[:, None], w, 0.0)
        return _accumulate(acc, w, v, IEEE)

    @triton.jit
    def _prefill_kernel(
        q_ptr,  # [T, H, D], rows stride_q apart
        k_ptr,  # [T, H, D]
        v_ptr,  # [T, H, D]
        ts_ptr,  # [T] int64
        offsets_ptr,  # [B + 1] int64
        pos_ptr,  # [H, NUM_POS] fp32 (``bias_tables``, as the next three)
        tb_ptr,  # [H, NUM_TIME] fp32
        cell_edge_ptr,  # [NUM_CELLS] fp64
        cell_base_ptr,  # [NUM_CELLS] int32
        edges_ptr,  # [NUM_TIME - 1] int64
        out_ptr,  # [T, H, D] contiguous
        num_users,
        stride_q,
        stride_k,
        stride_v,
        half_scale,
        inv_divisor,
        H: tl.constexpr,
        D: tl.constexpr,
        NUM_POS: tl.constexpr,
        NUM_TIME: tl.constexpr,
        NUM_CELLS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        USER_CHUNK: tl.constexpr,
        IEEE: tl.constexpr,
        FAST: tl.constexpr,
    ):
        """One query tile of one user x one head, causal over that user's keys."""
        pid = tl.program_id(0)
        h = tl.program_id(1)
        # The user of this program: the last b whose first tile id offsets[b]//BM + b <= pid.
        count = 0
        for c0 in range(0, num_users, USER_CHUNK):
            b = c0 + tl.arange(0, USER_CHUNK)
            bmask = b < num_users
            first = tl.load(offsets_ptr + b, mask=bmask, other=0) // BLOCK_M + b
            count += tl.sum(((first <= pid) & bmask).to(tl.int32), 0)
        user = count - 1
        start = tl.load(offsets_ptr + user)
        n = (tl.load(offsets_ptr + user + 1) - start).to(tl.int32)
        local = pid - (start // BLOCK_M + user).to(tl.int32)
        n_tiles = (n + BLOCK_M - 1) // BLOCK_M
        if local < n_tiles:
            m0 = (n_tiles - 1 - local) * BLOCK_M  # heaviest tile of the user first
            rows = m0 + tl.arange(0, BLOCK_M)  # [BM] positions in the user
            rmask = rows < n
            tok = (start + rows).to(tl.int64)
            offs_d = tl.arange(0, D)
            q = tl.load(q_ptr + tok[:, None] * stride_q + h * D + offs_d[None, :],
                        mask=rmask[:, None], other=0.0)  # fmt: skip
            ts_q = tl.load(ts_ptr + tok, mask=rmask, other=0).to(tl.float64)
            # padding rows take row m0's timestamp: they stretch no range
            ts_q = tl.where(rmask, ts_q, tl.load(ts_ptr + start + m0).to(tl.float64))
            q_lo, q_hi = tl.reduce((ts_q, ts_q), 0, _min_max)
            pos_row = pos_ptr + h * NUM_POS
            tb_row = tb_ptr + h * NUM_TIME
            acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
            for n0 in range(0, m0, BLOCK_N):  # below the diagonal: no mask
                acc = _prefill_tile(
                    acc, q, rows, ts_q, q_lo, q_hi, n0, n, start, h, k_ptr, v_ptr, ts_ptr,
                    pos_row, tb_row, edges_ptr, cell_edge_ptr, cell_base_ptr, stride_k, stride_v,
                    half_scale, D, NUM_POS, NUM_CELLS, BLOCK_N, False, IEEE, FAST,
                )  # fmt: skip
            for n0 in range(m0, tl.minimum(m0 + BLOCK_M, n), BLOCK_N):  # the diagonal
                acc = _prefill_tile(
                    acc, q, rows, ts_q, q_lo, q_hi, n0, n, start, h, k_ptr, v_ptr, ts_ptr,
                    pos_row, tb_row, edges_ptr, cell_edge_ptr, cell_base_ptr, stride_k, stride_v,
                    half_scale, D, NUM_POS, NUM_CELLS, BLOCK_N, True, IEEE, FAST,
                )  # fmt: skip
            out = out_ptr + (tok[:, None] * H + h) * D + offs_d[None, :]
            acc = (acc * inv_divisor).to(out_ptr.dtype.element_ty)  # the constant N, once
            tl.store(out, acc, mask=rmask[:, None])

    @triton.jit
    def _candidate_kernel(
        qc_ptr,  # [B, C, H, D], strides stride_cb, stride_cc
        kc_ptr,  # [B, C, H, D], same strides
        vc_ptr,  # [B, C, H, D], same strides
        query_ts_ptr,  # [B] int64
        k_ptr,  # [T, H, D]
        v_ptr,  # [T, H, D]
        ts_ptr,  # [T]
        offsets_ptr,  # [B + 1]
        pos_ptr,  # [H, NUM_POS] fp32 (``bias_tables``, as the next two)
        tb_ptr,  # [H, NUM_TIME] fp32
        cell_edge_ptr,  # [NUM_CELLS] fp64
        cell_base_ptr,  # [NUM_CELLS] int32
        out_ptr,  # [B, C, H, D] contiguous (fp32 and zeroed when ATOMIC)
        num_cands,
        m_tiles,
        keys_per_split,
        stride_cb,
        stride_cc,
        stride_k,
        stride_v,
        half_scale,
        inv_divisor,
        H: tl.constexpr,
        D: tl.constexpr,
        NUM_POS: tl.constexpr,
        NUM_TIME: tl.constexpr,
        NUM_CELLS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        FAST: tl.constexpr,
        ATOMIC: tl.constexpr,
    ):
        """A tile of one user's candidates x one head x one key range (+ self in split 0)."""
        pid = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        user = (pid // m_tiles).to(tl.int64)
        tile = pid % m_tiles
        start = tl.load(offsets_ptr + user)
        n = (tl.load(offsets_ptr + user + 1) - start).to(tl.int32)
        k_start = split * keys_per_split
        k_end = tl.minimum(n, k_start + keys_per_split)
        if (k_start < k_end) | (split == 0):
            offs_d = tl.arange(0, D)
            cand = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
            cmask = cand < num_cands
            crow = user * stride_cb + cand.to(tl.int64) * stride_cc + h * D  # [BM]
            q = tl.load(qc_ptr + crow[:, None] + offs_d[None, :], mask=cmask[:, None], other=0.0)
            ts_q = tl.load(query_ts_ptr + user).to(tl.float64)
            pos_row = pos_ptr + h * NUM_POS
            tb_row = tb_ptr + h * NUM_TIME
            acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
            for n0 in range(k_start, k_end, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                k, v, ts_k = _key_tile(k_ptr, v_ptr, ts_ptr, start, cols, k_end, h, stride_k,
                                       stride_v, D, True)  # fmt: skip
                s = _scores(q, k, IEEE)  # [BM, BN]
                bias = _key_rab(n - cols, ts_q - ts_k, pos_row, tb_row, cell_edge_ptr,
                                cell_base_ptr, NUM_POS, NUM_CELLS)  # fmt: skip
                w = _silu_half((s * half_scale).to(tl.float32) + bias[None, :], FAST)
                acc = _accumulate(acc, w, v, IEEE)  # keys past k_end: V rows are zero
            if split == 0:  # the candidate's own key (i - j = 0, dt = 0)
                kc = tl.load(kc_ptr + crow[:, None] + offs_d[None, :], mask=cmask[:, None],
                             other=0.0).to(tl.float32)  # fmt: skip
                vc = tl.load(vc_ptr + crow[:, None] + offs_d[None, :], mask=cmask[:, None],
                             other=0.0).to(tl.float32)  # fmt: skip
                zero = tl.zeros((BLOCK_M,), dtype=tl.int32)
                bias0 = _key_rab(zero, zero.to(tl.float64), pos_row, tb_row, cell_edge_ptr,
                                 cell_base_ptr, NUM_POS, NUM_CELLS)  # fmt: skip
                s0 = (tl.sum(q.to(tl.float32) * kc, 1) * half_scale).to(tl.float32) + bias0
                acc += _silu_half(s0, False)[:, None] * vc
            out = out_ptr + ((user * num_cands + cand) * H + h)[:, None] * D + offs_d[None, :]
            acc = (acc * inv_divisor).to(tl.float32)  # the constant N, once
            if ATOMIC:
                tl.atomic_add(out, acc, mask=cmask[:, None])
            else:
                tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=cmask[:, None])

    def bias_tables(
        pos_bias: torch.Tensor, time_bias: torch.Tensor, edges: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The kernels' tables (one small launch per call): pos_bias / 2 [H, NUM_POS] and
        time_bias / 2 [H, NUM_TIME] fp32, per head; per cell its edge [NUM_CELLS] fp64 and
        the buckets below it [NUM_CELLS] int32."""
        num_time, num_heads = time_bias.shape
        num_pos = pos_bias.shape[0]
        dev = time_bias.device
        pos_bias, time_bias = pos_bias.contiguous(), time_bias.contiguous()
        pos = torch.empty(num_heads, num_pos, dtype=torch.float32, device=dev)
        tb = torch.empty(num_heads, num_time, dtype=torch.float32, device=dev)
        cell_edge = torch.empty(NUM_CELLS, dtype=torch.float64, device=dev)
        cell_base = torch.empty(NUM_CELLS, dtype=torch.int32, device=dev)
        torch.library.wrap_triton(_bias_table_kernel)[(num_heads,)](
            pos_bias, edges, time_bias, pos, tb, cell_edge, cell_base, H=num_heads,
            NUM_POS=num_pos, NUM_TIME=num_time, NT_P2=triton.next_power_of_2(num_time),
            NUM_CELLS=NUM_CELLS, CHUNK=1024,
        )  # fmt: skip
        return pos, tb, cell_edge, cell_base

    def launch_prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ts: torch.Tensor,
        offsets: torch.Tensor,
        pos_bias: torch.Tensor,
        time_bias: torch.Tensor,
        edges: torch.Tensor,
        divisor: int,
        block_m: int = PREFILL_BLOCK_M,
        block_n: int = PREFILL_BLOCK_N,
        num_warps: int = PREFILL_WARPS,
        num_stages: int = PREFILL_STAGES,
        fast: bool = True,
    ) -> torch.Tensor:
        """The prefill kernel with an explicit launch shape (the op uses the defaults;
        bench/h200_bench.py sweeps them). Returns [T, H, d] in q's dtype."""
        q, k, v = _heads_strided(q), _heads_strided(k), _heads_strided(v)
        ts, offsets = ts.contiguous(), offsets.contiguous()  # indexed as dense vectors
        num_tokens, num_heads, head_dim = q.shape
        num_users = offsets.shape[0] - 1
        edges = edges.contiguous()
        tables = bias_tables(pos_bias, time_bias, edges)
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        grid = (num_tokens // block_m + num_users + 1, num_heads)
        torch.library.wrap_triton(_prefill_kernel)[grid](
            q, k, v, ts, offsets, *tables, edges, out, num_users, q.stride(0), k.stride(0),
            v.stride(0), 0.5 / math.sqrt(head_dim), 1.0 / divisor, H=num_heads, D=head_dim,
            NUM_POS=pos_bias.shape[0], NUM_TIME=time_bias.shape[0], NUM_CELLS=NUM_CELLS,
            BLOCK_M=block_m, BLOCK_N=block_n, USER_CHUNK=USER_CHUNK, IEEE=q.dtype == torch.float32,
            FAST=fast_silu_allowed(fast, q), num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
        return out

    def launch_candidates(
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
        block_m: int = CAND_BLOCK_M,
        block_n: int = CAND_BLOCK_N,
        num_warps: int = CAND_WARPS,
        num_stages: int = CAND_STAGES,
        target_programs: int = CAND_TARGET_PROGRAMS,
        fast: bool = True,
    ) -> torch.Tensor:
        """The candidate kernel with an explicit launch shape. Returns [B, C, H, d]."""
        qc, kc, vc = _heads_strided(qc), _heads_strided(kc), _heads_strided(vc)
        if kc.stride() != qc.stride() or vc.stride() != qc.stride():
            qc, kc, vc = qc.contiguous(), kc.contiguous(), vc.contiguous()
        k, v = _heads_strided(k), _heads_strided(v)
        ts, offsets, query_ts = ts.contiguous(), offsets.contiguous(), query_ts.contiguous()
        num_users, num_cands, num_heads, head_dim = qc.shape
        tables = bias_tables(pos_bias, time_bias, edges.contiguous())
        m_tiles = (num_cands + block_m - 1) // block_m
        # Keys are cut so that about target_programs run; a user never has more than
        # NUM_POS (= max_seq_len) keys, so splits past its length return at once.
        span = pos_bias.shape[0]
        programs = num_users * m_tiles * num_heads
        wanted = -(-target_programs // programs)
        splits = torch.sym_max(1, torch.sym_min((span + block_n - 1) // block_n, wanted))
        per_split = (span + splits - 1) // splits
        per_split = (per_split + block_n - 1) // block_n * block_n
        atomic = not isinstance(splits, int) or splits > 1
        dtype = torch.float32 if atomic else qc.dtype
        alloc = torch.zeros if atomic else torch.empty
        out = alloc(qc.shape, dtype=dtype, device=qc.device)
        grid = (num_users * m_tiles, num_heads, splits)
        torch.library.wrap_triton(_candidate_kernel)[grid](
            qc, kc, vc, query_ts, k, v, ts, offsets, *tables, out, num_cands, m_tiles,
            per_split, qc.stride(0), qc.stride(1), k.stride(0), v.stride(0),
            0.5 / math.sqrt(head_dim), 1.0 / divisor, H=num_heads, D=head_dim,
            NUM_POS=pos_bias.shape[0], NUM_TIME=time_bias.shape[0], NUM_CELLS=NUM_CELLS,
            BLOCK_M=block_m, BLOCK_N=block_n, IEEE=qc.dtype == torch.float32,
            FAST=fast_silu_allowed(fast, qc), ATOMIC=atomic, num_warps=num_warps,
            num_stages=num_stages,
        )  # fmt: skip
        return out.to(qc.dtype)

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
    ) -> torch.Tensor:
        """Causal SiLU attention of every user's tokens (q, k, v [T, H, d] jagged)."""
        launch = FP32_LAUNCH if q.dtype == torch.float32 else PREFILL_LAUNCHES[0]
        return launch_prefill(q, k, v, ts, offsets, pos_bias, time_bias, edges, divisor, *launch)

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
) -> torch.Tensor:
    """Jagged causal attention (q, k, v [T, H, d]; offsets [B+1]) through the fused op."""
    check_inputs(q, k, v, PREFILL_BLOCK_M, PREFILL_BLOCK_N)
    return torch.ops.streamrec.jagged_silu_attention(
        q, k, v, ts, offsets, pos_bias, time_bias, edges, divisor
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
    check_inputs(k, k, v, CAND_BLOCK_M, CAND_BLOCK_N)
    if qc.dim() != 4 or qc.shape != kc.shape or qc.shape != vc.shape or qc.shape[2:] != k.shape[1:]:
        raise ModelError(
            f"candidate attention wants qc, kc, vc [B, C, H, d] matching k [T, H, d], got "
            f"{tuple(qc.shape)}, {tuple(kc.shape)}, {tuple(vc.shape)}, {tuple(k.shape)}"
        )
    return torch.ops.streamrec.jagged_silu_attention_candidates(
        qc, kc, vc, query_ts, k, v, ts, offsets, pos_bias, time_bias, edges, divisor
    )
