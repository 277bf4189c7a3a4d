# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""Fused paged SiLU attention of ranking candidates (``rank``): two kernels, one custom op.

All C candidates of user b sit at position cached_lens[b] with timestamp query_ts[b], so
the relative bias depends on the key only: ``_key_bias_kernel`` writes it once per
(user, head, key) — the bucket of each key computed once for all heads — and the
candidate kernel reads one fp32 row per key tile instead of computing it per tile
(issue 14: computing the time bucket inside the key loop cost more ALU work than the two
GEMMs of the tile). A tile of one user's candidates then shares every loaded K/V tile
through ``tl.dot``; the candidate's own key (relative position 0, dt 0) is added by the
program of the first key range, so ``rank`` needs no separate self-attention term. The
op reads q, k, v straight from their columns of the layer's packed projection (SiLU on
load when it is not applied yet): copying them out first cost three extra kernels per
layer in the compiled step.

Key ranges and their combination work as in ``paged_attention.py`` (the shared helpers
live in ``paged_tiles.py``): a partial per range in a workspace, the last range stores the
sum in the input dtype. An FP8 pool (``kv_scale``) is read as e4m3 codes, converted to the
model dtype in registers (exact) for the tensor-core dots; the head's power-of-two scales
go into the score scale (K) and into the accumulator after the cached keys (V).
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake

from streamrec.errors import ModelError
from streamrec.models.attention import self_attention_term
from streamrec.models.paged_attention import (
    check_inputs,
    check_pow2_blocks,
    dense,
    fast_silu_allowed,
    head_rows,
    next_pow2,
    num_splits,
    paged_silu_attention_reference,
    split_buffers,
)
from streamrec.models.triton_lang import tl, triton

if triton is not None:
    from streamrec.models.paged_tiles import (
        dot_k_scale,
        dot_tile_kv,
        finish_tile,
        silu_of_half,
        silu_over_n,
    )

OP_CANDIDATES = "streamrec::paged_silu_attention_candidates"
# Launch shape (bench/h200_bench.py sweeps it): BLOCK_M candidates x BLOCK_N keys per
# tile; no key split until fewer than CAND_TARGET_PROGRAMS programs would run.
CAND_TARGET_PROGRAMS = 256
# 64 x 64 tiles, 4 warps, 3 stages: the fastest launch at batch 1, 8 and 64 once the key
# loop lost its per-key division, masked bias copies and two FMULs per score (572 -> 327
# SASS at 128x64x8x2, 860 -> 518 at this launch; nineteenth session). H100, one run before
# and after (bench/results/h100_rank_sweep_1206h_*.json): batch 64 0.2365 ms (290.8
# TFLOP/s) against 0.2817 for 128x64x8x2 after the change and 0.3042 before it; batch 8
# 45.7 against 62.7 us; batch 1 30.8 against 51.2 us. The third stage moves the block
# table's loads off the loop's critical path (asynchronous copies, not a waited load).
CAND_BLOCK_M = 64
CAND_BLOCK_N = 64
CAND_WARPS = 4
CAND_STAGES = 3
CAND_LAUNCH = (CAND_BLOCK_M, CAND_BLOCK_N, CAND_WARPS, CAND_STAGES)
# An FP8 pool takes 128-key tiles: its tile is half the bytes, and 128 x 128 was the
# fastest FP8 launch of the bench in both H100 runs of 2026-12-06 (batch 64 / 256: 0.2916
# / 1.0931 ms against 0.3597 / 1.3532 at bf16's launch then, 1.23x) and again after the
# nineteenth session's change (batch 256: 1.088 ms against 1.151 at 64x64x4x3).
CAND_FP8_LAUNCH = (128, 128, 8, 2)
# A small batch has few candidate tiles (2 per user at 256 candidates): half-height tiles
# double the programs. In the H200 sweep of 2026-12-01 (bench/results/h200_kernel_sweep.json,
# before the packed projection) 64x64x4x3 took 28.3 us at batch 1 against the default's
# 51.0 (1.80x; Meta's Triton kernel 34.5) and 56.1 against 64.3 at batch 8 (1.15x), 0.3265
# against 0.3013 ms at batch 64. Timed on today's kernel (H100, `decode` stage of
# 2026-12-06, bench/results/h100_attention_sweep_1206g.json): 29.9 against 51.9 us at
# batch 1 (1.74x), 56.1 against 65.2 at batch 8 (1.16x), 0.3189 against 0.3078 ms at
# batch 64 (0.97x: the default stays above 8 users). An exported op (symbolic batch)
# keeps CAND_LAUNCH. Since the nineteenth session CAND_LAUNCH is this launch too (the
# switch stays, for a default that differs again).
CAND_SMALL_USERS = 8
CAND_SMALL_LAUNCH = (64, 64, 4, 3)
CAND_LAUNCH_BY_BATCH = True
# An FP8 pool's codes go to the tensor cores as fp16, the query (bf16, converted once per
# tile) and the SiLU weights with them: e4m3 -> f16 is one instruction per two codes on
# sm_90, e4m3 -> bf16 goes through f32 (sm_90a compile, 128x64x8x2: the key loop 614 ->
# 518 SASS, bf16's 572; F2F 161 -> 112, PRMT 168 -> 96). Exact where bf16 is: fp16 holds
# every bf16 value in [2^-14, 65504] (the query is clamped to that range) and the weights
# with 3 more mantissa bits. Untimed (fp8_bench rows "bf16dots" time the old way).
CAND_FP8_FP16_DOTS = True
KEY_BIAS_BLOCK = 256


def candidate_attention_reference(
    q: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
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
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op's math in plain torch: q, k_self, v_self [B, C, H, d]; q_pos, q_ts [B]; an
    FP8 cache with ``kv_scale [2, H]``."""
    num_users, num_cands = q.shape[:2]
    users = torch.arange(num_users, device=q.device).repeat_interleave(num_cands)  # [B*C]
    cached = paged_silu_attention_reference(
        q.reshape(-1, *q.shape[2:]), q_pos[users], q_ts[users], users, None, None, None,
        k_cache, v_cache, ts_pool, block_tables, cached_lens, pos_bias, time_bias, edges,
        divisor, kv_scale,
    )  # fmt: skip
    own = self_attention_term(q, k_self, v_self, pos_bias[0] + time_bias[0], divisor)
    return cached.view_as(q) + own


if triton is not None:

    @triton.jit
    def _key_bias_kernel(
        q_pos_ptr,  # [B]
        q_ts_ptr,  # [B]
        ts_pool_ptr,  # [NB, BS]
        tables_ptr,  # [B, MB]
        lens_ptr,  # [B]
        pos_bias_ptr,  # [NUM_POS, H]
        time_bias_ptr,  # [NUM_TIME, H]
        edges_ptr,  # [NUM_TIME - 1]
        bias_ptr,  # [B, H, S] fp32 out
        max_blocks,
        block_size,
        span,
        H: tl.constexpr,
        NUM_POS: tl.constexpr,
        NUM_TIME: tl.constexpr,
        NT_P2: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """rab / 2 of user b's query position/timestamp against BLOCK of its keys, all
        heads (0 past the user's length, up to the padded row's end ``span``)."""
        b = tl.program_id(0).to(tl.int64)
        keys = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        kmask = keys < tl.load(lens_ptr + b)
        blk = tl.load(tables_ptr + b * max_blocks + keys // block_size, mask=kmask, other=0)
        slot = blk.to(tl.int64) * block_size + keys % block_size
        dt = tl.load(q_ts_ptr + b) - tl.load(ts_pool_ptr + slot, mask=kmask, other=0)
        dt = tl.where(dt < 0, -dt, dt)
        e = tl.arange(0, NT_P2)
        edges = tl.load(edges_ptr + e, mask=e < NUM_TIME - 1, other=9223372036854775807)
        bucket = tl.sum((dt[:, None] >= edges[None, :]).to(tl.int32), 1)  # [BLOCK]
        rel = tl.load(q_pos_ptr + b).to(tl.int32) - keys
        rel = tl.minimum(tl.maximum(rel, 0), NUM_POS - 1)
        for h in tl.static_range(H):
            p = tl.load(pos_bias_ptr + rel * H + h, mask=kmask, other=0.0).to(tl.float32)
            t = tl.load(time_bias_ptr + bucket * H + h, mask=kmask, other=0.0).to(tl.float32)
            tl.store(bias_ptr + (b * H + h) * span + keys, (p + t) * 0.5)  # (exact halving)

    @triton.jit
    def input_silu(x):
        """SiLU of a projection tile in fp32, as Inductor's pointwise kernel computes it."""
        xf = x.to(tl.float32)
        return xf * tl.sigmoid(xf)

    @triton.jit
    def _candidate_kernel(
        q_ptr,  # rows [B, C] of width >= H*D, strides stride_qb, stride_qc; q at q_col
        ks_ptr,  # the candidates' own keys (at k_col), rows strided stride_sb, stride_sc
        vs_ptr,  # and values (at v_col), same row strides as the keys
        kbias_ptr,  # [B, H, S] fp32: rab of each user's candidates against each key
        k_ptr,  # [NB, BS, H, D] (one layer of the pool)
        v_ptr,
        tables_ptr,  # [B, MB]
        lens_ptr,  # [B]
        pos_bias_ptr,  # [NUM_POS, H]: bias0 = pos_bias[0] + time_bias[0]
        time_bias_ptr,  # [NUM_TIME, H]
        kv_scale_ptr,  # [2, H] fp32 (KV_FP8): a cached value is code * scale
        out_ptr,  # [B, C, H, D] in q's dtype
        ws_ptr,  # [splits, B, C, H, D] fp32 partials (when splits > 1)
        ticket_ptr,  # [B * m_tiles, H] int32, zeroed (when splits > 1)
        q_col,
        k_col,
        v_col,
        num_cands,
        m_tiles,
        max_blocks,
        block_size,
        span,
        keys_per_split,
        stride_qb,
        stride_qc,
        stride_sb,
        stride_sc,
        stride_kv_block,
        stride_kv_slot,
        ws_stride,
        scale,
        inv_divisor,
        H: tl.constexpr,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        FAST: tl.constexpr,
        KV_FP8: tl.constexpr,
        ACT: tl.constexpr,
        FP16_DOTS: tl.constexpr,
    ):
        """A tile of one user's candidates x one head x one key range, on tensor cores.
        ``ACT``: q, k, v are the projection before its SiLU, applied here on load;
        ``FP16_DOTS`` (FP8 pool): the dots in fp16 (CAND_FP8_FP16_DOTS)."""
        # Inductor (AOTI) passes Python floats as fp64 scalars, which made every score
        # product and SiLU an fp64 op (the kernel ran 2.0x slower in the package, H200
        # batch 64): fp32 once here.
        scale = tl.cast(scale, tl.float32)
        inv_divisor = tl.cast(inv_divisor, tl.float32)
        pid = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)
        user = (pid // m_tiles).to(tl.int64)
        tile = pid % m_tiles
        n_keys = tl.load(lens_ptr + user).to(tl.int32)
        # Inductor types a symbolic int as int64, which made the key loop and each key's
        # block // and % 64-bit (the kernel ran 20 % slower in the package): int32 here.
        k_start = split * tl.cast(keys_per_split, tl.int32)
        k_end = tl.minimum(n_keys, k_start + tl.cast(keys_per_split, tl.int32))
        offs_d = tl.arange(0, D)
        cand = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        cmask = cand < num_cands
        q_rows = user * stride_qb + cand * stride_qc + q_col + h * D  # [BM]
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=cmask[:, None], other=0.0)
        if ACT:
            q = input_silu(q).to(q_ptr.dtype.element_ty)
        table_row = tables_ptr + user * max_blocks
        bias_row = kbias_ptr + (user * H + h) * span
        k_scale = dot_k_scale(scale, kv_scale_ptr, h, KV_FP8)
        half_k = (k_scale * 0.5).to(tl.float32)  # (exact: a power-of-two factor)
        qd = q  # [BM, D] the dots' query: codes convert to its dtype
        if FP16_DOTS:
            qd = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        # acc sums silu(s) v; the 1/N comes once at the end, and the bias row holds rab / 2,
        # so FAST takes silu(s) = h + h tanh(h), h = s / 2, as one FFMA, one MUFU, one FFMA
        # per score (two FMULs fewer; the same bits when N is a power of two)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        for start in range(k_start, k_end, BLOCK_N):
            _, k, v = dot_tile_kv(start, k_end, table_row, block_size, h, k_ptr, v_ptr,
                                  stride_kv_block, stride_kv_slot, qd, D, BLOCK_N,
                                  KV_FP8, True)  # fmt: skip
            keys = start + tl.arange(0, BLOCK_N)  # [BN]
            # (the rows are padded to KEY_BIAS_BLOCK keys with zeros: no mask, one
            # vector copy per thread instead of a masked copy per key)
            bias = tl.load(bias_row + keys)  # [BN] fp32 rab / 2
            if IEEE:  # noqa: SIM108 (Triton resolves a constexpr if, not a ternary)
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(qd, tl.trans(k))
            w = silu_of_half((s * half_k).to(tl.float32) + bias[None, :], FAST)  # [BM, BN]
            if IEEE:  # (masked keys: V rows are zero)
                acc += tl.dot(w, v.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(w.to(v.dtype), v)
        if KV_FP8:  # Σ w (code * s) = s Σ w code: the V scale once, before the own key
            acc = acc * tl.load(kv_scale_ptr + H + h)
        if split == 0:  # the candidate's own key: relative position 0, dt 0
            s_rows = user * stride_sb + cand * stride_sc + h * D  # [BM]
            offs = s_rows[:, None] + offs_d[None, :]
            k_own = tl.load(ks_ptr + k_col + offs, mask=cmask[:, None], other=0.0)
            v_own = tl.load(vs_ptr + v_col + offs, mask=cmask[:, None], other=0.0)
            if ACT:  # rounded to the input dtype, as the separate SiLU would store them
                k_own = input_silu(k_own).to(ks_ptr.dtype.element_ty)
                v_own = input_silu(v_own).to(vs_ptr.dtype.element_ty)
            k_own = k_own.to(tl.float32)
            v_own = v_own.to(tl.float32)
            bias0 = tl.load(pos_bias_ptr + h).to(tl.float32) + tl.load(time_bias_ptr + h).to(
                tl.float32
            )
            s_own = (tl.sum(q.to(tl.float32) * k_own, 1) * scale).to(tl.float32) + bias0
            acc += silu_over_n(s_own, 1.0, FAST)[:, None] * v_own
        acc = acc * inv_divisor  # the constant N, once
        out_rows = ((user * num_cands + cand) * H + h) * D  # [BM]
        finish_tile(acc, out_rows[:, None] + offs_d[None, :], cmask[:, None], out_ptr, ws_ptr,
                    ticket_ptr + pid * H + h, split, num_splits, ws_stride)  # fmt: skip

    def launch_key_bias(
        q_pos: torch.Tensor,
        q_ts: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
        pos_bias: torch.Tensor,
        time_bias: torch.Tensor,
        edges: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        """rab of each user's candidates against each of its keys: fp32 [B, H, S]."""
        num_users, max_blocks = block_tables.shape
        block_size = ts_pool.shape[1]
        # rows padded to whole KEY_BIAS_BLOCKs (zeros past each user's keys), so that the
        # candidate kernel's key tiles (<= KEY_BIAS_BLOCK keys) read them without a mask
        span = (max_blocks * block_size + KEY_BIAS_BLOCK - 1) // KEY_BIAS_BLOCK * KEY_BIAS_BLOCK
        bias = torch.empty(num_users, num_heads, span, dtype=torch.float32, device=q_ts.device)
        grid = (num_users, span // KEY_BIAS_BLOCK)
        torch.library.wrap_triton(_key_bias_kernel)[grid](
            q_pos, q_ts, ts_pool, block_tables, cached_lens, pos_bias, time_bias, edges, bias,
            max_blocks, block_size, span, H=num_heads, NUM_POS=pos_bias.shape[0],
            NUM_TIME=time_bias.shape[0], NT_P2=next_pow2(max(2, time_bias.shape[0] - 1)),
            BLOCK=KEY_BIAS_BLOCK, num_warps=4,
        )  # fmt: skip
        return bias

    def launch_candidates(
        q: torch.Tensor,
        k_self: torch.Tensor,
        v_self: torch.Tensor,
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
        block_m: int | None = None,
        block_n: int | None = None,
        num_warps: int | None = None,
        num_stages: int | None = None,
        target_programs: int = CAND_TARGET_PROGRAMS,
        fast: bool = True,
        kv_scale: torch.Tensor | None = None,
        columns: tuple[int, int, int] | None = None,
        activate: bool = False,
        fp16_dots: bool = CAND_FP8_FP16_DOTS,
    ) -> torch.Tensor:
        """Both kernels with an explicit launch shape (the op uses the defaults;
        bench/h200_bench.py sweeps them); an FP8 pool with ``kv_scale [2, H]``, its dots
        in fp16 with ``fp16_dots``.

        q, k_self, v_self [B, C, H, d]; or, with ``columns`` (q, k, v starts), one packed
        projection [B, C, W] passed three times (``activate``: before its SiLU).
        Returns [B, C, H, d] in q's dtype. The launch defaults by the pool's dtype and
        the batch (``default_launch``)."""
        fp8 = kv_scale is not None and q.dtype != torch.float32
        default = default_launch(q.shape[0], fp8, CAND_LAUNCH_BY_BATCH)
        block_m = default[0] if block_m is None else block_m
        block_n = default[1] if block_n is None else block_n
        num_warps = default[2] if num_warps is None else num_warps
        num_stages = default[3] if num_stages is None else num_stages
        num_heads, head_dim = k_cache.shape[-2:]
        if columns is None:
            q, k_self, v_self = (head_rows(t).flatten(-2) for t in (q, k_self, v_self))
            columns = (0, 0, 0)
        num_users, num_cands = q.shape[:2]
        if KEY_BIAS_BLOCK % block_n:  # (the kernel reads the padded bias rows unmasked)
            raise ModelError(f"candidate key tiles of {block_n} do not divide {KEY_BIAS_BLOCK}")
        block_size = ts_pool.shape[1]
        max_blocks = block_tables.shape[1]
        span = max_blocks * block_size
        kbias = launch_key_bias(
            q_pos, q_ts, ts_pool, block_tables, cached_lens, pos_bias, time_bias, edges,
            num_heads,
        )  # fmt: skip
        m_tiles = (num_cands + block_m - 1) // block_m
        tiles = num_users * m_tiles
        splits = num_splits(tiles * num_heads, span, block_n, target_programs)
        per_split = (span + splits - 1) // splits
        per_split = (per_split + block_n - 1) // block_n * block_n
        outputs = num_users * num_cands * num_heads * head_dim
        out = q.new_empty(num_users, num_cands, num_heads, head_dim)
        ws, tickets = split_buffers(splits, outputs, tiles * num_heads, q.device)
        torch.library.wrap_triton(_candidate_kernel)[(tiles, num_heads, splits)](
            q, k_self, v_self, kbias, k_cache, v_cache, block_tables, cached_lens, pos_bias,
            time_bias, cached_lens if kv_scale is None else kv_scale, out, ws, tickets,
            *columns, num_cands, m_tiles, max_blocks, block_size, kbias.shape[-1],
            per_split, q.stride(0), q.stride(1), k_self.stride(0), k_self.stride(1),
            k_cache.stride(0), k_cache.stride(1), outputs, 1.0 / math.sqrt(head_dim),
            1.0 / divisor, H=num_heads, D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
            IEEE=q.dtype == torch.float32, FAST=fast_silu_allowed(fast, q),
            KV_FP8=kv_scale is not None, ACT=activate,
            FP16_DOTS=fp16_dots and kv_scale is not None and q.dtype != torch.float32,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
        return out

    @torch.library.triton_op(OP_CANDIDATES, mutates_args={})
    def paged_silu_attention_candidates(
        qkv: torch.Tensor,
        q_col: int,
        k_col: int,
        v_col: int,
        activate: bool,
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
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """C candidates per user against the cache and themselves; their q, k, v are
        the columns of one projection ``qkv [B, C, W]`` (see ``fused_candidate_attention``)."""
        qkv = packed_rows(qkv)
        return launch_candidates(
            qkv, qkv, qkv, q_pos, q_ts, k_cache, v_cache, ts_pool, block_tables,
            cached_lens, pos_bias, time_bias, edges, divisor, kv_scale=kv_scale,
            columns=(q_col, k_col, v_col), activate=activate,
        )  # fmt: skip


def default_launch(
    num_users: int | torch.SymInt, fp8: bool, by_batch: bool
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of the candidate kernel: FP8 codes under 16-bit
    queries take CAND_FP8_LAUNCH; with ``by_batch``, a concrete batch of at most
    CAND_SMALL_USERS users takes CAND_SMALL_LAUNCH; else CAND_LAUNCH."""
    if fp8:
        return CAND_FP8_LAUNCH
    if by_batch and isinstance(num_users, int) and num_users <= CAND_SMALL_USERS:
        return CAND_SMALL_LAUNCH
    return CAND_LAUNCH


def packed_rows(x: torch.Tensor) -> torch.Tensor:
    """A packed projection [B, C, W] the kernel can address by two row strides: made
    contiguous under tracing (a no-op for the GEMM's output, which is), so the strides
    the kernel was traced with are the ones Inductor allocates (``head_rows``)."""
    if torch.compiler.is_compiling() or is_fake(x) or x.stride(-1) != 1:
        return x.contiguous()
    return x


def fused_candidate_attention(
    q: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
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
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Candidates q, k_self, v_self [B, C, H, d], C per user at one position/timestamp
    per user, against ``kv_layer [2, NB, BS, H, d]`` (FP8 codes with the layer's
    ``kv_scale [2, H]``) and each its own key. The three are packed into one buffer
    first: ``rank`` calls ``fused_projection_candidates`` on its projection instead."""
    check_inputs(q, kv_layer[0], kv_scale)
    width = q.shape[-2] * q.shape[-1]
    qkv = torch.cat([t.flatten(-2) for t in (q, k_self, v_self)], dim=-1)  # [B, C, 3*H*d]
    return fused_projection_candidates(
        qkv, (0, width, 2 * width), False, q_pos, q_ts, kv_layer, ts_pool, block_tables,
        cached_lens, pos_bias, time_bias, edges, divisor, kv_scale,
    )  # fmt: skip


def fused_projection_candidates(
    qkv: torch.Tensor,
    columns: tuple[int, int, int],
    activate: bool,
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
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_candidate_attention`` reading q, k, v [H*d each] straight from the
    columns ``columns`` (q, k, v starts) of a layer's projection ``qkv [B, C, W]``,
    applying the projection's SiLU on load when ``activate``.

    Why: a traced step otherwise makes each of q, k, v contiguous in its own pointwise
    kernel before the op (three launches per layer, 0.53 of 4.39 ms of GPU time per
    worker step on the H200: bench/results/h200_worker_gpu_trace_2000.txt).
    Returns [B, C, H, d]."""
    num_heads, head_dim = kv_layer.shape[-2:]
    width = num_heads * head_dim
    if qkv.dim() != 3 or any(c < 0 or c + width > qkv.shape[-1] for c in columns):
        raise ModelError(
            f"candidate projection qkv {tuple(qkv.shape)} has no [H*d = {width}] columns "
            f"at {columns}"
        )
    heads = qkv.narrow(-1, columns[0], width).unflatten(-1, (num_heads, head_dim))
    check_inputs(heads, kv_layer[0], kv_scale)
    check_pow2_blocks(kv_layer[0])
    q_pos, q_ts, block_tables, cached_lens = dense(q_pos, q_ts, block_tables, cached_lens)
    return torch.ops.streamrec.paged_silu_attention_candidates(
        qkv, *columns, activate, q_pos, q_ts, kv_layer[0], kv_layer[1], ts_pool,
        block_tables, cached_lens, pos_bias, time_bias, edges, divisor, kv_scale,
    )  # fmt: skip
