# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""Retrieval top-k with the scores written once: cuBLAS ``mm`` per item chunk, then one
read of them that keeps only candidates (issue 14 item 4, issue 19's verify).

Why not keep the scores in registers (``retrieval.py``'s fused select)? That kernel is a
GEMM with a top-k epilogue written in Triton; on the H200 it ran at ~175 TFLOP/s
whatever the tile shape (1.55 ms for 256 users over 1M x 512, 1.89 ms for 320 rows),
while cuBLAS runs the same GEMM at ~4x that rate. Writing the scores once costs
``2 * B * V`` bytes (bf16) and reading them once as much again: 1 GB at batch 256, about
a quarter of a millisecond at the H200's copy rate, which is less than what the fused
kernel loses. ``torch.topk`` is what made ``mm`` + ``topk`` slow (several passes of a
radix select over the scores); the scan below reads each score once.

1. **Scores**, per chunk of ``chunk_items`` items: ``user_emb @ table[chunk].T`` in the
   input dtype (fp32 accumulation rounded once, as the op returns them). A chunk bounds
   the scratch at ``B * chunk_items`` scores whatever the catalog.
2. **Threshold** from the first chunk: the ``(k + E)``-th largest of the maxima of its
   groups of 16 items. Those maxima are ``k + E`` distinct items, at most ``E`` of them
   excluded, so every top-k item scores at least that much (``topk_merge
   .sample_threshold``); about ``(k + E) * V / chunk_items`` items pass it.
3. **Scan**: one program per (user, segment of the chunk) appends every score above its
   threshold to its region; a region that might not hold another block keeps its top
   ``KEEP`` and raises its threshold to the ``KEEP``-th score. Regions persist across the
   chunks and are walked in item order, so ties at a raised threshold rank below what
   was kept (the key breaks ties by lower index).
4. **Merge** (``topk_merge``): each user's top k of its regions, exclusions as ``-inf``.

The order is the op's: score descending, then item index ascending, over the scores
``mm`` returns; exact for every input, with fixed shapes and no host synchronisation
(CUDA graphs, AOTInductor).
"""

from __future__ import annotations

import torch

from streamrec.errors import ModelError
from streamrec.models.topk_merge import (
    DEFAULT_SMS,
    EXCLUDE_STEPS,
    MERGE_WINDOW,
    cdiv,
    next_pow2,
    sample_threshold,
    sorted_exclusions,
)
from streamrec.models.triton_lang import tl, triton

CHUNK_ITEMS = 1 << 18  # items scored per mm: 128 MB of bf16 scores at batch 256
SCAN_BLOCK = 1024  # scores read per step of a scan program (2 KB of bf16)
SCAN_WARPS = 4
COMPACT_WINDOW = 512  # region entries sorted at a time when a region is compacted
THRESHOLD_GROUP = 16  # items per maximum of the first chunk
ALIGN = 16  # columns per chunk are a multiple of this (aligned score rows)
PROGRAMS_PER_SM = 4
SYMBOLIC_SEGMENTS = 16  # segments per user when the batch is symbolic (export)


def scan_segments(
    batch: int | torch.SymInt, cols: int, block: int, programs: int
) -> tuple[int, int]:
    """(segments per user, columns per segment) of one chunk's scan: about ``programs``
    programs in all, each a whole number of blocks. A symbolic batch gets a fixed count:
    sizes stay plain expressions of B and only speed depends on it."""
    if isinstance(batch, int):
        segments = max(1, min(cdiv(programs, max(batch, 1)), cdiv(cols, block)))
    else:
        segments = max(1, min(SYMBOLIC_SEGMENTS, cdiv(cols, block)))
    seg_cols = cdiv(cdiv(cols, segments), block) * block
    return cdiv(cols, seg_cols), seg_cols


def chunk_threshold(scores: torch.Tensor, need: int | torch.SymInt) -> torch.Tensor:
    """fp32 [B] threshold from the first chunk's scores [B, C] (step 2 of the module
    docstring); scores strictly above it include every top-k item."""
    groups = scores.shape[1] // THRESHOLD_GROUP
    head = scores[:, : groups * THRESHOLD_GROUP]
    maxima = head.reshape(scores.shape[0], groups, THRESHOLD_GROUP).amax(dim=2).float()
    return sample_threshold(maxima, need, maxima.new_zeros(scores.shape[0]))


if triton is not None:
    from streamrec.models.topk_merge import best_of_region, launch_merge, unpack

    @triton.jit
    def _scan_kernel(
        s_ptr, thr_ptr, cnt_ptr, sc_ptr, ix_ptr, ex_ptr, num_cols, col0, seg_cols,
        num_segs, stride_ex, num_ex, ex_steps,
        BLOCK: tl.constexpr, CAP: tl.constexpr, KEEP: tl.constexpr, WIN: tl.constexpr,
    ):  # fmt: skip
        """Candidates of user ``program_id(0)`` in segment ``program_id(1)`` of a chunk's
        scores [B, num_cols] (item rows ``col0 + column``).

        A memory stream: the next two blocks' loads are issued before this block is looked at,
        and the rare compaction sorts WIN keys at a time, so that the registers allow
        several programs per SM and enough bytes are in flight."""
        b = tl.program_id(0)
        slot = b * num_segs + tl.program_id(1)
        thr = tl.load(thr_ptr + slot)  # this region's threshold, raised by compaction
        cnt = tl.load(cnt_ptr + slot)
        row = s_ptr + b.to(tl.int64) * num_cols
        base = slot.to(tl.int64) * CAP
        ex_row = ex_ptr + b * stride_ex
        start = tl.program_id(1) * seg_cols
        stop = tl.minimum(start + seg_cols, num_cols)
        lanes = tl.arange(0, BLOCK)
        # Two blocks in flight ahead of the one looked at (a0 next, a1 after it).
        a0 = tl.load(row + start + lanes, mask=start + lanes < stop, other=float("-inf"))
        a1 = tl.load(
            row + start + BLOCK + lanes, mask=start + BLOCK + lanes < stop, other=float("-inf")
        )
        for c0 in range(start, stop, BLOCK):
            offs = c0 + lanes
            s = a0.to(tl.float32)  # [BLOCK]
            a0 = a1
            a1 = tl.load(row + offs + 2 * BLOCK, mask=offs + 2 * BLOCK < stop, other=float("-inf"))
            take = s > thr  # NaN never passes
            n = tl.sum(take.to(tl.int32), axis=0)
            if n > 0:
                dest = cnt + tl.cumsum(take.to(tl.int32), axis=0) - 1
                tl.store(sc_ptr + base + dest, s, mask=take)
                tl.store(ix_ptr + base + dest, offs + col0, mask=take)
                cnt += n
                if cnt > CAP - BLOCK:  # the region might not hold another block
                    tl.debug_barrier()
                    top = best_of_region(
                        sc_ptr, ix_ptr, base, cnt, ex_row, num_ex, ex_steps, WIN, KEEP
                    )  # [KEEP] keys
                    tl.debug_barrier()
                    ts, ti = unpack(top)
                    keep = tl.arange(0, KEEP)
                    tl.store(sc_ptr + base + keep, ts)
                    tl.store(ix_ptr + base + keep, ti)
                    tl.debug_barrier()
                    cnt = cnt * 0 + KEEP
                    kth, _ = unpack(tl.min(top, axis=0))
                    thr = tl.maximum(thr, kth)
        tl.store(cnt_ptr + slot, cnt)
        tl.store(thr_ptr + slot, thr)

    def launch_score_scan(
        user_emb: torch.Tensor,
        table: torch.Tensor,
        exclude: torch.Tensor,
        k: int,
        first_row: int,
        chunk_items: int = CHUNK_ITEMS,
        programs: int | None = None,
        block: int = SCAN_BLOCK,
        merge_window: int = MERGE_WINDOW,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top k of rows >= first_row: fp32 scores [B, k] (values of ``mm`` in the input
        dtype), rows [B, k] int64, and the candidates kept per (user, segment) [B, S]
        int32. ``chunk_items``, ``programs`` and ``block`` are the bench's and the tests'
        knobs; the op uses the defaults."""
        num_users = user_emb.shape[0]
        num_items = table.shape[0]
        num_ex = exclude.shape[1]
        if block < 16 or block & (block - 1):
            raise ModelError(f"scan block={block} must be a power of two >= 16")
        if chunk_items < block:
            raise ModelError(f"chunk_items={chunk_items} must be >= the scan block {block}")
        keep = max(2, next_pow2(k))  # tl.topk and the merge need at least 2 lanes
        win = max(COMPACT_WINDOW, keep)
        cap = keep + block  # room for one more block after a compaction
        dev = user_emb.device
        u = user_emb.contiguous()
        ex = sorted_exclusions(exclude, num_items)
        ex_steps = num_ex.bit_length() if isinstance(num_ex, int) else EXCLUDE_STEPS
        cols = min(chunk_items, num_items - first_row)
        if programs is None:
            sms = DEFAULT_SMS
            if dev.type == "cuda":
                sms = torch.cuda.get_device_properties(dev).multi_processor_count
            programs = PROGRAMS_PER_SM * sms
        segments, seg_cols = scan_segments(num_users, cols, block, programs)
        if isinstance(num_users, int) and num_users * segments * cap >= 2**31:
            raise ModelError(f"batch {num_users} too large for one call (int32 offsets)")
        counts = torch.zeros(num_users, segments, device=dev, dtype=torch.int32)
        sc = torch.empty(num_users * segments * cap, device=dev, dtype=torch.float32)
        ix = torch.empty(num_users * segments * cap, device=dev, dtype=torch.int32)
        thr = None
        for lo in range(first_row, num_items, chunk_items):
            hi = min(lo + chunk_items, num_items)
            # A chunk of a multiple of 16 columns keeps every score row 16-byte aligned, so
            # the scan's loads stay vectorised: a short last chunk starts up to 15 rows
            # early, and those rows (already scanned, or blocked) score -inf here.
            skip = -(hi - lo) % ALIGN if lo >= -(hi - lo) % ALIGN else 0
            scores = torch.mm(u, table[lo - skip : hi].t())  # [B, hi - lo + skip]
            if skip:
                scores[:, :skip] = float("-inf")
            if thr is None:  # [B, S]: one threshold per region, raised as it compacts
                thr = chunk_threshold(scores, k + num_ex)[:, None].repeat(1, segments)
            torch.library.wrap_triton(_scan_kernel)[(num_users, segments)](
                scores, thr, counts, sc, ix, ex, hi - lo + skip, lo - skip, seg_cols,
                segments, ex.stride(0), num_ex, ex_steps, BLOCK=block, CAP=cap, KEEP=keep,
                WIN=win, num_warps=SCAN_WARPS,
            )  # fmt: skip
        out_s, rows = launch_merge(sc, ix, counts, ex, ex_steps, k, cap, keep, merge_window)
        return out_s, rows, counts
