# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""Fused paged SiLU attention of new tokens (``extend``): one Triton kernel, one custom op.

The torch path of ``HSTU.extend`` gathers every query's cached K/V into a dense copy and
materialises the ``[queries × keys]`` score tensor in HBM; on the H200 that left ~90% of
the step's bandwidth to scores instead of K/V (issue 8). The kernel here walks each user's
block table, keeps scores in registers and accumulates in fp32.

``paged_silu_attention``: one program per chunk of a user's new tokens (at most
CHUNK_M = 16 consecutive tokens, each with its own position and timestamp) × one head ×
one range of keys. The chunk first iterates the user's cached keys through the block
table, then (the program of the first key range only) the user's own new keys of this
call up to each token, read from the jagged K/V of the step; never a ``[T, T]`` over the
batch (issue 13). A chunk of one token (every user of a one-event step) runs the vector
body, memory-bound; a longer one runs the tensor-core body of
``multi_query_attention.py``, where the chunk's tokens share each cached K/V tile (a user
with n new tokens used to cost n programs over the same cached rows, issue 13 item 4).

One kernel with a runtime branch on the chunk's size, not two kernels: the grid depends
on shapes only (the op exports), so both kernels would run in every call, each finding
its chunks among the same program ids and idling on the others: the one-token step
would pay a second launch of idle programs (a few µs, against 13 µs for the whole
decode at batch 1). The price of one kernel is its resources: ptxas allocates for both
bodies, so the tensor-core body is kept narrow (16-key tiles) until the kernel has the
one-token body's 128 registers (bf16, 4 warps: 4 programs per SM, as before;
``bench/kernel_resources.py --kernel decode``).

Keys are cut into ranges when the batch alone would leave the GPU idle: SiLU attention
has no softmax, so the partial sums of key ranges simply add. Each range writes its fp32
partial to a workspace and the last range of a query to arrive (an atomic ticket) adds
them in a fixed order and stores the result in the input dtype: no zero-filled output,
no cast kernel, and the sum is deterministic. The time bucket is computed from the
integer edges held in registers (no dependent table loads in the key loop). Grids depend
on shapes only, never on tensor values, so the op exports: ``triton_op`` + ``wrap_triton``
keep it as one graph node and AOTInductor packages the kernel. Without Triton (the CPU CI
machine) only the torch reference exists and ``triton_available()`` is False. The
candidate kernel of ``rank`` lives in ``candidate_attention.py``; the ``@triton.jit``
helpers both use are in ``paged_tiles.py``.

An FP8 pool (``kv_scale`` given: the layer's ``[2, H]`` scales, models/fp8.py) is read
as e4m3 codes, half the bytes of bf16, and dequantized in registers at no extra cost: a
head's scale is one power of two, so it goes into the query (K) and into the accumulator
once after the cached keys (V); scaling by a power of two commutes with rounding, so the
sums are those over the dequantized values. The step's own new keys arrive already in
their cached (dequantized) form.
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake

from streamrec.errors import ModelError
from streamrec.models.attention import relative_bias, silu_attention
from streamrec.models.fp8 import check_kv_scale, dequantize, gather_blocks
from streamrec.models.multi_query_attention import (
    CHUNK_M,
    CHUNK_N,
    TOKEN_SCAN,
    busy_programs,
    chunk_programs,
)
from streamrec.models.triton_lang import tl, triton

if triton is not None:
    from streamrec.models.multi_query_attention import multi_query_chunk, token_chunk
    from streamrec.models.paged_tiles import (
        finish_tile,
        key_bias,
        silu_over_n,
        tile_kv_ts,
        time_table,
    )

OP_DECODE = "streamrec::paged_silu_attention"
# Launch shape (bench/h200_bench.py sweeps it, BENCHMARKS.md). About TARGET_PROGRAMS
# programs fill the GPU: a smaller batch is cut along the keys until it has that many
# (512: the fastest at batch 8 and 64 in two H100 sweeps, within 4 % of 1,024 on the
# H200). DECODE_ACC2D accumulates P·V per key row and reduces once at the end instead of
# a cross-warp reduction per key tile.
TARGET_PROGRAMS = 512
DECODE_BLOCK_N = 32
DECODE_WARPS = 4
DECODE_ACC2D = True
# The one-token body issues the next key tile's loads before this tile's math (a software
# pipeline of depth 2 by hand). Measured: no gain (H100, 103.7 -> 103.3 us at batch 64).
DECODE_PREFETCH = False
# Depth of Triton's own pipeline over the one-token key loop (``tl.range(num_stages=)``):
# 1 is a plain loop (no asynchronous copies: that loop holds no tl.dot, so Triton leaves it
# alone unless asked); 2-3 put K, V and the timestamps of the next tiles in flight through
# shared memory (sm_90a, 32-key tiles: 4 async copies, 152 registers against 128; bench/
# kernel_resources.py). Measured (H100, 2026-12-06, fifteenth session): bf16 gains nothing
# (batch 64: 0.1061 ms at 16x4x1024 stages 3 against 0.1036 at the plain 32x4x512), FP8
# does: an FP8 tile is half the bytes, so more of them must be in flight. An FP8 pool
# takes its own launch, 16-key tiles, 1,024 programs, 3 stages: the fastest of nine at
# batch 64 and 256 (0.0774 / 0.2320 ms against 0.0943 / 0.2657 at the bf16 launch).
DECODE_STAGES = 1
# (BLOCK_N, TARGET_PROGRAMS, STAGES) of the one-token body, per pool dtype
DECODE_LAUNCH = (DECODE_BLOCK_N, TARGET_PROGRAMS, DECODE_STAGES)
DECODE_FP8_LAUNCH = (16, 1024, 3)


def triton_available() -> bool:
    """True when the fused ops are registered (Triton imported)."""
    return triton is not None


def paged_silu_attention_reference(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_ts: torch.Tensor,
    q_user: torch.Tensor,
    q_start: torch.Tensor | None,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ts_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cached_lens: torch.Tensor,
    pos_bias: torch.Tensor,
    time_bias: torch.Tensor,
    edges: torch.Tensor,
    divisor: int,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The math of the op in plain torch (dense gathers): the oracle of the tests.

    q [G, H, d]; q_pos, q_ts, q_user [G]; k_cache, v_cache [NB, BS, H, d] (one layer of
    the pool; FP8 codes with ``kv_scale [2, H]``); ts_pool [NB, BS]; block_tables
    [B, MB]; cached_lens [B]. With ``q_start`` [G] the queries are the step's new tokens
    (k_new, v_new [G, H, d]) and query g also sees tokens q_start[g] … g of them
    (position q_pos, timestamp q_ts). Returns [G, H, d].
    """
    num_blocks, block_size = ts_pool.shape
    blocks = block_tables[q_user].long().clamp(0, num_blocks - 1)  # [G, MB]
    g, mb = blocks.shape
    span = mb * block_size
    k = gather_blocks(k_cache, blocks).reshape(g, span, *k_cache.shape[-2:])  # [G, S, H, d]
    v = gather_blocks(v_cache, blocks).reshape(g, span, *v_cache.shape[-2:])  # [G, S, H, d]
    if kv_scale is not None:  # FP8 codes -> values
        k = dequantize(k, kv_scale[0].unsqueeze(-1), q.dtype)
        v = dequantize(v, kv_scale[1].unsqueeze(-1), q.dtype)
    k_ts = ts_pool[blocks].reshape(g, span)  # [G, S]
    key_pos = torch.arange(span, device=q.device, dtype=torch.int64)  # [S]
    mask = (key_pos.unsqueeze(0) < cached_lens[q_user].unsqueeze(1)).unsqueeze(1)  # [G, 1, S]
    rel = (q_pos.unsqueeze(1) - key_pos.unsqueeze(0)).unsqueeze(1)  # [G, 1, S]
    dt = (q_ts.unsqueeze(1) - k_ts).unsqueeze(1)  # [G, 1, S]
    bias = relative_bias(rel, dt, pos_bias, time_bias, edges).to(q.dtype)  # [G, H, 1, S]
    out = silu_attention(q.unsqueeze(1), k, v, bias, mask, divisor).squeeze(1)  # [G, H, d]
    if q_start is None or k_new is None or v_new is None:
        return out
    tok = torch.arange(g, device=q.device)
    width = int((tok - q_start).max()) + 1 if g else 1  # longest run of own keys
    key = tok.unsqueeze(1) - torch.arange(width, device=q.device).unsqueeze(0)  # [G, W]
    own = (key >= q_start.unsqueeze(1)).unsqueeze(1)  # [G, 1, W]
    key = key.clamp(min=0)
    rel = (q_pos.unsqueeze(1) - q_pos[key]).unsqueeze(1)  # [G, 1, W]
    dt = (q_ts.unsqueeze(1) - q_ts[key]).unsqueeze(1)  # [G, 1, W]
    bias = relative_bias(rel, dt, pos_bias, time_bias, edges).to(q.dtype)  # [G, H, 1, W]
    fresh = silu_attention(q.unsqueeze(1), k_new[key], v_new[key], bias, own, divisor)
    return out + fresh.squeeze(1)


def check_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, kv_scale: torch.Tensor | None = None
) -> None:
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
    check_kv_scale(k_cache.dtype, kv_scale, k_cache.shape[-2])


def check_pow2_blocks(k_cache: torch.Tensor) -> None:
    """The tensor-core key tiles (candidates, multi-token extends) find a key's block and
    slot by a shift and a mask; a traced (symbolic) size is the AOTI runtime's to check."""
    block_size = k_cache.shape[1]
    if isinstance(block_size, int) and block_size & (block_size - 1):
        raise ModelError(
            f"paged attention needs a power-of-two pool block size, got {block_size} "
            "(a key's block and slot are a shift and a mask)"
        )


def dense(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The index tensors a kernel reads by computed offsets, made contiguous (a no-op,
    no copy, for tensors that already are)."""
    return tuple(t.contiguous() for t in tensors)


def fast_silu_allowed(fast: bool, q: torch.Tensor) -> bool:
    """Whether a launch may use the ``tanh.approx`` SiLU: bf16/fp16 only, eager and
    traced (torch.compile, AOTInductor) alike.

    Traced launches ran the exact sigmoid until 2026-12-01: an Inductor-compiled step
    with the inline assembly once hit an illegal memory access on the H200. Inductor
    passed the kernels' float scalars as fp64, so the assembly's fp32 operand was an
    fp64 product; the kernels now cast those scalars to fp32 at entry and the operand
    explicitly (BENCHMARKS.md, issue 15), and the package runs the same SiLU as eager."""
    return fast and q.dtype != torch.float32


def head_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., H, d]`` with each token's ``[H, d]`` contiguous, so a kernel can address
    it by one token stride. Eager views (the chunks of the projection) pass as they are;
    under tracing the tensor is made contiguous, so the strides the kernel was traced
    with are the ones Inductor allocates (the copy fuses into the producer)."""
    traced = torch.compiler.is_compiling() or is_fake(x)
    if traced or x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        return x.contiguous()
    return x


def num_splits(programs: int, span: int, block_n: int, target: int = TARGET_PROGRAMS) -> int:
    """Key ranges per query so that about ``target`` programs run; works on SymInts.

    SiLU attention has no softmax, so the partial sums of key ranges simply add: a small
    batch (few programs) is cut along the keys to fill the GPU, a large one is not cut.
    """
    per_split_min = (span + block_n - 1) // block_n  # ranges of one key tile each
    wanted = (target + programs - 1) // programs
    return torch.sym_max(1, torch.sym_min(per_split_min, wanted))


def split_buffers(
    splits: int, outputs: int, tiles: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 workspace [splits · outputs] for the partial sums and zeroed int32 tickets
    [tiles], both one element long when there is a single range (nothing to combine).
    Sizes are SymInt arithmetic (no branch on a traced value)."""
    used = torch.sym_min(splits - 1, 1)  # 0 for one range, else 1
    ws = torch.empty(used * splits * outputs + 1, dtype=torch.float32, device=device)
    tickets = torch.zeros(used * tiles + 1, dtype=torch.int32, device=device)
    return ws, tickets


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _decode_tile(
        acc, q, k, v, rel, kmask, dt, h, pos_bias_ptr, edges, tb_delta, tb0, inv_divisor,
        H: tl.constexpr, NUM_POS: tl.constexpr, ACC2D: tl.constexpr, FAST: tl.constexpr,
    ):  # fmt: skip
        """acc += Σ_keys silu(q·k + rab) / N · v over one tile (masked keys: V rows 0)."""
        s = tl.sum(k.to(tl.float32) * q[None, :], 1)  # [BN]
        s += key_bias(rel, kmask, dt, h, pos_bias_ptr, edges, tb_delta, tb0, H, NUM_POS)
        w = silu_over_n(s, inv_divisor, FAST)  # [BN]
        if ACC2D:
            acc += w[:, None] * v.to(tl.float32)  # [BN, D]: one reduction at the end
        else:
            acc += tl.sum(w[:, None] * v.to(tl.float32), 0)  # [D]
        return acc

    @triton.jit
    def _decode_kernel(
        q_ptr,  # [G, H, D], token stride stride_q
        q_pos_ptr,  # [G]
        q_ts_ptr,  # [G]
        q_user_ptr,  # [G]
        q_start_ptr,  # [G]: first new token of the query's user
        kn_ptr,  # [G, H, D] new keys (the queries' own tokens), token stride stride_new
        vn_ptr,  # [G, H, D]
        k_ptr,  # [NB, BS, H, D] (one layer of the pool)
        v_ptr,  # [NB, BS, H, D]
        ts_pool_ptr,  # [NB, BS]
        tables_ptr,  # [B, MB]
        lens_ptr,  # [B]
        pos_bias_ptr,  # [NUM_POS, H]
        time_bias_ptr,  # [NUM_TIME, H]
        edges_ptr,  # [NUM_TIME - 1]
        kv_scale_ptr,  # [2, H] fp32 (KV_FP8): a cached value is code * scale
        out_ptr,  # [G, H, D] in q's dtype
        ws_ptr,  # [splits, G, H, D] fp32 partials (when splits > 1)
        ticket_ptr,  # [G, H] int32, zeroed (when splits > 1)
        num_queries,
        max_blocks,
        block_size,
        keys_per_split,
        stride_q,
        stride_new,
        stride_kv_block,
        stride_kv_slot,
        ws_stride,
        scale,
        inv_divisor,
        H: tl.constexpr,
        D: tl.constexpr,
        NUM_POS: tl.constexpr,
        NUM_TIME: tl.constexpr,
        NT_P2: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CHUNK_N: tl.constexpr,
        SCAN: tl.constexpr,
        ACC2D: tl.constexpr,
        IEEE: tl.constexpr,
        FAST: tl.constexpr,
        KV_FP8: tl.constexpr,
        PREFETCH: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        """One chunk of a user's new tokens x one head x one key range: cached keys, then
        (range 0) the user's new keys up to each token. A chunk of one token runs the
        vector body below, a longer one ``multi_query_chunk``."""
        # Inductor (AOTI) passes Python floats as fp64 scalars: fp32 once, not per key.
        scale = tl.cast(scale, tl.float32)
        inv_divisor = tl.cast(inv_divisor, tl.float32)
        h = tl.program_id(1)
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)
        num_queries = tl.cast(num_queries, tl.int32)
        user, lead, row0, rows = token_chunk(
            tl.program_id(0), q_user_ptr, q_start_ptr, num_queries, BLOCK_M, SCAN
        )
        if rows > 0:
            n_keys = tl.load(lens_ptr + user).to(tl.int32)
            # Inductor types a symbolic int as int64, which made the key loop and each key's
            # block // and % 64-bit (the kernel ran 10 % slower in the package): int32 here.
            k_start = split * tl.cast(keys_per_split, tl.int32)
            k_end = tl.minimum(n_keys, k_start + tl.cast(keys_per_split, tl.int32))
            table_row = tables_ptr + user.to(tl.int64) * max_blocks
            # (each body loads its own part of the time table: loaded here for both, held
            # across the branch, it took the kernel from 128 to 144 registers when the
            # none of the integer arguments was divisible by 16, bench/kernel_resources.py)
            if rows == 1:
                edges, tb_delta, tb0 = time_table(time_bias_ptr, edges_ptr, h, H, NUM_TIME, NT_P2)
                g = row0.to(tl.int64)
                offs_d = tl.arange(0, D)
                # Inductor passes Python floats as fp64 scalars: every product is cast to fp32.
                q = (tl.load(q_ptr + g * stride_q + h * D + offs_d).to(tl.float32) * scale).to(
                    tl.float32
                )
                if KV_FP8:  # noqa: SIM108 (q . (code * s) = (q * s) . code, exactly: s = 2^e)
                    q_cached = (q * tl.load(kv_scale_ptr + h)).to(tl.float32)
                else:
                    q_cached = q
                pos = tl.load(q_pos_ptr + g).to(tl.int32)
                ts_q = tl.load(q_ts_ptr + g)
                if ACC2D:
                    acc = tl.zeros((BLOCK_N, D), dtype=tl.float32)
                else:
                    acc = tl.zeros((D,), dtype=tl.float32)
                if PREFETCH:  # the next tile's loads go out before this tile's math
                    k, v, k_ts = tile_kv_ts(k_start, k_end, table_row, block_size, h, k_ptr,
                                            v_ptr, ts_pool_ptr, stride_kv_block,
                                            stride_kv_slot, D, BLOCK_N)  # fmt: skip
                for start in tl.range(k_start, k_end, BLOCK_N, num_stages=STAGES):
                    if PREFETCH:  # (a tile past k_end is masked: nothing is read)
                        k_a, v_a, ts_a = tile_kv_ts(start + BLOCK_N, k_end, table_row,
                                                    block_size, h, k_ptr, v_ptr, ts_pool_ptr,
                                                    stride_kv_block, stride_kv_slot, D,
                                                    BLOCK_N)  # fmt: skip
                    else:
                        k, v, k_ts = tile_kv_ts(start, k_end, table_row, block_size, h, k_ptr,
                                                v_ptr, ts_pool_ptr, stride_kv_block,
                                                stride_kv_slot, D, BLOCK_N)  # fmt: skip
                    keys = start + tl.arange(0, BLOCK_N)  # [BN]
                    acc = _decode_tile(acc, q_cached, k, v, pos - keys, keys < k_end,
                                       ts_q - k_ts, h, pos_bias_ptr, edges, tb_delta, tb0,
                                       inv_divisor, H, NUM_POS, ACC2D, FAST)  # fmt: skip
                    if PREFETCH:
                        k, v, k_ts = k_a, v_a, ts_a
                if KV_FP8:  # Σ w (code * s) = s Σ w code: the V scale once, before the new keys
                    acc = acc * tl.load(kv_scale_ptr + H + h)
                if split == 0:  # this call's own tokens of the user: q_start[g] .. g
                    # (names of their own: a name the key loop above assigned would be
                    # carried into this loop with the key loop's types, int32 keys against
                    # int64 here)
                    for first in range(tl.load(q_start_ptr + g), g + 1, BLOCK_N):
                        tokens = first + tl.arange(0, BLOCK_N)  # [BN] token indices
                        tmask = tokens <= g
                        offs = (tokens * stride_new + h * D)[:, None] + offs_d[None, :]  # [BN, D]
                        kn = tl.load(kn_ptr + offs, mask=tmask[:, None], other=0.0)
                        vn = tl.load(vn_ptr + offs, mask=tmask[:, None], other=0.0)
                        t_ts = tl.load(q_ts_ptr + tokens, mask=tmask, other=0)
                        t_pos = tl.load(q_pos_ptr + tokens, mask=tmask, other=0).to(tl.int32)
                        acc = _decode_tile(acc, q, kn, vn, pos - t_pos, tmask, ts_q - t_ts, h,
                                           pos_bias_ptr, edges, tb_delta, tb0, inv_divisor, H,
                                           NUM_POS, ACC2D, FAST)  # fmt: skip
                if ACC2D:  # noqa: SIM108 (Triton resolves a constexpr if, not a ternary)
                    out = tl.sum(acc, 0)  # [D]
                else:
                    out = acc
                finish_tile(out, (g * H + h) * D + offs_d, offs_d < D, out_ptr, ws_ptr,
                        ticket_ptr + g * H + h, split, num_splits, ws_stride)  # fmt: skip
            else:  # the tensor-core body (multi_query_attention.py)
                multi_query_chunk(
                    row0, rows, lead, k_start, k_end, h, split, num_splits, table_row,
                    q_ptr, q_pos_ptr, q_ts_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, ts_pool_ptr,
                    pos_bias_ptr, time_bias_ptr, edges_ptr, kv_scale_ptr, out_ptr, ws_ptr,
                    ticket_ptr, block_size, stride_q, stride_new, stride_kv_block,
                    stride_kv_slot, ws_stride, scale, inv_divisor, H, D, NUM_POS, NUM_TIME,
                    NT_P2, BLOCK_M, CHUNK_N, IEEE, FAST, KV_FP8,
                )  # fmt: skip

    def launch_decode(
        q: torch.Tensor,
        q_pos: torch.Tensor,
        q_ts: torch.Tensor,
        q_user: torch.Tensor,
        q_start: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
        pos_bias: torch.Tensor,
        time_bias: torch.Tensor,
        edges: torch.Tensor,
        divisor: int,
        block_n: int | None = None,
        num_warps: int = DECODE_WARPS,
        target_programs: int | None = None,
        fast: bool = True,
        acc2d: bool = DECODE_ACC2D,
        kv_scale: torch.Tensor | None = None,
        block_m: int = CHUNK_M,
        chunk_n: int = CHUNK_N,
        prefetch: bool = DECODE_PREFETCH,
        stages: int | None = None,
    ) -> torch.Tensor:
        """The decode kernel with an explicit launch shape (the op uses the defaults;
        bench/h200_bench.py sweeps them); an FP8 pool with ``kv_scale [2, H]``. A chunk of
        ``block_m`` new tokens of one user runs over key tiles of ``chunk_n``, one token
        over tiles of ``block_n``; ``block_n``, ``target_programs`` and ``stages`` default
        by the pool's dtype. Returns [G, H, d] in q's dtype."""
        default = DECODE_LAUNCH if kv_scale is None else DECODE_FP8_LAUNCH
        block_n = default[0] if block_n is None else block_n
        target_programs = default[1] if target_programs is None else target_programs
        stages = default[2] if stages is None else stages
        q, k_new, v_new = head_rows(q), head_rows(k_new), head_rows(v_new)
        num_queries, num_heads, head_dim = q.shape
        num_users = cached_lens.shape[0]
        block_size = ts_pool.shape[1]
        max_blocks = block_tables.shape[1]
        span = max_blocks * block_size
        tile = max(block_n, chunk_n)  # key ranges of whole tiles of both bodies
        busy = busy_programs(num_users, num_queries, block_m)
        splits = num_splits(busy * num_heads, span, tile, target_programs)
        per_split = (span + splits - 1) // splits
        per_split = (per_split + tile - 1) // tile * tile
        outputs = num_queries * num_heads * head_dim
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        ws, tickets = split_buffers(splits, outputs, num_queries * num_heads, q.device)
        grid = (chunk_programs(num_users, num_queries, block_m), num_heads, splits)
        torch.library.wrap_triton(_decode_kernel)[grid](
            q, q_pos, q_ts, q_user, q_start, k_new, v_new, k_cache, v_cache, ts_pool,
            block_tables, cached_lens, pos_bias, time_bias, edges,
            q_pos if kv_scale is None else kv_scale, out, ws, tickets, num_queries,
            max_blocks, block_size, per_split, q.stride(0), k_new.stride(0),
            k_cache.stride(0), k_cache.stride(1), outputs, 1.0 / math.sqrt(head_dim),
            1.0 / divisor, H=num_heads, D=head_dim, NUM_POS=pos_bias.shape[0],
            NUM_TIME=time_bias.shape[0], NT_P2=next_pow2(max(2, time_bias.shape[0] - 1)),
            BLOCK_M=block_m, BLOCK_N=block_n, CHUNK_N=chunk_n, SCAN=TOKEN_SCAN, ACC2D=acc2d,
            IEEE=q.dtype == torch.float32, FAST=fast_silu_allowed(fast, q),
            KV_FP8=kv_scale is not None, PREFETCH=prefetch, STAGES=stages,
            num_warps=num_warps,
        )  # fmt: skip
        return out

    @torch.library.triton_op(OP_DECODE, mutates_args={})
    def paged_silu_attention(
        q: torch.Tensor,
        q_pos: torch.Tensor,
        q_ts: torch.Tensor,
        q_user: torch.Tensor,
        q_start: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
        pos_bias: torch.Tensor,
        time_bias: torch.Tensor,
        edges: torch.Tensor,
        divisor: int,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the step's new tokens to their user's cache and to each other."""
        return launch_decode(
            q, q_pos, q_ts, q_user, q_start, k_new, v_new, k_cache, v_cache, ts_pool,
            block_tables, cached_lens, pos_bias, time_bias, edges, divisor,
            kv_scale=kv_scale,
        )  # fmt: skip


ATTENTION_BACKENDS = ("auto", "torch", "triton")


def fused_attention_enabled(backend: str, q: torch.Tensor, head_dim: int | None = None) -> bool:
    """Whether ``backend`` routes the attention of ``q`` (head_dim: its last dim unless
    given) through the fused ops.

    "auto" takes the fused kernel whenever it can run (CUDA tensor, Triton present,
    power-of-two head_dim); "triton" insists and says why it cannot; "torch" never.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ModelError(f"attention_backend={backend!r} must be one of {ATTENTION_BACKENDS}")
    if backend == "torch":
        return False
    head_dim = q.shape[-1] if head_dim is None else head_dim
    usable = triton_available() and q.is_cuda and head_dim >= 16 and not head_dim & (head_dim - 1)
    if backend == "triton" and not usable:
        raise ModelError(
            f"attention_backend='triton' needs Triton, a CUDA tensor and a power-of-two "
            f"head_dim >= 16 (triton={triton_available()}, device={q.device}, "
            f"head_dim={head_dim})"
        )
    return usable


def fused_token_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    q_pos: torch.Tensor,
    q_ts: torch.Tensor,
    q_user: torch.Tensor,
    q_start: torch.Tensor,
    kv_layer: torch.Tensor,
    ts_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cached_lens: torch.Tensor,
    pos_bias: torch.Tensor,
    time_bias: torch.Tensor,
    edges: torch.Tensor,
    divisor: int,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The step's new tokens q, k_new, v_new [T, H, d] (jagged by user: each user's tokens
    contiguous, users ascending, ``q_start`` the first token of each token's user, as
    ``extend`` lays them out) against their user's cache ``kv_layer [2, NB, BS, H, d]``
    and each other, causally. An FP8 pool needs the layer's ``kv_scale [2, H]``; the new
    keys/values are then their cached (dequantized) form."""
    check_inputs(q, kv_layer[0], kv_scale)
    check_pow2_blocks(kv_layer[0])
    # The kernel indexes these as dense rows (a sliced block table would be read with the
    # wrong row stride, silently): a no-op for the step's own contiguous tensors.
    q_pos, q_ts, q_user, q_start, block_tables, cached_lens = dense(
        q_pos, q_ts, q_user, q_start, block_tables, cached_lens
    )
    return torch.ops.streamrec.paged_silu_attention(
        q, q_pos, q_ts, q_user, q_start, k_new, v_new, kv_layer[0], kv_layer[1], ts_pool,
        block_tables, cached_lens, pos_bias, time_bias, edges, divisor, kv_scale,
    )  # fmt: skip
