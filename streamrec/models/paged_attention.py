# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""Fused paged SiLU attention over the KV cache: one Triton kernel, one custom op.

The torch path of ``HSTU._context_attention`` gathers every query's cached K/V into a
dense copy and materialises the ``[queries × keys]`` score tensor in HBM, reading it back
several times; on the H200 that left ~90% of the step's bandwidth to scores instead of
K/V (issue 8). The kernel here walks each user's block table, keeps scores in registers
and accumulates in fp32, so K/V are read once per (query tile, head) and nothing of size
queries × keys ever reaches memory.

Two launch shapes, picked by the caller (never from tensor values, so the grid exports):
- ``block_q == 1`` (extend/decode: ~1 query per user): one query per program and the
  user's keys split over ``keys_per_split`` chunks for parallelism; partial sums are fp32
  and added afterwards (SiLU attention has no softmax, so splits add exactly).
- ``block_q >= 16`` (rank: a user's candidates are contiguous): a tile of queries shares
  each loaded K/V block through ``tl.dot``; a tile that spans several users loops over
  them. When all of a user's queries in a tile share position and timestamp (candidates
  do) the relative bias is computed once per key instead of once per score.

Registered as ``torch.ops.streamrec.paged_silu_attention`` via ``triton_op`` +
``wrap_triton`` so ``torch.export`` keeps it as one node and AOTInductor packages the
kernel (the fake implementation is derived by ``triton_op``). Without Triton (the CPU CI
machine) only the torch reference below exists and ``triton_available()`` is False.
"""

from __future__ import annotations

import math

import torch

from streamrec.errors import ModelError
from streamrec.models.attention import relative_bias, silu_attention

try:  # Triton ships with CUDA builds of torch only.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on the CPU CI machine
    triton = None
    tl = None

OP_NAME = "streamrec::paged_silu_attention"
DEFAULT_BLOCK_N = 64
DEFAULT_KEYS_PER_SPLIT = 256
RANK_BLOCK_Q = 64


def triton_available() -> bool:
    """True when the fused op is registered (Triton imported)."""
    return triton is not None


def paged_silu_attention_reference(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_ts: torch.Tensor,
    q_user: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ts_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cached_lens: torch.Tensor,
    pos_bias: torch.Tensor,
    time_bias: torch.Tensor,
    edges: torch.Tensor,
    divisor: int,
) -> torch.Tensor:
    """The math of the op in plain torch (dense gather): the oracle of the tests.

    q [G, H, d]; q_pos, q_ts, q_user [G]; k_cache, v_cache [NB, BS, H, d] (one layer of
    the pool); ts_pool [NB, BS]; block_tables [B, MB]; cached_lens [B]. Returns [G, H, d].
    """
    num_blocks, block_size = ts_pool.shape
    blocks = block_tables[q_user].long().clamp(0, num_blocks - 1)  # [G, MB]
    g, mb = blocks.shape
    span = mb * block_size
    k = k_cache[blocks].reshape(g, span, *k_cache.shape[-2:])  # [G, S, H, d]
    v = v_cache[blocks].reshape(g, span, *v_cache.shape[-2:])  # [G, S, H, d]
    k_ts = ts_pool[blocks].reshape(g, span)  # [G, S]
    key_pos = torch.arange(span, device=q.device, dtype=torch.int64)  # [S]
    mask = (key_pos.unsqueeze(0) < cached_lens[q_user].unsqueeze(1)).unsqueeze(1)  # [G, 1, S]
    rel = (q_pos.unsqueeze(1) - key_pos.unsqueeze(0)).unsqueeze(1)  # [G, 1, S]
    dt = (q_ts.unsqueeze(1) - k_ts).unsqueeze(1)  # [G, 1, S]
    bias = relative_bias(rel, dt, pos_bias, time_bias, edges).to(q.dtype)  # [G, H, 1, S]
    out = silu_attention(q.unsqueeze(1), k, v, bias, mask, divisor)  # [G, 1, H, d]
    return out.squeeze(1)


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, block_q: int, keys_per_split: int) -> None:
    """Eager-side validation: a compiled kernel would silently read garbage instead."""
    if q.dim() != 3 or k_cache.dim() != 4 or q.shape[1:] != k_cache.shape[2:]:
        raise ModelError(
            f"paged attention wants q [G, H, d] and k_cache [NB, BS, H, d], got "
            f"{tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    head_dim = q.shape[-1]
    if k_cache.stride(-1) != 1 or k_cache.stride(-2) != head_dim:
        raise ModelError(f"k_cache rows must be contiguous [H, d], strides {k_cache.stride()}")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ModelError(f"paged attention needs a power-of-two head_dim >= 16, got {head_dim}")
    if block_q != 1 and (block_q < 16 or block_q & (block_q - 1)):
        raise ModelError(f"block_q={block_q} must be 1 or a power of two >= 16")
    if keys_per_split < 0 or keys_per_split % DEFAULT_BLOCK_N:
        raise ModelError(
            f"keys_per_split={keys_per_split} must be 0 or a multiple of {DEFAULT_BLOCK_N}"
        )


if triton is not None:

    @triton.jit
    def _rel_bias(
        rel,
        dt,
        h,
        pos_bias_ptr,
        time_bias_ptr,
        edges_ptr,
        width_inv,
        H: tl.constexpr,
        NUM_POS: tl.constexpr,
        NUM_TIME: tl.constexpr,
    ):
        """pos_bias[clamp(rel)] + time_bias[bucketize(|dt|, edges, right=True)] in fp32.

        The bucket is log1p(|dt| s)/width rounded down, then moved by at most one edge so
        it equals ``torch.bucketize`` on the integer edges exactly.
        """
        rel = tl.minimum(tl.maximum(rel, 0), NUM_POS - 1)
        bias = tl.load(pos_bias_ptr + rel * H + h).to(tl.float32)
        if NUM_TIME > 1:
            dt = tl.where(dt < 0, -dt, dt)
            est = tl.floor(tl.log(1.0 + dt.to(tl.float32) * 0.001) * width_inv).to(tl.float32)
            b = tl.minimum(tl.maximum(est, 0.0), NUM_TIME - 1.0).to(tl.int32)
            lo = tl.load(edges_ptr + tl.maximum(b - 1, 0))
            b = tl.where((b > 0) & (dt < lo), b - 1, b)
            hi = tl.load(edges_ptr + tl.minimum(b, NUM_TIME - 2))
            b = tl.where((b < NUM_TIME - 1) & (dt >= hi), b + 1, b)
            bias += tl.load(time_bias_ptr + b * H + h).to(tl.float32)
        else:
            bias += tl.load(time_bias_ptr + h + 0 * rel).to(tl.float32)
        return bias

    @triton.jit
    def _paged_silu_attention_kernel(
        q_ptr,  # [G, H, D]
        q_pos_ptr,  # [G]
        q_ts_ptr,  # [G]
        q_user_ptr,  # [G]
        k_ptr,  # [NB, BS, H, D] (one layer of the pool)
        v_ptr,  # [NB, BS, H, D]
        ts_pool_ptr,  # [NB, BS]
        tables_ptr,  # [B, MB]
        lens_ptr,  # [B]
        pos_bias_ptr,  # [NUM_POS, H]
        time_bias_ptr,  # [NUM_TIME, H]
        edges_ptr,  # [NUM_TIME - 1]
        out_ptr,  # [S, G, H, D] fp32 partials, or [G, H, D] in q's dtype
        num_queries,
        max_blocks,
        block_size,
        stride_kv_block,
        stride_kv_slot,
        stride_out_split,
        scale,
        inv_divisor,
        width_inv,
        H: tl.constexpr,
        D: tl.constexpr,
        NUM_POS: tl.constexpr,
        NUM_TIME: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        KEYS_PER_SPLIT: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        pid_q = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BQ]
        offs_d = tl.arange(0, D)  # [D]
        q_valid = offs_q < num_queries
        q_rows = offs_q.to(tl.int64) * (H * D) + h * D  # [BQ]
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=q_valid[:, None], other=0.0)
        q_user = tl.load(q_user_ptr + offs_q, mask=q_valid, other=-1).to(tl.int32)
        q_pos = tl.load(q_pos_ptr + offs_q, mask=q_valid, other=0).to(tl.int32)
        q_ts = tl.load(q_ts_ptr + offs_q, mask=q_valid, other=0).to(tl.int64)
        u_lo = tl.min(tl.where(q_valid, q_user, 2147483647), axis=0)
        u_hi = tl.max(q_user, axis=0)
        acc = tl.zeros((BLOCK_Q, D), dtype=tl.float32)
        for u in range(u_lo, u_hi + 1):
            n_keys = tl.load(lens_ptr + u).to(tl.int32)
            if KEYS_PER_SPLIT > 0:
                k_start = split * KEYS_PER_SPLIT
                k_end = tl.minimum(n_keys, k_start + KEYS_PER_SPLIT)
            else:
                k_start = 0
                k_end = n_keys
            row = (q_user == u) & q_valid  # [BQ]
            pos_u = tl.max(tl.where(row, q_pos, -2147483647), axis=0)
            ts_u = tl.max(tl.where(row, q_ts, -9223372036854775807), axis=0)
            uniform = (tl.min(tl.where(row, q_pos, 2147483647), axis=0) == pos_u) & (
                tl.min(tl.where(row, q_ts, 9223372036854775807), axis=0) == ts_u
            )
            table_row = tables_ptr + u * max_blocks
            for start in range(k_start, k_end, BLOCK_N):
                keys = start + tl.arange(0, BLOCK_N)  # [BN]
                kmask = keys < k_end
                blk = tl.load(table_row + keys // block_size, mask=kmask, other=0).to(tl.int64)
                slot = keys % block_size
                kv_rows = blk * stride_kv_block + slot * stride_kv_slot + h * D  # [BN]
                kv_offs = kv_rows[:, None] + offs_d[None, :]  # [BN, D]
                k = tl.load(k_ptr + kv_offs, mask=kmask[:, None], other=0.0)
                v = tl.load(v_ptr + kv_offs, mask=kmask[:, None], other=0.0)
                k_ts = tl.load(ts_pool_ptr + blk * block_size + slot, mask=kmask, other=0)
                if BLOCK_Q >= 16:
                    if IEEE:
                        s = tl.dot(q, tl.trans(k), input_precision="ieee")
                    else:
                        s = tl.dot(q, tl.trans(k))
                else:
                    s = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), 2)
                # Inductor passes Python floats as fp64 scalars: cast back to fp32.
                s = (s * scale).to(tl.float32)  # [BQ, BN]
                if uniform:
                    b1 = _rel_bias(
                        pos_u - keys,
                        ts_u - k_ts,
                        h,
                        pos_bias_ptr,
                        time_bias_ptr,
                        edges_ptr,
                        width_inv,
                        H,
                        NUM_POS,
                        NUM_TIME,
                    )
                    s = s + b1[None, :]
                else:
                    b2 = _rel_bias(
                        q_pos[:, None] - keys[None, :],
                        q_ts[:, None] - k_ts[None, :],
                        h,
                        pos_bias_ptr,
                        time_bias_ptr,
                        edges_ptr,
                        width_inv,
                        H,
                        NUM_POS,
                        NUM_TIME,
                    )
                    s = s + b2
                w = (s * tl.sigmoid(s) * inv_divisor).to(tl.float32)
                w = tl.where(row[:, None] & kmask[None, :], w, 0.0)
                if BLOCK_Q >= 16:
                    if IEEE:
                        acc += tl.dot(w.to(v.dtype), v, input_precision="ieee")
                    else:
                        acc += tl.dot(w.to(v.dtype), v)
                else:
                    acc += tl.sum(w[:, :, None] * v[None, :, :].to(tl.float32), 1)
        out_offs = q_rows[:, None] + offs_d[None, :]
        if KEYS_PER_SPLIT > 0:
            out_offs += split.to(tl.int64) * stride_out_split
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=q_valid[:, None])

    @torch.library.triton_op(OP_NAME, mutates_args={})
    def paged_silu_attention(
        q: torch.Tensor,
        q_pos: torch.Tensor,
        q_ts: torch.Tensor,
        q_user: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
        pos_bias: torch.Tensor,
        time_bias: torch.Tensor,
        edges: torch.Tensor,
        divisor: int,
        bucket_width: float,
        block_q: int,
        keys_per_split: int,
    ) -> torch.Tensor:
        """Same arguments as ``paged_silu_attention_reference`` plus the launch shape.

        block_q: 1 (one query per program) or a power of two >= 16 (query tiles);
        keys_per_split: 0 = one program walks all of a user's keys, else the key range is
        cut into chunks of this many keys (a multiple of 64) summed in fp32 afterwards.
        """
        num_queries, num_heads, head_dim = q.shape
        block_size = ts_pool.shape[1]
        max_blocks = block_tables.shape[1]
        q = q.contiguous()
        if keys_per_split > 0:
            num_splits = triton.cdiv(max_blocks * block_size, keys_per_split)
            out = q.new_empty((num_splits, num_queries, num_heads, head_dim), dtype=torch.float32)
        else:
            num_splits = 1
            out = torch.empty_like(q)
        grid = (triton.cdiv(num_queries, block_q), num_heads, num_splits)
        torch.library.wrap_triton(_paged_silu_attention_kernel)[grid](
            q,
            q_pos,
            q_ts,
            q_user,
            k_cache,
            v_cache,
            ts_pool,
            block_tables,
            cached_lens,
            pos_bias,
            time_bias,
            edges,
            out,
            num_queries,
            max_blocks,
            block_size,
            k_cache.stride(0),
            k_cache.stride(1),
            num_queries * num_heads * head_dim,
            1.0 / math.sqrt(head_dim),
            1.0 / divisor,
            1.0 / bucket_width,
            H=num_heads,
            D=head_dim,
            NUM_POS=pos_bias.shape[0],
            NUM_TIME=time_bias.shape[0],
            BLOCK_Q=block_q,
            BLOCK_N=DEFAULT_BLOCK_N,
            KEYS_PER_SPLIT=keys_per_split,
            IEEE=q.dtype == torch.float32,
            num_warps=8 if block_q >= 64 else 4,
        )
        if keys_per_split > 0:
            return out.sum(0).to(q.dtype)
        return out


ATTENTION_BACKENDS = ("auto", "torch", "triton")


def fused_attention_enabled(backend: str, q: torch.Tensor) -> bool:
    """Whether ``backend`` routes cached-context attention of ``q`` through the op.

    "auto" takes the fused kernel whenever it can run (CUDA tensor, Triton present,
    power-of-two head_dim); "triton" insists and says why it cannot; "torch" never.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ModelError(f"attention_backend={backend!r} must be one of {ATTENTION_BACKENDS}")
    if backend == "torch":
        return False
    head_dim = q.shape[-1]
    usable = triton_available() and q.is_cuda and head_dim >= 16 and not head_dim & (head_dim - 1)
    if backend == "triton" and not usable:
        raise ModelError(
            f"attention_backend='triton' needs Triton, a CUDA tensor and a power-of-two "
            f"head_dim >= 16 (triton={triton_available()}, device={q.device}, "
            f"head_dim={head_dim})"
        )
    return usable


def fused_context_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_ts: torch.Tensor,
    q_user: torch.Tensor,
    kv_layer: torch.Tensor,
    ts_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cached_lens: torch.Tensor,
    pos_bias: torch.Tensor,
    time_bias: torch.Tensor,
    edges: torch.Tensor,
    divisor: int,
    bucket_width: float,
    block_q: int,
) -> torch.Tensor:
    """The op for one layer's pool slice ``kv_layer [2, NB, BS, H, d]``; q [G, H, d].

    ``block_q == 1`` splits keys (few queries per user); larger tiles do not (rank).
    """
    keys_per_split = DEFAULT_KEYS_PER_SPLIT if block_q == 1 else 0
    op = torch.ops.streamrec.paged_silu_attention
    check_inputs(q, kv_layer[0], block_q, keys_per_split)
    return op(
        q,
        q_pos,
        q_ts,
        q_user,
        kv_layer[0],
        kv_layer[1],
        ts_pool,
        block_tables,
        cached_lens,
        pos_bias,
        time_bias,
        edges,
        divisor,
        bucket_width,
        block_q,
        keys_per_split,
    )
