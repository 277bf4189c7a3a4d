# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""The ``@triton.jit`` building blocks that the paged attention kernels share.

A tile of cached keys read through a user's block table (``tile_blocks``, ``tile_kv``,
``tile_ts``; as tensor-core operands ``dot_tile_kv``, ``dot_k_scale``), the relative bias
of one query against a tile (``time_table``, ``key_bias``), SiLU over the fixed divisor
(``silu_over_n``) and the deterministic sum of key ranges (``finish_tile``). Their
users: the decode kernel of ``extend`` (``paged_attention.py``, with the multi-query body
of ``multi_query_attention.py``) and the candidate kernel of ``rank``
(``candidate_attention.py``). Without Triton (the CPU CI machine) this module defines
nothing.
"""

from __future__ import annotations

from streamrec.models.triton_lang import tl, triton

if triton is not None:

    @triton.jit
    def block_shift(block_size):
        """log2 of the pool's block size (a power of two: ``check_pow2_blocks`` and the AOTI
        runtime check it), int32, from its float exponent: a key's block and slot are
        then a shift and a mask, where a division by the runtime size cost ~13
        instructions per key row (sm_90a SASS of the candidate kernel's key loop: 572 ->
        520 with the size a constant)."""
        return (tl.cast(block_size, tl.float32).to(tl.int32, bitcast=True) >> 23) - 127

    @triton.jit
    def tile_blocks(start, k_end, table_row, block_size, BLOCK_N: tl.constexpr,
                    POW2: tl.constexpr = False):  # fmt: skip
        """Pool block of each key start..start+BLOCK_N (0 past ``k_end``), int64 [BN];
        ``POW2``: by a shift (``block_shift``)."""
        keys = start + tl.arange(0, BLOCK_N)  # [BN]
        kmask = keys < k_end
        if POW2:  # noqa: SIM108 (Triton resolves a constexpr if, not a ternary)
            index = keys >> block_shift(block_size)
        else:
            index = keys // block_size
        return tl.load(table_row + index, mask=kmask, other=0).to(tl.int64)

    @triton.jit
    def block_slot(keys, block_size, POW2: tl.constexpr):
        """Slot of each key in its block (``POW2``: by a mask)."""
        if POW2:
            return keys & (tl.cast(block_size, tl.int32) - 1)
        else:
            return keys % block_size

    @triton.jit
    def tile_kv(
        start,
        k_end,
        blk,
        block_size,
        h,
        k_ptr,
        v_ptr,
        stride_kv_block,
        stride_kv_slot,
        D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        POW2: tl.constexpr = False,
    ):
        """K, V [BN, D] of one cached key tile, given its blocks [BN].

        Keys past ``k_end`` read as zeros: a zero V row adds nothing to the output, so the
        score loop needs no per-element mask (and NaN in an unwritten slot never loads).
        """
        keys = start + tl.arange(0, BLOCK_N)  # [BN]
        kmask = keys < k_end
        slot = block_slot(keys, block_size, POW2)  # [BN]
        rows = blk * stride_kv_block + slot * stride_kv_slot + h * D  # [BN]
        offs = rows[:, None] + tl.arange(0, D)[None, :]  # [BN, D]
        k = tl.load(k_ptr + offs, mask=kmask[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=kmask[:, None], other=0.0)
        return k, v

    @triton.jit
    def tile_kv_ts(
        start, k_end, table_row, block_size, h, k_ptr, v_ptr, ts_pool_ptr, stride_kv_block,
        stride_kv_slot, D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """K, V [BN, D] and timestamps [BN] of the cached key tile at ``start`` (the vector
        body's loads: a tile past ``k_end`` reads nothing)."""
        blk = tile_blocks(start, k_end, table_row, block_size, BLOCK_N)
        k, v = tile_kv(start, k_end, blk, block_size, h, k_ptr, v_ptr, stride_kv_block,
                       stride_kv_slot, D, BLOCK_N)  # fmt: skip
        return k, v, tile_ts(start, k_end, blk, block_size, ts_pool_ptr, BLOCK_N)

    @triton.jit
    def dot_tile_kv(
        start, k_end, table_row, block_size, h, k_ptr, v_ptr, stride_kv_block, stride_kv_slot,
        like, D: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
        POW2: tl.constexpr = False,
    ):  # fmt: skip
        """Blocks [BN] and K, V [BN, D] of one cached key tile as tensor-core operands:
        an FP8 pool's e4m3 codes converted to the dtype of ``like`` (exact; the head's
        scales go into the score scale, ``dot_k_scale``, and the accumulator; ``POW2``:
        ``tile_blocks``)."""
        blk = tile_blocks(start, k_end, table_row, block_size, BLOCK_N, POW2)
        k, v = tile_kv(start, k_end, blk, block_size, h, k_ptr, v_ptr, stride_kv_block,
                       stride_kv_slot, D, BLOCK_N, POW2)  # fmt: skip
        if KV_FP8:
            k = k.to(like.dtype)
            v = v.to(like.dtype)
        return blk, k, v

    @triton.jit
    def dot_k_scale(scale, kv_scale_ptr, h, KV_FP8: tl.constexpr):
        """The score scale of a dot over cached keys: ``scale``, times the head's
        power-of-two K scale for an FP8 pool ((q · code) s · scale = q · (code s) · scale,
        exactly: s = 2^e)."""
        if KV_FP8:
            return (scale * tl.load(kv_scale_ptr + h)).to(tl.float32)
        else:
            return scale

    @triton.jit
    def tile_ts(start, k_end, blk, block_size, ts_pool_ptr, BLOCK_N: tl.constexpr,
                POW2: tl.constexpr = False):  # fmt: skip
        """Timestamps [BN] of one cached key tile (0 past ``k_end``; ``POW2``:
        ``block_slot``)."""
        keys = start + tl.arange(0, BLOCK_N)  # [BN]
        kmask = keys < k_end
        slot = block_slot(keys, block_size, POW2)  # [BN]
        return tl.load(ts_pool_ptr + blk * block_size + slot, mask=kmask, other=0)

    @triton.jit
    def silu_over_n(s, inv_divisor, FAST: tl.constexpr):
        """silu(s) / N in fp32. FAST (bf16/fp16 inputs): ``silu(s) = h + h·tanh(h)`` with
        h = s/2 and one ``tanh.approx`` (one special-function op instead of an exp and a
        division; its 2^-11 relative error is below the bf16 rounding that follows)."""
        if FAST:
            t = tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;", "=f,f", [(s * 0.5).to(tl.float32)], dtype=tl.float32,
                is_pure=True,
                pack=1,
            )  # fmt: skip
            # (the kernels cast their scalars to fp32 at entry; the cast keeps it so)
            c = (s * 0.5 * inv_divisor).to(tl.float32)
            return c * t + c
        else:
            return (s * tl.sigmoid(s) * inv_divisor).to(tl.float32)

    @triton.jit
    def silu_of_half(h, FAST: tl.constexpr):
        """silu(2h) in fp32 from half the pre-activation (a caller that holds s / 2 for
        free: its scale and bias pre-halved). FAST: h + h·tanh(h), one ``tanh.approx``
        and one FFMA; else the exact 2h·sigmoid(2h)."""
        if FAST:
            t = tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;", "=f,f", [h.to(tl.float32)], dtype=tl.float32,
                is_pure=True,
                pack=1,
            )  # fmt: skip
            return h * t + h
        else:
            s = (2.0 * h).to(tl.float32)
            return (s * tl.sigmoid(s)).to(tl.float32)

    @triton.jit
    def key_bias(
        rel, kmask, dt, h, pos_bias_ptr, edges, tb_delta, tb0, H: tl.constexpr,
        NUM_POS: tl.constexpr,
    ):  # fmt: skip
        """rab of one query against a tile of keys (relative positions ``rel``, time
        gaps ``dt`` [BN]), fp32 [BN].

        The time bucket is ``bucketize(|dt|, edges, right=True)`` = the number of edges
        <= |dt|, so ``time_bias[bucket] = time_bias[0] + Σ_{edge <= |dt|} Δ`` with
        Δ[e] = time_bias[e+1] - time_bias[e] held in registers: exact integer bucketing
        and no load that waits on the bucket. (A gather of ``time_bias[bucket]`` instead
        made the memory-bound decode kernel ~3x slower on the H200: one more dependent
        load per key tile.)
        """
        dt = tl.where(dt < 0, -dt, dt)  # [BN]
        t_bias = tb0 + tl.sum(tl.where(dt[:, None] >= edges[None, :], tb_delta[None, :], 0.0), 1)
        rel = tl.minimum(tl.maximum(rel, 0), NUM_POS - 1)
        p_bias = tl.load(pos_bias_ptr + rel * H + h, mask=kmask, other=0.0).to(tl.float32)
        return t_bias + p_bias

    @triton.jit
    def time_table(time_bias_ptr, edges_ptr, h, H: tl.constexpr, NUM_TIME: tl.constexpr,
                    NT_P2: tl.constexpr):  # fmt: skip
        """Bucket edges (int64 max past the last: never matched), Δ per edge, bias[0]."""
        e = tl.arange(0, NT_P2)
        emask = e < NUM_TIME - 1
        edges = tl.load(edges_ptr + e, mask=emask, other=9223372036854775807)  # [NT_P2]
        lo = tl.load(time_bias_ptr + e * H + h, mask=emask, other=0.0).to(tl.float32)
        hi = tl.load(time_bias_ptr + (e + 1) * H + h, mask=emask, other=0.0).to(tl.float32)
        tb0 = tl.load(time_bias_ptr + h).to(tl.float32)
        return edges, hi - lo, tb0

    @triton.jit
    def finish_tile(acc, offs, mask, out_ptr, ws_ptr, ticket_ptr, split, num_splits, ws_stride):
        """Store one program's fp32 ``acc`` at ``out[offs]`` (the output's dtype).

        With several key ranges each program parks its partial in the workspace slab of
        its range; the last of a tile's ranges to take a ticket adds all slabs in range
        order (deterministic) and stores the sum. The barrier orders every thread's
        partial before the ticket; the ticket is acquire-release at GPU scope and the
        slabs are read past L1 (``.cg``).
        """
        if num_splits == 1:
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(ws_ptr + split.to(tl.int64) * ws_stride + offs, acc, mask=mask)
            tl.debug_barrier()
            ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
            if ticket == num_splits - 1:
                total = tl.zeros_like(acc)
                for s in range(0, num_splits):  # (s · ws_stride < the workspace: no overflow)
                    part = ws_ptr + s * ws_stride + offs
                    total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
