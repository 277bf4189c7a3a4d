# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""The Triton kernels of the fused jagged prefill (``prefill_attention`` registers the ops).

Biases, computed in the kernels, exactly (2 x the tables' halves is the reference's sum):

- relative position: one gather ``pos_bias[i - j, h]`` from a per-head row padded with
  zeros, so tiles index it without a clamp (the row stays in L1);
- time: ``bucketize(|ts_i - ts_j|, edges)`` with integer edges, from timestamps (any
  user) or from key positions (users whose timestamps never decrease, with
  ``thresholds``): ``time_bias_kernels.py``. A per-call table holds the min and max
  timestamp of every BLOCK_N keys of every user, so each tile knows which buckets its
  |dt| can reach; most tiles hit one bucket (a scalar add).

Programs are laid out jagged: user b's query tiles occupy program ids
``offsets[b] // BLOCK_M + b + (0 … tiles_b - 1)`` (disjoint for consecutive users, at most
one idle id per user), so the grid depends on the shapes only (``T // BLOCK_M + B + 1``)
and the ops export. Each user's heaviest (last) tile runs first. Tiles address a user's
rows with int32 offsets from the user's first row.

Candidates (the rank rule of a full recompute) share one bias row per key; small batches
are cut along the keys (fp32 atomics: SiLU attention has no softmax, partial sums add).
The launch shapes were chosen offline (``bench/kernel_resources.py``).

FP8 K/V (``kv_scale``, the layer's ``[2, H]`` power-of-two scales of models/fp8.py): the
prefill kernel reads e4m3 codes, converts them to the query's dtype in registers (exact)
and folds the head's K scale into the score scale and its V scale into the final 1/N,
so it computes what it would over the dequantized values. (The candidate kernel, used by
the full-recompute baseline only, reads the model dtype.)
"""

from __future__ import annotations

import math

import torch

from streamrec.errors import ModelError
from streamrec.models.paged_attention import fast_silu_allowed
from streamrec.models.time_bias_kernels import NUM_CELLS, POS_PAD
from streamrec.models.triton_lang import tl, triton

# Launch shapes (bench/h200_bench.py sweeps them; BENCHMARKS.md has the H200 figures).
# BLOCK_N = 64 spills inside the key loop at 255 registers (ptxas, sm_90a). Of the shapes
# that do not, 128 x 16 tiles, 8 warps, 3 stages is the fastest at batch 8 and 64 on the
# H200 (1.16-1.18x the 64 x 32 x 4 x 2 it replaced, 2026-12-01) and the H100 (1.36-1.44x
# at batch 64, 2026-12-06); 225 registers, no spills. A single short user runs ~1.4x
# slower on it (H200, batch 1, history 1,000: 0.156 against 0.114 ms): a cache miss, not
# the warm-up.
PREFILL_BLOCK_M = 128
PREFILL_BLOCK_N = 16
PREFILL_WARPS = 8
PREFILL_STAGES = 3
# A prefill tile whose |dt| span more than this many time buckets takes each element's
# bucket from its cell (three gathers) instead of one compare per bucket edge
# (``add_time_bias``); 32 (> any bucket count) keeps the compare loop everywhere.
PREFILL_BUCKET_LOOP = 4
# Users whose timestamps never decrease take the time bias from key positions
# (time_bias_kernels.py), at their own launch shape: 64 x 16 tiles, 4 warps, 4 stages (two
# CTAs per SM). H100, batch 64 (2026-12-06, fifteenth session): 64 users of the warm-up's
# skewed lengths 4.436 ms against 5.185 (1.17x); history 4,096 15.70 against 19.00
# (1.21x); history 1,000 1.636 against 1.530 (0.94x). The warm-up's mix decides: on.
PREFILL_THRESHOLDS = True
PREFILL_THR_LAUNCH = (64, 16, 4, 4)
# Sorted users' key tiles take their bucket range from the thresholds of the query tile's
# first and last rows (loaded once per program; two compares and sums per tile) instead of
# the tile's timestamp range and the cell tables: sm_90a SASS shows the latter as ten
# single-element asynchronous copies per key tile (BENCHMARKS.md issue 14, seventeenth
# session). Exact (the same buckets, bit for bit on the interpreter and in the bf16 gpu
# tests). H100, batch 64 of the warm-up's skewed lengths (2026-12-06, eighteenth
# session, stage prefill-tr): 3.980 ms against 4.466 (1.12x, 66.1 TFLOP/s): on.
PREFILL_TILE_RANGE = True
# (BLOCK_M, BLOCK_N, warps, stages) the kernel sweep times; the defaults above come first.
PREFILL_LAUNCHES = (
    (PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_WARPS, PREFILL_STAGES),
    (64, 32, 4, 2),
    (128, 32, 8, 2),
    (64, 32, 4, 3),
    (128, 32, 8, 3),
    (64, 64, 4, 2),
    (128, 64, 8, 2),
)
# fp32 inputs (IEEE fp32 dots on CUDA cores, for exactness tests): tiles that fit in
# shared memory at head_dim 128.
FP32_LAUNCH = (64, 32, 4, 2)
CAND_BLOCK_M = 128
CAND_BLOCK_N = 32
CAND_WARPS = 8
CAND_STAGES = 2
CAND_TARGET_PROGRAMS = 512
CAND_LAUNCH = (CAND_BLOCK_M, CAND_BLOCK_N, CAND_WARPS, CAND_STAGES)
# Users whose tile origins one program scans per step when it looks up its own user.
USER_CHUNK = 256


def triton_available() -> bool:
    """True when the kernels (and the ops) exist: Triton imported."""
    return triton is not None


def _check_offsets(max_len: int, *rows: torch.Tensor) -> None:
    """Tiles address a user's rows with int32 offsets from the user's first row."""
    stride = max(x.stride(0) for x in rows)
    if (max_len + POS_PAD) * stride >= 2**31:
        raise ModelError(f"max_seq_len={max_len} x row stride {stride} overflows int32 offsets")


def _heads_strided(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last two axes are dense [H, d] (the projection's views are),
    else a contiguous copy: the kernels take the other strides as arguments."""
    if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return x
    return x.contiguous()


if triton is not None:
    from streamrec.models.time_bias_kernels import (
        add_time_bias,
        add_time_bias_sorted,
        bias_tables,
        bucket_range,
        bucket_thresholds,
        key_rab,
    )

    @triton.jit
    def _silu_half(x, FAST: tl.constexpr):
        """silu(2x) in fp32, from half the pre-activation (the tables hold rab / 2): with
        FAST one tanh.approx, silu(2x) = x + x·tanh(x), whose 2^-11 relative error is below
        the bf16 rounding of the weights that follows; else the exact x·2·sigmoid(2x)."""
        if FAST:
            t = tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;",
                "=f,f",
                [x.to(tl.float32)],
                dtype=tl.float32,
                is_pure=True,
                pack=1,
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
    def _ts_range_kernel(
        ts_ptr,  # [T] int64
        offsets_ptr,  # [B + 1] int64
        range_ptr,  # [T // CHUNK + B + 1, 2] fp64
        CHUNK: tl.constexpr,
        CHUNKS: tl.constexpr,
    ):
        """Min and max timestamp of every CHUNK tokens of user b (program b) from its start,
        at row offsets[b] // CHUNK + b + j (disjoint per user, as the prefill tiles)."""
        user = tl.program_id(0)
        start = tl.load(offsets_ptr + user)
        n = (tl.load(offsets_ptr + user + 1) - start).to(tl.int32)
        base = start // CHUNK + user
        for j0 in range(0, n, CHUNK * CHUNKS):
            j = j0 // CHUNK + tl.arange(0, CHUNKS)  # [CHUNKS] chunk ids in the user
            pos = j[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]  # [CHUNKS, CHUNK]
            inside = pos < n
            t = tl.load(ts_ptr + start + pos, mask=inside, other=0).to(tl.float64)
            lo = tl.min(tl.where(inside, t, 1e300), 1)
            hi = tl.max(tl.where(inside, t, -1e300), 1)
            row = range_ptr + (base + j) * 2
            tl.store(row, lo, mask=j * CHUNK < n)
            tl.store(row + 1, hi, mask=j * CHUNK < n)

    @triton.jit
    def _ts_range(range_row, first, count, n, CHUNK: tl.constexpr):
        """Min and max timestamp over chunks first … first+count-1 of a user (``_ts_range_kernel``
        rows from ``range_row``); chunks at or past the user's end are skipped."""
        lo = tl.load(range_row + first * 2)
        hi = tl.load(range_row + first * 2 + 1)
        for i in tl.static_range(1, count):
            inside = (first + i) * CHUNK < n
            lo = tl.minimum(lo, tl.load(range_row + (first + i) * 2, mask=inside, other=1e300))
            hi = tl.maximum(hi, tl.load(range_row + (first + i) * 2 + 1, mask=inside,
                                        other=-1e300))  # fmt: skip
        return lo, hi

    @triton.jit
    def _key_tile(k_base, v_base, ts_base, cols, end, stride_k, stride_v, D: tl.constexpr,
                  MASKED: tl.constexpr):  # fmt: skip
        """K, V [BN, D] and fp64 timestamps [BN] of one user's keys ``cols`` (int32 offsets
        from the user's head row); with MASKED, keys at or past ``end`` read as zeros (a
        zero V row adds nothing)."""
        kv = cols[:, None] * stride_k + tl.arange(0, D)[None, :]
        vv = cols[:, None] * stride_v + tl.arange(0, D)[None, :]
        if MASKED:
            kmask = cols < end
            k = tl.load(k_base + kv, mask=kmask[:, None], other=0.0)
            v = tl.load(v_base + vv, mask=kmask[:, None], other=0.0)
            ts_k = tl.load(ts_base + cols, mask=kmask, other=0).to(tl.float64)
        else:
            k = tl.load(k_base + kv)
            v = tl.load(v_base + vv)
            ts_k = tl.load(ts_base + cols).to(tl.float64)
        return k, v, ts_k

    @triton.jit
    def _prefill_tile(
        acc, q, rows, ts_q, q_lo, q_hi, n0, n, k_base, v_base, ts_base, range_row, pos_row,
        tb_row, edges_ptr, cell_edge_ptr, cell_base_ptr, stride_k, stride_v, half_scale,
        D: tl.constexpr, NUM_CELLS: tl.constexpr, BLOCK_N: tl.constexpr,
        DIAGONAL: tl.constexpr, IEEE: tl.constexpr, FAST: tl.constexpr,
        KV_FP8: tl.constexpr, BUCKET_LOOP: tl.constexpr, thr_base, NUM_EDGES: tl.constexpr,
        THRESHOLDS: tl.constexpr, thr_first, thr_last, TILE_RANGE: tl.constexpr,
    ):  # fmt: skip
        """acc + Σ_j silu(q·k_j/√d + rab) v_j over keys n0 … n0+BLOCK_N-1 (times N; with
        KV_FP8 k, v are codes and the scales are in ``half_scale`` and the caller's 1/N)."""
        cols = n0 + tl.arange(0, BLOCK_N)  # [BN] positions in the user
        # (diagonal tiles: keys past the user's end read as zeros and are masked below)
        k, v, ts_k = _key_tile(k_base, v_base, ts_base, cols, n, stride_k, stride_v, D,
                               DIAGONAL)  # fmt: skip
        if KV_FP8:  # e4m3 codes in the query's dtype (exact) for the dots
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = _scores(q, k, IEEE)  # [BM, BN] fp32
        # i - j needs no clamp: the padded row covers the diagonal and the padding rows
        bias = tl.load(pos_row + (rows[:, None] - n0) - tl.arange(0, BLOCK_N)[None, :])
        if THRESHOLDS:  # the user's timestamps never decrease (time_bias_kernels.py)
            if TILE_RANGE:  # from the thresholds of the query tile's first and last rows
                b_lo = tl.sum((thr_first > n0 + BLOCK_N - 1).to(tl.int32), 0)
                b_hi = tl.sum((thr_last > n0).to(tl.int32), 0)
            else:
                k_lo, k_hi = _ts_range(range_row, n0 // BLOCK_N, 1, n, BLOCK_N)
                b_lo, b_hi = bucket_range(q_lo, q_hi, k_lo, k_hi, cell_edge_ptr,
                                           cell_base_ptr, NUM_CELLS)  # fmt: skip
            bias = add_time_bias_sorted(bias, rows, cols, n, thr_base, b_lo, b_hi, tb_row,
                                        NUM_EDGES)  # fmt: skip
        else:
            k_lo, k_hi = _ts_range(range_row, n0 // BLOCK_N, 1, n, BLOCK_N)
            bias = add_time_bias(bias, ts_q, ts_k, q_lo, q_hi, k_lo, k_hi, edges_ptr, tb_row,
                                  cell_edge_ptr, cell_base_ptr, NUM_CELLS, BUCKET_LOOP)  # fmt: skip
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
        range_ptr,  # [T // BLOCK_N + B + 1, 2] fp64 (``_ts_range_kernel``, CHUNK = BLOCK_N)
        pos_ptr,  # [H, POS_PAD + NUM_POS + POS_PAD] fp32 (``bias_tables``, as the next three)
        tb_ptr,  # [H, NUM_TIME] fp32
        cell_edge_ptr,  # [NUM_CELLS] fp64
        cell_base_ptr,  # [NUM_CELLS] int32
        edges_ptr,  # [NUM_TIME - 1] int64
        kv_scale_ptr,  # [2, H] fp32 (KV_FP8): a key/value is code * scale
        thr_ptr,  # [T, NUM_TIME - 1] int32 (MODE 1): ``time_bias_kernels.bucket_thresholds``
        sorted_ptr,  # [B] int32 (MODE 1, 2): 1 where the user's timestamps never decrease
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
        POS_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        USER_CHUNK: tl.constexpr,
        IEEE: tl.constexpr,
        FAST: tl.constexpr,
        KV_FP8: tl.constexpr,
        BUCKET_LOOP: tl.constexpr,
        MODE: tl.constexpr,
        TILE_RANGE: tl.constexpr,
        NT_P2: tl.constexpr,
    ):
        """One query tile of one user x one head, causal over that user's keys. MODE 0:
        every user, the general time bias; 1: users whose timestamps never decrease, by
        thresholds; 2: the other users, general (1 and 2 are two launches of one call)."""
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
        active = local < n_tiles
        if MODE == 1:
            active = active & (tl.load(sorted_ptr + user) != 0)
        elif MODE == 2:
            active = active & (tl.load(sorted_ptr + user) == 0)
        if active:
            m0 = (n_tiles - 1 - local) * BLOCK_M  # heaviest tile of the user first
            rows = m0 + tl.arange(0, BLOCK_M)  # [BM] positions in the user
            rmask = rows < n
            offs_d = tl.arange(0, D)
            # The user's head rows; tiles index them with int32 offsets.
            q_base = q_ptr + start * stride_q + h * D
            k_base = k_ptr + start * stride_k + h * D
            v_base = v_ptr + start * stride_v + h * D
            ts_base = ts_ptr + start
            q = tl.load(q_base + rows[:, None] * stride_q + offs_d[None, :], mask=rmask[:, None],
                        other=0.0)  # fmt: skip
            ts_q = tl.load(ts_base + rows, mask=rmask, other=0).to(tl.float64)
            range_row = range_ptr + (start // BLOCK_N + user) * 2
            q_lo, q_hi = _ts_range(range_row, m0 // BLOCK_N, BLOCK_M // BLOCK_N, n, BLOCK_N)
            pos_row = pos_ptr + h * (NUM_POS + 2 * POS_PAD) + POS_PAD
            tb_row = tb_ptr + h * NUM_TIME
            thr_base = thr_ptr + start * (NUM_TIME - 1)
            # TILE_RANGE (MODE 1): a key tile's buckets from these two rows of thresholds,
            # which grow with the row, instead of its timestamp range and the cell tables
            if TILE_RANGE and MODE == 1:
                edge = tl.arange(0, NT_P2)  # [E'] edge ids
                emask = edge < NUM_TIME - 1
                last = tl.minimum(m0 + BLOCK_M, n) - 1
                thr_first = tl.load(thr_base + m0 * (NUM_TIME - 1) + edge, mask=emask, other=0)
                thr_last = tl.load(thr_base + last * (NUM_TIME - 1) + edge, mask=emask,
                                   other=0)  # fmt: skip
            else:
                thr_first = tl.zeros([NT_P2], dtype=tl.int32)
                thr_last = thr_first
            if KV_FP8:  # the head's power-of-two scales: K into the scores, V into 1/N
                s_half = (half_scale * tl.load(kv_scale_ptr + h)).to(tl.float32)
                s_out = (inv_divisor * tl.load(kv_scale_ptr + H + h)).to(tl.float32)
            else:  # (Inductor passes Python floats as fp64: one fp32 cast, not per tile)
                s_half = tl.cast(half_scale, tl.float32)
                s_out = tl.cast(inv_divisor, tl.float32)
            # The first diagonal tile (every active tile has one) before the loops: the
            # accumulator is then always written by a tensor-core op. With a loop first,
            # its zero-trip path copied the initial zeros into the accumulator registers,
            # and for that ptxas serialized every wgmma of the kernel (C7515: each of the
            # key loop's eight q·kᵀ steps waited for the one before; sorted-user mode).
            acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
            acc = _prefill_tile(
                acc, q, rows, ts_q, q_lo, q_hi, m0, n, k_base, v_base, ts_base, range_row,
                pos_row, tb_row, edges_ptr, cell_edge_ptr, cell_base_ptr, stride_k, stride_v,
                s_half, D, NUM_CELLS, BLOCK_N, True, IEEE, FAST, KV_FP8, BUCKET_LOOP,
                thr_base, NUM_TIME - 1, MODE == 1, thr_first, thr_last, TILE_RANGE,
            )  # fmt: skip
            for n0 in range(0, m0, BLOCK_N):  # below the diagonal: no mask
                acc = _prefill_tile(
                    acc, q, rows, ts_q, q_lo, q_hi, n0, n, k_base, v_base, ts_base, range_row,
                    pos_row, tb_row, edges_ptr, cell_edge_ptr, cell_base_ptr, stride_k, stride_v,
                    s_half, D, NUM_CELLS, BLOCK_N, False, IEEE, FAST, KV_FP8, BUCKET_LOOP,
                    thr_base, NUM_TIME - 1, MODE == 1, thr_first, thr_last, TILE_RANGE,
                )  # fmt: skip
            for n0 in range(m0 + BLOCK_N, tl.minimum(m0 + BLOCK_M, n), BLOCK_N):  # the diagonal
                acc = _prefill_tile(
                    acc, q, rows, ts_q, q_lo, q_hi, n0, n, k_base, v_base, ts_base, range_row,
                    pos_row, tb_row, edges_ptr, cell_edge_ptr, cell_base_ptr, stride_k, stride_v,
                    s_half, D, NUM_CELLS, BLOCK_N, True, IEEE, FAST, KV_FP8, BUCKET_LOOP,
                    thr_base, NUM_TIME - 1, MODE == 1, thr_first, thr_last, TILE_RANGE,
                )  # fmt: skip
            out = out_ptr + ((start + rows)[:, None] * H + h) * D + offs_d[None, :]
            acc = (acc * s_out).to(out_ptr.dtype.element_ty)  # the constant N, once
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
        pos_ptr,  # [H, POS_PAD + NUM_POS + POS_PAD] fp32 (``bias_tables``, as the next three)
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
        POS_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        FAST: tl.constexpr,
        ATOMIC: tl.constexpr,
    ):
        """A tile of one user's candidates x one head x one key range (+ self in split 0)."""
        # Inductor (AOTI) passes Python floats as fp64 scalars: fp32 once, not per element.
        half_scale = tl.cast(half_scale, tl.float32)
        inv_divisor = tl.cast(inv_divisor, tl.float32)
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
            pos_row = pos_ptr + h * (NUM_POS + 2 * POS_PAD) + POS_PAD
            tb_row = tb_ptr + h * NUM_TIME
            k_base = k_ptr + start * stride_k + h * D
            v_base = v_ptr + start * stride_v + h * D
            acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
            for n0 in range(k_start, k_end, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                k, v, ts_k = _key_tile(k_base, v_base, ts_ptr + start, cols, k_end, stride_k,
                                       stride_v, D, True)  # fmt: skip
                s = _scores(q, k, IEEE)  # [BM, BN]
                bias = key_rab(n - cols, ts_q - ts_k, pos_row, tb_row, cell_edge_ptr,
                                cell_base_ptr, NUM_POS, NUM_CELLS)  # fmt: skip
                w = _silu_half((s * half_scale).to(tl.float32) + bias[None, :], FAST)
                acc = _accumulate(acc, w, v, IEEE)  # keys past k_end: V rows are zero
            if split == 0:  # the candidate's own key (i - j = 0, dt = 0)
                kc = tl.load(kc_ptr + crow[:, None] + offs_d[None, :], mask=cmask[:, None],
                             other=0.0).to(tl.float32)  # fmt: skip
                vc = tl.load(vc_ptr + crow[:, None] + offs_d[None, :], mask=cmask[:, None],
                             other=0.0).to(tl.float32)  # fmt: skip
                zero = tl.zeros((BLOCK_M,), dtype=tl.int32)
                bias0 = key_rab(zero, zero.to(tl.float64), pos_row, tb_row, cell_edge_ptr,
                                 cell_base_ptr, NUM_POS, NUM_CELLS)  # fmt: skip
                s0 = (tl.sum(q.to(tl.float32) * kc, 1) * half_scale).to(tl.float32) + bias0
                acc += _silu_half(s0, False)[:, None] * vc
            out = out_ptr + ((user * num_cands + cand) * H + h)[:, None] * D + offs_d[None, :]
            acc = (acc * inv_divisor).to(tl.float32)  # the constant N, once
            if ATOMIC:
                tl.atomic_add(out, acc, mask=cmask[:, None])
            else:
                tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=cmask[:, None])

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
        kv_scale: torch.Tensor | None = None,
        bucket_loop: int = PREFILL_BUCKET_LOOP,
        thresholds: bool = PREFILL_THRESHOLDS,
        tile_range: bool = PREFILL_TILE_RANGE,
        max_registers: int | None = None,
    ) -> torch.Tensor:
        """The prefill kernel with an explicit launch shape (the op uses the defaults;
        bench/h200_bench.py sweeps them); FP8 k, v with ``kv_scale [2, H]``; with
        ``thresholds`` users whose timestamps never decrease take the time bias from key
        positions (``time_bias_kernels.py``); ``max_registers`` caps ptxas's registers per
        thread (Triton's ``maxnreg``; eager calls only: a traced launch takes no such
        option) for more CTAs per SM. Returns [T, H, d] in q's dtype."""
        q, k, v = _heads_strided(q), _heads_strided(k), _heads_strided(v)
        ts, offsets = ts.contiguous(), offsets.contiguous()  # indexed as dense vectors
        _check_offsets(pos_bias.shape[0], q, k, v)
        num_tokens, num_heads, head_dim = q.shape
        num_users = offsets.shape[0] - 1
        edges = edges.contiguous()
        tables = bias_tables(pos_bias, time_bias, edges)
        # Timestamp range of every BLOCK_N keys of every user (a key tile's, or a few for a
        # query tile), so tiles need no reductions over timestamps.
        ranges = torch.empty(
            (num_tokens // block_n + num_users + 1) * 2, dtype=torch.float64, device=q.device
        )
        torch.library.wrap_triton(_ts_range_kernel)[(num_users,)](
            ts, offsets, ranges, CHUNK=block_n, CHUNKS=max(1, 1024 // block_n),
        )  # fmt: skip
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        grid = (num_tokens // block_m + num_users + 1, num_heads)
        modes: tuple[int, ...] = (0,)
        thr, flags = offsets, offsets  # (pointers mode 0 does not read)
        if thresholds and edges.shape[0] > 0:
            thr, flags = bucket_thresholds(ts, offsets, edges, pos_bias.shape[0])
            modes = (1, 2)
        cap = {} if max_registers is None else {"maxnreg": max_registers}
        for mode in modes:
            torch.library.wrap_triton(_prefill_kernel)[grid](
                q, k, v, ts, offsets, ranges, *tables, edges,
                offsets if kv_scale is None else kv_scale, thr, flags, out, num_users,
                q.stride(0), k.stride(0), v.stride(0), 0.5 / math.sqrt(head_dim), 1.0 / divisor,
                H=num_heads, D=head_dim, NUM_POS=pos_bias.shape[0], NUM_TIME=time_bias.shape[0],
                NUM_CELLS=NUM_CELLS, POS_PAD=POS_PAD, BLOCK_M=block_m, BLOCK_N=block_n,
                USER_CHUNK=USER_CHUNK, IEEE=q.dtype == torch.float32,
                FAST=fast_silu_allowed(fast, q), KV_FP8=kv_scale is not None,
                BUCKET_LOOP=bucket_loop, MODE=mode, TILE_RANGE=tile_range,
                NT_P2=triton.next_power_of_2(time_bias.shape[0]), num_warps=num_warps,
                num_stages=num_stages, **cap,
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
        _check_offsets(pos_bias.shape[0], k, v)
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
            POS_PAD=POS_PAD, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=qc.dtype == torch.float32,
            FAST=fast_silu_allowed(fast, qc), ATOMIC=atomic, num_warps=num_warps,
            num_stages=num_stages,
        )  # fmt: skip
        return out.to(qc.dtype)
