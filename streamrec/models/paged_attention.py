# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""Fused paged SiLU attention over the KV cache: two Triton kernels, two custom ops.

The torch path of ``HSTU._context_attention`` gathers every query's cached K/V into a
dense copy and materialises the ``[queries × keys]`` score tensor in HBM; on the H200
that left ~90% of the step's bandwidth to scores instead of K/V (issue 8). The kernels
here walk each user's block table, keep scores in registers and accumulate in fp32.

- ``paged_silu_attention`` (extend: new tokens, ~1 per user, each with its own position
  and timestamp): one query per program, vector math, memory-bound.
- ``paged_silu_attention_candidates`` (rank: C candidates per user, all at the user's
  next position and newest timestamp): a tile of one user's candidates shares every
  loaded K/V tile through ``tl.dot``, and the relative bias is computed once per key.

Both cut a user's keys into ranges when the batch alone would leave the GPU idle: SiLU
attention has no softmax, so the partial sums of key ranges add exactly (fp32 atomics
into a zeroed output). The time bucket is computed from the integer edges held in
registers (no dependent table loads in the key loop). Grids depend on shapes only, never
on tensor values, so both ops export: ``triton_op`` + ``wrap_triton`` keep each as one
graph node and AOTInductor packages the kernels. Without Triton (the CPU CI machine) only
the torch reference below exists and ``triton_available()`` is False.
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake

from streamrec.errors import ModelError
from streamrec.models.attention import relative_bias, silu_attention

try:  # Triton ships with CUDA builds of torch only.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on the CPU CI machine
    triton = None
    tl = None

OP_DECODE = "streamrec::paged_silu_attention"
OP_CANDIDATES = "streamrec::paged_silu_attention_candidates"
# Launch shapes, the fastest of the sweep in bench/h200_bench.py on the H200 at batch
# 1/8/64 (BENCHMARKS.md). About TARGET_PROGRAMS programs fill the GPU: a smaller batch is
# cut along the keys until it has that many.
TARGET_PROGRAMS = 1024
DECODE_BLOCK_N = 64
DECODE_WARPS = 2
DECODE_MMA = False
DECODE_MMA_STAGES = 3
CAND_TARGET_PROGRAMS = 256
CAND_BLOCK_M = 128
CAND_BLOCK_N = 32
CAND_WARPS = 8
CAND_STAGES = 2


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


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Eager-side validation: a compiled kernel would silently read garbage instead."""
    if q.dim() not in (3, 4) or k_cache.dim() != 4 or q.shape[-2:] != k_cache.shape[2:]:
        raise ModelError(
            f"paged attention wants q [G, H, d] or [B, C, H, d] and k_cache [NB, BS, H, d], "
            f"got {tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    head_dim = q.shape[-1]
    if k_cache.stride(-1) != 1 or k_cache.stride(-2) != head_dim:
        raise ModelError(f"k_cache rows must be contiguous [H, d], strides {k_cache.stride()}")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ModelError(f"paged attention needs a power-of-two head_dim >= 16, got {head_dim}")


def fast_silu_allowed(fast: bool, q: torch.Tensor) -> bool:
    """Whether a launch may use the ``tanh.approx`` SiLU: bf16/fp16 only, and only when
    launched eagerly. Inside a graph that Inductor traces (torch.compile, AOTInductor) the
    tensors are fake and the exact sigmoid is used: the compiled incremental step with the
    inline assembly hit an illegal memory access on the H200."""
    if not fast or q.dtype == torch.float32:
        return False
    return not (torch.compiler.is_compiling() or is_fake(q))


def _num_splits(programs: int, span: int, block_n: int, target: int = TARGET_PROGRAMS) -> int:
    """Key splits so that about ``TARGET_PROGRAMS`` programs run; works on SymInts.

    SiLU attention has no softmax, so the partial sums of key ranges simply add: a small
    batch (few programs) is cut along the keys to fill the GPU, a large one is not cut.
    """
    per_split_min = (span + block_n - 1) // block_n  # splits of one key tile each
    wanted = (target + programs - 1) // programs
    return torch.sym_max(1, torch.sym_min(per_split_min, wanted))


if triton is not None:

    @triton.jit
    def _tile_blocks(start, k_end, table_row, block_size, BLOCK_N: tl.constexpr):
        """Pool block of each key start..start+BLOCK_N (0 past ``k_end``), int64 [BN]."""
        keys = start + tl.arange(0, BLOCK_N)  # [BN]
        kmask = keys < k_end
        return tl.load(table_row + keys // block_size, mask=kmask, other=0).to(tl.int64)

    @triton.jit
    def _tile_kv(
        start,
        k_end,
        blk,
        block_size,
        h,
        k_ptr,
        v_ptr,
        ts_pool_ptr,
        stride_kv_block,
        stride_kv_slot,
        D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """K, V [BN, D] and key timestamps [BN] of one key tile, given its blocks [BN].

        Keys past ``k_end`` read as zeros: a zero V row adds nothing to the output, so the
        score loop needs no per-element mask.
        """
        keys = start + tl.arange(0, BLOCK_N)  # [BN]
        kmask = keys < k_end
        slot = keys % block_size
        rows = blk * stride_kv_block + slot * stride_kv_slot + h * D  # [BN]
        offs = rows[:, None] + tl.arange(0, D)[None, :]  # [BN, D]
        k = tl.load(k_ptr + offs, mask=kmask[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=kmask[:, None], other=0.0)
        k_ts = tl.load(ts_pool_ptr + blk * block_size + slot, mask=kmask, other=0)
        return k, v, k_ts

    @triton.jit
    def _silu_over_n(s, inv_divisor, FAST: tl.constexpr):
        """silu(s) / N in fp32. FAST (bf16/fp16 inputs): ``silu(s) = h + h·tanh(h)`` with
        h = s/2 and one ``tanh.approx`` (one special-function op instead of an exp and a
        division; its 2^-11 relative error is below the bf16 rounding that follows)."""
        if FAST:
            t = tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;", "=f,f", [s * 0.5], dtype=tl.float32, is_pure=True,
                pack=1,
            )  # fmt: skip
            # (scalars come in as fp32, or as fp64 from Inductor: cast the product)
            c = (s * 0.5 * inv_divisor).to(tl.float32)
            return c * t + c
        else:
            return (s * tl.sigmoid(s) * inv_divisor).to(tl.float32)

    @triton.jit
    def _bias(
        keys, kmask, k_ts, pos, ts_q, h, pos_bias_ptr, edges, tb_delta, tb0, H: tl.constexpr,
        NUM_POS: tl.constexpr,
    ):  # fmt: skip
        """rab of one query against a tile of keys, fp32 [BN].

        The time bucket is ``bucketize(|dt|, edges, right=True)`` = the number of edges
        <= |dt|, so ``time_bias[bucket] = time_bias[0] + Σ_{edge <= |dt|} Δ`` with
        Δ[e] = time_bias[e+1] - time_bias[e] held in registers: exact integer bucketing
        and no load that waits on the bucket. (A gather of ``time_bias[bucket]`` instead
        made the memory-bound decode kernel ~3x slower on the H200: one more dependent
        load per key tile.)
        """
        dt = ts_q - k_ts
        dt = tl.where(dt < 0, -dt, dt)  # [BN]
        t_bias = tb0 + tl.sum(tl.where(dt[:, None] >= edges[None, :], tb_delta[None, :], 0.0), 1)
        rel = tl.minimum(tl.maximum(pos - keys, 0), NUM_POS - 1)
        p_bias = tl.load(pos_bias_ptr + rel * H + h, mask=kmask, other=0.0).to(tl.float32)
        return t_bias + p_bias

    @triton.jit
    def _time_table(time_bias_ptr, edges_ptr, h, H: tl.constexpr, NUM_TIME: tl.constexpr,
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
    def _decode_kernel(
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
        out_ptr,  # [G, H, D] fp32, zeroed: splits add into it
        max_blocks,
        block_size,
        keys_per_split,
        stride_kv_block,
        stride_kv_slot,
        scale,
        inv_divisor,
        H: tl.constexpr,
        D: tl.constexpr,
        NUM_POS: tl.constexpr,
        NUM_TIME: tl.constexpr,
        NT_P2: tl.constexpr,
        BLOCK_N: tl.constexpr,
        FAST: tl.constexpr,
    ):
        """One query (a new token) x one head x one key range: memory-bound decode."""
        g = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        split = tl.program_id(2)
        user = tl.load(q_user_ptr + g).to(tl.int64)
        n_keys = tl.load(lens_ptr + user).to(tl.int32)
        k_start = split * keys_per_split
        k_end = tl.minimum(n_keys, k_start + keys_per_split)
        if k_start < k_end:
            offs_d = tl.arange(0, D)
            # Inductor passes Python floats as fp64 scalars: every product is cast to fp32.
            q = (tl.load(q_ptr + (g * H + h) * D + offs_d).to(tl.float32) * scale).to(tl.float32)
            pos = tl.load(q_pos_ptr + g).to(tl.int32)
            ts_q = tl.load(q_ts_ptr + g)
            edges, tb_delta, tb0 = _time_table(time_bias_ptr, edges_ptr, h, H, NUM_TIME, NT_P2)
            table_row = tables_ptr + user * max_blocks
            acc = tl.zeros((D,), dtype=tl.float32)
            for start in range(k_start, k_end, BLOCK_N):
                blk = _tile_blocks(start, k_end, table_row, block_size, BLOCK_N)
                k, v, k_ts = _tile_kv(
                    start, k_end, blk, block_size, h, k_ptr, v_ptr, ts_pool_ptr, stride_kv_block,
                    stride_kv_slot, D, BLOCK_N,
                )  # fmt: skip
                keys = start + tl.arange(0, BLOCK_N)  # [BN]
                kmask = keys < k_end
                s = tl.sum(k.to(tl.float32) * q[None, :], 1)  # [BN]
                s += _bias(keys, kmask, k_ts, pos, ts_q, h, pos_bias_ptr, edges, tb_delta,
                           tb0, H, NUM_POS)  # fmt: skip
                w = _silu_over_n(s, inv_divisor, FAST)  # masked keys: V rows are zero
                acc += tl.sum(w[:, None] * v.to(tl.float32), 0)
            tl.atomic_add(out_ptr + (g * H + h) * D + offs_d, acc)

    @triton.jit
    def _candidate_kernel(
        q_ptr,  # [B, C, H, D]
        q_pos_ptr,  # [B]: every candidate of a user sits at the same position ...
        q_ts_ptr,  # [B]: ... and has the same timestamp, so the bias is per key only
        q_user_ptr,  # [B]: the cache row of each query group (read when USER_MAP)
        k_ptr,
        v_ptr,
        ts_pool_ptr,
        tables_ptr,
        lens_ptr,
        pos_bias_ptr,
        time_bias_ptr,
        edges_ptr,
        out_ptr,  # [B, C, H, D] fp32, zeroed
        num_cands,
        m_tiles,
        max_blocks,
        block_size,
        keys_per_split,
        stride_kv_block,
        stride_kv_slot,
        scale,
        inv_divisor,
        H: tl.constexpr,
        D: tl.constexpr,
        NUM_POS: tl.constexpr,
        NUM_TIME: tl.constexpr,
        NT_P2: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        FAST: tl.constexpr,
        USER_MAP: tl.constexpr,
    ):
        """A tile of one group's queries x one head x one key range, on tensor cores.

        A group is a user's C candidates (rank), or with ``USER_MAP`` one new token of user
        ``q_user[group]`` padded to a 16-row tile (extend): tensor cores do 16x the needed
        math there, but K/V then stream through shared memory instead of registers.
        """
        pid = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        group = (pid // m_tiles).to(tl.int64)
        tile = pid % m_tiles
        if USER_MAP:  # noqa: SIM108 (Triton resolves a constexpr if, not a ternary)
            user = tl.load(q_user_ptr + group).to(tl.int64)
        else:
            user = group
        n_keys = tl.load(lens_ptr + user).to(tl.int32)
        k_start = split * keys_per_split
        k_end = tl.minimum(n_keys, k_start + keys_per_split)
        if k_start < k_end:
            offs_d = tl.arange(0, D)
            cand = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
            cmask = cand < num_cands
            rows = ((group * num_cands + cand) * H + h) * D  # [BM]
            q = tl.load(q_ptr + rows[:, None] + offs_d[None, :], mask=cmask[:, None], other=0.0)
            pos = tl.load(q_pos_ptr + group).to(tl.int32)
            ts_q = tl.load(q_ts_ptr + group)
            edges, tb_delta, tb0 = _time_table(time_bias_ptr, edges_ptr, h, H, NUM_TIME, NT_P2)
            table_row = tables_ptr + user * max_blocks
            acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
            for start in range(k_start, k_end, BLOCK_N):
                blk = _tile_blocks(start, k_end, table_row, block_size, BLOCK_N)
                k, v, k_ts = _tile_kv(
                    start, k_end, blk, block_size, h, k_ptr, v_ptr, ts_pool_ptr, stride_kv_block,
                    stride_kv_slot, D, BLOCK_N,
                )  # fmt: skip
                keys = start + tl.arange(0, BLOCK_N)  # [BN]
                kmask = keys < k_end
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                bias = _bias(keys, kmask, k_ts, pos, ts_q, h, pos_bias_ptr, edges, tb_delta,
                             tb0, H, NUM_POS)  # fmt: skip
                s = (s * scale).to(tl.float32) + bias[None, :]  # [BM, BN]
                w = _silu_over_n(s, inv_divisor, FAST)  # masked keys: V rows are zero
                if IEEE:
                    acc += tl.dot(w, v.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(w.to(v.dtype), v)
            tl.atomic_add(out_ptr + rows[:, None] + offs_d[None, :], acc, mask=cmask[:, None])

    def _next_pow2(n: int) -> int:
        return 1 << max(0, (int(n) - 1).bit_length())

    def launch_decode(
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
        block_n: int = DECODE_BLOCK_N,
        num_warps: int = DECODE_WARPS,
        target_programs: int = TARGET_PROGRAMS,
        fast: bool = True,
        mma: bool = DECODE_MMA,
        mma_stages: int = DECODE_MMA_STAGES,
    ) -> torch.Tensor:
        """The decode kernel with an explicit launch shape (the op uses the defaults;
        bench/h200_bench.py sweeps them). Returns fp32 [G, H, d]."""
        if mma:  # one new token per 16-row tensor-core tile
            return launch_candidates(
                q.unsqueeze(1), q_pos, q_ts, k_cache, v_cache, ts_pool, block_tables,
                cached_lens, pos_bias, time_bias, edges, divisor, 16, block_n, num_warps,
                mma_stages, target_programs, fast, q_user=q_user,
            ).squeeze(1)  # fmt: skip
        num_queries, num_heads, head_dim = q.shape
        block_size = ts_pool.shape[1]
        max_blocks = block_tables.shape[1]
        span = max_blocks * block_size
        splits = _num_splits(num_queries * num_heads, span, block_n, target_programs)
        per_split = (span + splits - 1) // splits
        per_split = (per_split + block_n - 1) // block_n * block_n
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        torch.library.wrap_triton(_decode_kernel)[(num_queries, num_heads, splits)](
            q.contiguous(), q_pos, q_ts, q_user, k_cache, v_cache, ts_pool, block_tables,
            cached_lens, pos_bias, time_bias, edges, out, max_blocks, block_size, per_split,
            k_cache.stride(0), k_cache.stride(1), 1.0 / math.sqrt(head_dim), 1.0 / divisor,
            H=num_heads, D=head_dim, NUM_POS=pos_bias.shape[0], NUM_TIME=time_bias.shape[0],
            NT_P2=_next_pow2(max(2, time_bias.shape[0] - 1)), BLOCK_N=block_n,
            FAST=fast_silu_allowed(fast, q), num_warps=num_warps,
        )  # fmt: skip
        return out

    def launch_candidates(
        q: torch.Tensor,
        q_pos: torch.Tensor,
        q_ts: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
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
        q_user: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The tensor-core kernel over q [groups, C, H, d] with an explicit launch shape.

        A group is one user's C candidates (rank), or with ``q_user`` [groups] a query
        group of user ``q_user[g]`` (the tensor-core decode). Returns fp32 of q's shape.
        """
        num_groups, num_cands, num_heads, head_dim = q.shape
        block_size = ts_pool.shape[1]
        max_blocks = block_tables.shape[1]
        span = max_blocks * block_size
        m_tiles = (num_cands + block_m - 1) // block_m
        splits = _num_splits(num_groups * m_tiles * num_heads, span, block_n, target_programs)
        per_split = (span + splits - 1) // splits
        per_split = (per_split + block_n - 1) // block_n * block_n
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grid = (num_groups * m_tiles, num_heads, splits)
        torch.library.wrap_triton(_candidate_kernel)[grid](
            q.contiguous(), q_pos, q_ts, q_pos if q_user is None else q_user, k_cache, v_cache,
            ts_pool, block_tables, cached_lens, pos_bias, time_bias, edges, out, num_cands,
            m_tiles, max_blocks, block_size, per_split, k_cache.stride(0), k_cache.stride(1),
            1.0 / math.sqrt(head_dim), 1.0 / divisor, H=num_heads, D=head_dim,
            NUM_POS=pos_bias.shape[0], NUM_TIME=time_bias.shape[0],
            NT_P2=_next_pow2(max(2, time_bias.shape[0] - 1)), BLOCK_M=block_m, BLOCK_N=block_n,
            IEEE=q.dtype == torch.float32, FAST=fast_silu_allowed(fast, q),
            USER_MAP=q_user is not None, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
        return out

    @torch.library.triton_op(OP_DECODE, mutates_args={})
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
    ) -> torch.Tensor:
        """Cached-context attention of G queries with their own positions/timestamps."""
        out = launch_decode(
            q, q_pos, q_ts, q_user, k_cache, v_cache, ts_pool, block_tables, cached_lens,
            pos_bias, time_bias, edges, divisor,
        )  # fmt: skip
        return out.to(q.dtype)

    @torch.library.triton_op(OP_CANDIDATES, mutates_args={})
    def paged_silu_attention_candidates(
        q: torch.Tensor,
        q_pos: torch.Tensor,
        q_ts: torch.Tensor,
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
        """Cached-context attention of C candidates per user (q [B, C, H, d])."""
        out = launch_candidates(
            q, q_pos, q_ts, k_cache, v_cache, ts_pool, block_tables, cached_lens, pos_bias,
            time_bias, edges, divisor,
        )  # fmt: skip
        return out.to(q.dtype)


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
) -> torch.Tensor:
    """New tokens (own position/timestamp each): q [G, H, d], ``kv_layer [2, NB, BS, H, d]``."""
    check_inputs(q, kv_layer[0])
    return torch.ops.streamrec.paged_silu_attention(
        q, q_pos, q_ts, q_user, kv_layer[0], kv_layer[1], ts_pool, block_tables,
        cached_lens, pos_bias, time_bias, edges, divisor,
    )  # fmt: skip


def fused_candidate_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_ts: torch.Tensor,
    kv_layer: torch.Tensor,
    ts_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cached_lens: torch.Tensor,
    pos_bias: torch.Tensor,
    time_bias: torch.Tensor,
    edges: torch.Tensor,
    divisor: int,
) -> torch.Tensor:
    """Candidates, C per user at one position/timestamp per user: q [B, C, H, d]."""
    check_inputs(q, kv_layer[0])
    return torch.ops.streamrec.paged_silu_attention_candidates(
        q, q_pos, q_ts, kv_layer[0], kv_layer[1], ts_pool, block_tables, cached_lens,
        pos_bias, time_bias, edges, divisor,
    )  # fmt: skip
