# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""The relative bias of the fused prefill and candidate kernels (``prefill_kernels.py``):
its per-call tables, and the time bias of a tile, two ways.

**From timestamps** (``add_time_bias``, any user): ``bucketize(|ts_i - ts_j|, edges)``
with integer edges, in fp64 (exact below 2^53 ms). The tile's timestamp ranges bound its
buckets: one bucket is a scalar add, a few cost one fp64 compare and select per edge, more
(the tiles at the diagonal) a per-element lookup of a quarter-octave cell of |dt| that
holds at most one edge. That ``[BM, BN]`` fp64 value and its compares hold the prefill
kernel at 225-255 registers (ptxas for sm_90a; 128 with a scalar time bias: BENCHMARKS.md
issue 14).

**From key positions** (``add_time_bias_sorted``, users whose timestamps never decrease):
``ts_i - ts_j`` for keys ``j <= i`` falls as ``j`` rises, so for each query row ``i`` and
edge ``e_b`` the keys with ``ts_i - ts_j >= e_b`` are a prefix ``j < thr[i, b]``, and the
bucket of ``(i, j)`` is the number of thresholds above ``j``. ``bucket_thresholds``
computes ``thr [T, E]`` (a binary search per token and edge) and flags the users it holds
for; a tile then compares its int32 column index with ``[BM]`` thresholds per edge in its
range: exact, with no per-element fp64. (Row-major: the edge-major layout, one contiguous
``[BM]`` load per edge, ran 1.19x slower at history 1,000 and 1.12x at 4,096 on the
H100, 2026-12-06, both timed while the key loop was still unpipelined; BENCHMARKS.md
issue 14.)
"""

from __future__ import annotations

import torch

from streamrec.models.triton_lang import tl, triton

# Cells of |dt|: fp64 exponent (0 … 63 above 1 ms) x 4 quarter octaves.
NUM_CELLS = 256
# Zeros either side of each head's pos-bias row: the prefill tiles index it by i - j with
# no clamp (diagonal tiles reach j - i < BLOCK_N, padding rows i < len + BLOCK_M).
POS_PAD = 128
THRESHOLD_ROWS = 128  # query rows per step of a threshold program
ORDER_CHUNK = 1024  # timestamps per step of the order check


def search_steps(max_len: int) -> int:
    """Halvings that take [0, max_len] down to one position."""
    return max(1, int(max_len).bit_length())


if triton is not None:

    @triton.jit
    def bucket_of(x, cell_edge_ptr, cell_base_ptr, NUM_CELLS: tl.constexpr):
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
    def min_max(lo_a, hi_a, lo_b, hi_b):
        return tl.minimum(lo_a, lo_b), tl.maximum(hi_a, hi_b)

    @triton.jit
    def bucket_range(q_lo, q_hi, k_lo, k_hi, cell_edge_ptr, cell_base_ptr,
                      NUM_CELLS: tl.constexpr):  # fmt: skip
        """The buckets [b_lo, b_hi] that hold every |ts_i - ts_j| of a tile, from the
        query and key timestamp ranges (or any ranges that hold them)."""
        near = tl.maximum(tl.maximum(q_lo - k_hi, k_lo - q_hi), 0.0)
        far = tl.maximum(q_hi - k_lo, k_hi - q_lo)
        b_lo = bucket_of(near, cell_edge_ptr, cell_base_ptr, NUM_CELLS)
        return b_lo, bucket_of(far, cell_edge_ptr, cell_base_ptr, NUM_CELLS)

    @triton.jit
    def add_time_bias(bias, ts_q, ts_k, q_lo, q_hi, k_lo, k_hi, edges_ptr, tb_row,
                       cell_edge_ptr, cell_base_ptr, NUM_CELLS: tl.constexpr,
                       BUCKET_LOOP: tl.constexpr):  # fmt: skip
        """bias [BM, BN] + time_bias[bucket(|ts_i - ts_j|)] / 2 of one head, exactly.

        The tile's |dt| lie in [near, far] (from the query and key timestamp ranges, or
        any ranges that hold them), so its buckets lie in [b_lo, b_hi]: one bucket for most
        tiles (a scalar add); up to BUCKET_LOOP more, one fp64 compare and select per edge
        inside the range, no gathers; past that (the tiles at the diagonal, whose |dt|
        start at 0: ~20 buckets with minutes between events) each element's own bucket,
        from its cell, and three small gathers — a cost that does not grow with the range.
        """
        b_lo, b_hi = bucket_range(q_lo, q_hi, k_lo, k_hi, cell_edge_ptr, cell_base_ptr,
                                   NUM_CELLS)  # fmt: skip
        t_lo = tl.load(tb_row + b_lo)
        if b_hi - b_lo > BUCKET_LOOP:
            adt = tl.abs(ts_q[:, None] - ts_k[None, :])  # [BM, BN] fp64, exact
            bucket = bucket_of(adt, cell_edge_ptr, cell_base_ptr, NUM_CELLS)  # [BM, BN]
            bias = bias + tl.load(tb_row + bucket)
        elif b_lo < b_hi:
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
    def key_rab(rel, dt, pos_row, tb_row, cell_edge_ptr, cell_base_ptr, NUM_POS: tl.constexpr,
                 NUM_CELLS: tl.constexpr):  # fmt: skip
        """rab / 2 of one head per key (the candidates' bias row): two small gathers."""
        rel = tl.minimum(tl.maximum(rel, 0), NUM_POS - 1)
        bucket = bucket_of(tl.abs(dt), cell_edge_ptr, cell_base_ptr, NUM_CELLS)
        return tl.load(pos_row + rel) + tl.load(tb_row + bucket)

    @triton.jit
    def _bias_table_kernel(
        pos_bias_ptr,  # [NUM_POS, H]
        edges_ptr,  # [NUM_TIME - 1] int64
        time_bias_ptr,  # [NUM_TIME, H]
        pos_out_ptr,  # [H, POS_PAD + NUM_POS + POS_PAD] fp32: pos_bias / 2, transposed
        tb_out_ptr,  # [H, NUM_TIME] fp32: time_bias / 2, transposed
        cell_edge_ptr,  # [NUM_CELLS] fp64: the edge inside each cell (huge if none)
        cell_base_ptr,  # [NUM_CELLS] int32: the buckets below each cell
        H: tl.constexpr,
        NUM_POS: tl.constexpr,
        NUM_TIME: tl.constexpr,
        NT_P2: tl.constexpr,
        NUM_CELLS: tl.constexpr,
        POS_PAD: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """One head's rows (and, head 0, the cells c = 4o + f: [2^o(1 + f/4), 2^o(1 + (f+1)/4)).
        Halving is exact, so twice the sum of two halves is the reference's fp32 sum."""
        h = tl.program_id(0)
        width = NUM_POS + 2 * POS_PAD
        for p0 in range(0, width, CHUNK):
            p = p0 + tl.arange(0, CHUNK)  # index in the padded row; position p - POS_PAD
            inside = (p >= POS_PAD) & (p < NUM_POS + POS_PAD)
            row = tl.load(pos_bias_ptr + (p - POS_PAD) * H + h, mask=inside, other=0.0)
            tl.store(pos_out_ptr + h * width + p, row.to(tl.float32) * 0.5, mask=p < width)
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
    def _threshold_kernel(
        ts_ptr,  # [T] int64
        offsets_ptr,  # [B + 1] int64
        edges_ptr,  # [E] int64
        thr_ptr,  # [T, E] int32: keys j of the user with ts_i - ts_j >= edges[b] (sorted)
        sorted_ptr,  # [B] int32: 1 when the user's timestamps never decrease
        NUM_EDGES: tl.constexpr,
        ROWS: tl.constexpr,
        STEPS: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """Program (user, edge b): thr[i, b] for every token i of the user; edge 0's
        program also writes the user's order flag."""
        user = tl.program_id(0)
        b = tl.program_id(1)
        start = tl.load(offsets_ptr + user)
        n = (tl.load(offsets_ptr + user + 1) - start).to(tl.int32)
        base = ts_ptr + start
        edge = tl.load(edges_ptr + b)
        for r0 in range(0, n, ROWS):
            rows = r0 + tl.arange(0, ROWS)  # [R] positions in the user
            rmask = rows < n
            target = tl.load(base + rows, mask=rmask, other=0) - edge  # [R] int64
            lo = tl.zeros([ROWS], dtype=tl.int32)
            hi = tl.where(rmask, rows + 1, 0)  # search keys 0 … i
            for _ in tl.static_range(STEPS):  # first j in [lo, hi) with ts_j > target
                live = lo < hi
                mid = (lo + hi) // 2
                ts_mid = tl.load(base + mid, mask=live, other=0)
                up = live & (ts_mid <= target)
                lo = tl.where(up, mid + 1, lo)
                hi = tl.where(live & ~up, mid, hi)
            tl.store(thr_ptr + (start + rows) * NUM_EDGES + b, lo, mask=rmask)
        if b == 0:
            drops = 0
            for c0 in range(1, n, CHUNK):
                pos = c0 + tl.arange(0, CHUNK)
                inside = pos < n
                now = tl.load(base + pos, mask=inside, other=0)
                before = tl.load(base + pos - 1, mask=inside, other=0)
                drops += tl.sum((inside & (now < before)).to(tl.int32), 0)
            tl.store(sorted_ptr + user, tl.where(drops == 0, 1, 0))

    @triton.jit
    def add_time_bias_sorted(bias, rows, cols, n, thr_base, b_lo, b_hi, tb_row,
                             NUM_EDGES: tl.constexpr):  # fmt: skip
        """bias [BM, BN] + time_bias[bucket] / 2 of one head for keys ``cols`` <= rows
        (the caller masks the rest): bucket >= b iff col < thr[row, b - 1], over the
        tile's range [b_lo, b_hi] (``thr_base``: the user's first token's thresholds)."""
        t = tl.zeros(bias.shape, dtype=tl.float32) + tl.load(tb_row + b_lo)
        # The loop sits inside an `if`: as a bare statement of the caller's key loop, it
        # kept Triton's pipeliner off that whole loop (0 asynchronous copies for sm_90a
        # against 52 this way; bench/kernel_resources.py, column async_copies).
        if b_lo < b_hi:
            for b in range(b_lo + 1, b_hi + 1):
                thr = tl.load(thr_base + rows * NUM_EDGES + (b - 1), mask=rows < n, other=0)
                t = tl.where(cols[None, :] < thr[:, None], tl.load(tb_row + b), t)
        return bias + t

    def bucket_thresholds(
        ts: torch.Tensor, offsets: torch.Tensor, edges: torch.Tensor, max_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """thr [T, E] int32 and the users' order flags [B] int32 (1: never decreasing);
        thresholds of a flagged-0 user are not meaningful and not read."""
        num_tokens, num_users, num_edges = ts.shape[0], offsets.shape[0] - 1, edges.shape[0]
        thr = torch.empty((num_tokens, max(num_edges, 1)), dtype=torch.int32, device=ts.device)
        flags = torch.empty(num_users, dtype=torch.int32, device=ts.device)
        torch.library.wrap_triton(_threshold_kernel)[(num_users, max(num_edges, 1))](
            ts, offsets, edges, thr, flags, NUM_EDGES=max(num_edges, 1),
            ROWS=THRESHOLD_ROWS, STEPS=search_steps(max_len), CHUNK=ORDER_CHUNK,
        )  # fmt: skip
        return thr, flags

    def bias_tables(
        pos_bias: torch.Tensor, time_bias: torch.Tensor, edges: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The kernels' tables (one small launch per call): pos_bias / 2 [H, NUM_POS] (with
        POS_PAD zeros either side) and time_bias / 2 [H, NUM_TIME] fp32, per head; per cell
        its edge [NUM_CELLS] fp64 and the buckets below it [NUM_CELLS] int32."""
        num_time, num_heads = time_bias.shape
        num_pos = pos_bias.shape[0]
        dev = time_bias.device
        pos_bias, time_bias = pos_bias.contiguous(), time_bias.contiguous()
        pos = torch.empty(num_heads, num_pos + 2 * POS_PAD, dtype=torch.float32, device=dev)
        tb = torch.empty(num_heads, num_time, dtype=torch.float32, device=dev)
        cell_edge = torch.empty(NUM_CELLS, dtype=torch.float64, device=dev)
        cell_base = torch.empty(NUM_CELLS, dtype=torch.int32, device=dev)
        torch.library.wrap_triton(_bias_table_kernel)[(num_heads,)](
            pos_bias, edges, time_bias, pos, tb, cell_edge, cell_base, H=num_heads,
            NUM_POS=num_pos, NUM_TIME=num_time, NT_P2=triton.next_power_of_2(num_time),
            NUM_CELLS=NUM_CELLS, POS_PAD=POS_PAD, CHUNK=1024,
        )  # fmt: skip
        return pos, tb, cell_edge, cell_base
