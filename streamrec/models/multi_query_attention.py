# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""The multi-query body of the decode kernel: a user's new tokens share each cached K/V tile.

The decode kernel of ``extend`` (``paged_attention.py``) runs one program per chunk of
CHUNK_M consecutive new tokens of one user × one head × one key range. A chunk of one
token (every user of a one-event step) runs the kernel's vector body; a longer chunk
runs ``multi_query_chunk`` here, the tensor-core pattern of the candidate kernel: per
cached key tile ``s = q_chunk [M, D] · kᵀ``, plus the relative position and time bias of
each (query, key) pair as an [M, BN] tile, ``w = silu(s) / N``, ``acc [M, D] += w · v``;
then (key range 0) the causal part over the user's own new keys of this call (key token
≤ query token). So a user's n new tokens read its cached K/V once per chunk instead of
once per token (``extend`` with 16 new tokens per user was 10x the one-token cost).

Programs are laid out jagged over users with no per-call index: the chunks of user b
(first new token f_b) take the program ids from ``(f_b + (CHUNK_M - 1)·b) // CHUNK_M``
on, one per chunk (⌈n_b / CHUNK_M⌉), disjoint for consecutive users; the last id is
below ``B + max(T - B, 0) // CHUNK_M`` (``chunk_programs``), which is exactly B when
every user has one new token (one program per token, as before: no idle one). A program
finds its chunk by scanning the step's ``q_start`` / ``q_user`` (``token_chunk``; a
user's tokens are contiguous and users ascend, as ``extend`` and ``extend_scratch`` lay
them out). The grid depends on shapes only, so the op still exports.

Bias of a chunk against a key tile, as an [M, BN] tile: the relative position gathered
from the head's ``pos_bias`` column (clamped, as ``key_bias``); the time bucket without
per-element gathers: a tile's |dt| lie within [near, far], from the queries' and the
keys' timestamp ranges, so its buckets lie in [b_lo, b_hi], counted against the integer
edges in registers: a tile of history usually spans one bucket (one scalar), the others
cost one compare and select per edge in between, and the bucket of every pair is exactly
``bucketize(|dt|, edges, right=True)``.

fp32 inputs take IEEE fp32 dots (the exactness tests); bf16 the tensor cores with the
SiLU weights rounded to bf16 once before the second dot (as the candidate kernel). An
FP8 pool: e4m3 codes converted to q's dtype in registers (exact), the head's
power-of-two K scale in the score scale and its V scale into the accumulator once after
the cached keys, as the vector body.
"""

from __future__ import annotations

import torch

from streamrec.models.triton_lang import tl, triton

if triton is not None:
    from streamrec.models.paged_tiles import (
        dot_k_scale,
        dot_tile_kv,
        finish_tile,
        silu_over_n,
        tile_ts,
        time_table,
    )

# New tokens of one user per program (a tl.dot takes 16 rows at least) and cached keys per
# tile of those programs. Chosen offline (ptxas for sm_90, bench/kernel_resources.py):
# with 16-key tiles the kernel keeps the one-token body's 128 registers (bf16, 4 warps:
# 4 programs per SM) in every specialisation tried; with 32-key tiles ptxas gave 128 to
# 204 registers depending on which integer arguments were divisible by 16.
CHUNK_M = 16
CHUNK_N = 16
# Tokens a program reads per step when it looks up its chunk.
TOKEN_SCAN = 1024


def chunk_programs(num_users: int, num_tokens: int, block_m: int = CHUNK_M) -> int:
    """Program ids along the decode grid's first axis: every chunk id of any layout of
    ``num_tokens`` over ``num_users`` users is below it (SymInt arithmetic)."""
    return num_users + torch.sym_max(num_tokens - num_users, 0) // block_m


def busy_programs(num_users: int, num_tokens: int, block_m: int = CHUNK_M) -> int:
    """About how many of those ids have a chunk (for the key split): one per user when
    the users have a token each, one per full chunk when they have many."""
    return torch.sym_max(num_users, (num_tokens + block_m - 1) // block_m)


if triton is not None:

    @triton.jit
    def token_chunk(p, q_user_ptr, q_start_ptr, num_tokens, BLOCK_M: tl.constexpr,
                    SCAN: tl.constexpr):  # fmt: skip
        """(user, its first new token, the chunk's first token, tokens in the chunk) of
        program id ``p``; 0 tokens for an idle id. ``num_tokens`` is int32.

        The user is the last one whose first chunk id is <= p; its tokens end where the
        next user's begin (the first token of a user is the one with q_start == itself).
        """
        first = -1
        user = -1
        after = num_tokens
        for i0 in range(0, num_tokens, SCAN):
            i = i0 + tl.arange(0, SCAN)  # [SCAN] token indices
            valid = i < num_tokens
            owner = tl.load(q_user_ptr + i, mask=valid, other=0).to(tl.int32)
            lead = valid & (tl.load(q_start_ptr + i, mask=valid, other=-1).to(tl.int32) == i)
            below = (i + (BLOCK_M - 1) * owner) // BLOCK_M <= p
            first = tl.maximum(first, tl.max(tl.where(lead & below, i, -1), 0))
            user = tl.maximum(user, tl.max(tl.where(lead & below, owner, -1), 0))
            after = tl.minimum(after, tl.min(tl.where(lead & ~below, i, num_tokens), 0))
        row0 = first + (p - (first + (BLOCK_M - 1) * user) // BLOCK_M) * BLOCK_M
        rows = tl.maximum(tl.minimum(after - row0, BLOCK_M), 0)
        return user, first, row0, tl.where(first >= 0, rows, 0)

    @triton.jit
    def chunk_bias(
        rel, mask, ts_q, ts_k, q_lo, q_hi, kmask, h, pos_bias_ptr, time_bias_ptr, edges_ptr,
        edges, H: tl.constexpr, NUM_POS: tl.constexpr, NUM_TIME: tl.constexpr,
    ):  # fmt: skip
        """rab [M, BN] fp32 of a chunk of queries (timestamps ts_q [M], between q_lo and
        q_hi) against a tile of keys (ts_k [BN], kmask: the keys that exist): relative
        positions ``rel`` [M, BN] (no table read where ``mask`` is off), the time bucket of
        each |dt| exactly, its range from the timestamp ranges (module docstring)."""
        rel = tl.minimum(tl.maximum(rel, 0), NUM_POS - 1)
        bias = tl.load(pos_bias_ptr + rel * H + h, mask=mask, other=0.0).to(tl.float32)
        k_lo = tl.min(tl.where(kmask, ts_k, 9223372036854775807), 0)
        k_hi = tl.max(tl.where(kmask, ts_k, -9223372036854775807), 0)
        near = tl.maximum(tl.maximum(q_lo - k_hi, k_lo - q_hi), 0)
        far = tl.maximum(q_hi - k_lo, k_hi - q_lo)
        # (edges past the last are int64 max: never counted)
        b_lo = tl.minimum(tl.sum((edges <= near).to(tl.int32), 0), NUM_TIME - 1)
        b_hi = tl.minimum(tl.sum((edges <= far).to(tl.int32), 0), NUM_TIME - 1)
        t_lo = tl.load(time_bias_ptr + b_lo * H + h).to(tl.float32)
        if b_lo < b_hi:
            dt = ts_q[:, None] - ts_k[None, :]  # [M, BN] int64
            dt = tl.where(dt < 0, -dt, dt)
            t = tl.zeros(bias.shape, dtype=tl.float32) + t_lo
            for b in range(b_lo + 1, b_hi + 1):  # bucket >= b iff |dt| >= edges[b - 1]
                t_b = tl.load(time_bias_ptr + b * H + h).to(tl.float32)
                t = tl.where(dt >= tl.load(edges_ptr + b - 1), t_b, t)
            bias += t
        else:
            bias += t_lo
        return bias

    @triton.jit
    def _chunk_tile(
        acc, q, k, v, s_scale, rel, mask, ts_q, ts_k, q_lo, q_hi, kmask, h, inv_divisor,
        pos_bias_ptr, time_bias_ptr, edges_ptr, edges, H: tl.constexpr, NUM_POS: tl.constexpr,
        NUM_TIME: tl.constexpr, IEEE: tl.constexpr, FAST: tl.constexpr,
    ):  # fmt: skip
        """acc [M, D] += silu(q·kᵀ·s_scale + rab) / N · v over one key tile; the pairs
        off ``mask`` weigh 0. fp32 inputs: IEEE fp32 dots; else the weights are rounded to
        v's dtype once for the second dot (as in the candidate kernel)."""
        if IEEE:  # noqa: SIM108 (Triton resolves a constexpr if, not a ternary)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = (s * s_scale).to(tl.float32) + chunk_bias(
            rel, mask, ts_q, ts_k, q_lo, q_hi, kmask, h, pos_bias_ptr, time_bias_ptr,
            edges_ptr, edges, H, NUM_POS, NUM_TIME,
        )  # fmt: skip
        w = tl.where(mask, silu_over_n(s, inv_divisor, FAST), 0.0)  # [M, BN]
        if IEEE:
            acc += tl.dot(w, v.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(w.to(v.dtype), v)
        return acc

    @triton.jit
    def multi_query_chunk(
        row0, rows, first, k_start, k_end, h, split, num_splits, table_row, q_ptr, q_pos_ptr,
        q_ts_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, ts_pool_ptr, pos_bias_ptr, time_bias_ptr,
        edges_ptr, kv_scale_ptr, out_ptr, ws_ptr, ticket_ptr, block_size, stride_q, stride_new,
        stride_kv_block, stride_kv_slot, ws_stride, scale, inv_divisor, H: tl.constexpr,
        D: tl.constexpr, NUM_POS: tl.constexpr, NUM_TIME: tl.constexpr, NT_P2: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, FAST: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):  # fmt: skip
        """Tokens row0 … row0+rows-1 of one user (whose first new token is ``first``) x
        one head x cached keys k_start … k_end-1 of its block table row, then (range 0)
        the user's new keys up to each token; the sum of the ranges as the vector body
        (``finish_tile``, ticket of the chunk's first token). ``scale``, ``inv_divisor``
        fp32; with KV_FP8 the pool holds e4m3 codes, converted to q's dtype for the dots
        (exact), the head's K scale in the score scale, its V scale into acc once."""
        edges, _, _ = time_table(time_bias_ptr, edges_ptr, h, H, NUM_TIME, NT_P2)
        offs_d = tl.arange(0, D)
        tok = row0 + tl.arange(0, BLOCK_M)  # [BM] token indices
        end = row0 + rows
        rmask = tok < end
        q_rows = tok.to(tl.int64) * stride_q + h * D  # [BM]
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0)
        pos = tl.load(q_pos_ptr + tok, mask=rmask, other=0).to(tl.int32)
        ts_q = tl.load(q_ts_ptr + tok, mask=rmask, other=0)
        q_lo = tl.min(tl.where(rmask, ts_q, 9223372036854775807), 0)
        q_hi = tl.max(tl.where(rmask, ts_q, -9223372036854775807), 0)
        k_scale = dot_k_scale(scale, kv_scale_ptr, h, KV_FP8)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        for start in range(k_start, k_end, BLOCK_N):
            blk, k, v = dot_tile_kv(start, k_end, table_row, block_size, h, k_ptr, v_ptr,
                                    stride_kv_block, stride_kv_slot, q, D, BLOCK_N,
                                    KV_FP8, True)  # fmt: skip
            k_ts = tile_ts(start, k_end, blk, block_size, ts_pool_ptr, BLOCK_N, True)
            keys = start + tl.arange(0, BLOCK_N)  # [BN]
            kmask = keys < k_end
            acc = _chunk_tile(acc, q, k, v, k_scale, pos[:, None] - keys[None, :],
                              kmask[None, :], ts_q, k_ts, q_lo, q_hi, kmask, h, inv_divisor,
                              pos_bias_ptr, time_bias_ptr, edges_ptr, edges, H, NUM_POS,
                              NUM_TIME, IEEE, FAST)  # fmt: skip
        if KV_FP8:  # Σ w (code * s) = s Σ w code: the V scale once, before the new keys
            acc = acc * tl.load(kv_scale_ptr + H + h)
        if split == 0:  # the user's tokens of this call, first … each query itself
            # (names of their own: the key loop's would be carried in with its types)
            for n0 in range(first, end, BLOCK_N):
                own = n0 + tl.arange(0, BLOCK_N)  # [BN] token indices of the keys
                omask = own < end
                offs = (own.to(tl.int64) * stride_new + h * D)[:, None] + offs_d[None, :]
                kn = tl.load(kn_ptr + offs, mask=omask[:, None], other=0.0)
                vn = tl.load(vn_ptr + offs, mask=omask[:, None], other=0.0)
                o_ts = tl.load(q_ts_ptr + own, mask=omask, other=0)
                o_pos = tl.load(q_pos_ptr + own, mask=omask, other=0).to(tl.int32)
                causal = (own[None, :] <= tok[:, None]) & omask[None, :]  # [BM, BN]
                acc = _chunk_tile(acc, q, kn, vn, scale, pos[:, None] - o_pos[None, :],
                                  causal, ts_q, o_ts, q_lo, q_hi, omask, h, inv_divisor,
                                  pos_bias_ptr, time_bias_ptr, edges_ptr, edges, H, NUM_POS,
                                  NUM_TIME, IEEE, FAST)  # fmt: skip
        out_rows = (tok.to(tl.int64) * H + h) * D  # [BM]
        finish_tile(acc, out_rows[:, None] + offs_d[None, :], rmask[:, None], out_ptr, ws_ptr,
                    ticket_ptr + row0.to(tl.int64) * H + h, split, num_splits,
                    ws_stride)  # fmt: skip
