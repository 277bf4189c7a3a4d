# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""What the two top-k retrievals share: the 64-bit ranking key, the candidate threshold
and the merge of per-region candidates into each user's top k.

Both retrievals (``retrieval.py``: scores in registers; ``score_scan.py``: scores written
once by ``mm``) reduce a user's catalog to a few thousand candidates kept in regions of a
scratch buffer, then merge them here. The key orders by fp32 score (order-preserving
bits) descending, then item index ascending: a total order, so every implementation
returns the same items for the same scores, ties included.
"""

from __future__ import annotations

import torch

from streamrec.models.triton_lang import tl, triton

MERGE_WINDOW = 2048
MERGE_WARPS = 8
SENTINEL = -(2**63) + 1  # below every packed key
EXCLUDE_STEPS = 20  # binary-search steps when E is symbolic (export): E < 2**20
DEFAULT_SMS = 132  # H200, when the device cannot be asked


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cdiv(a, b):  # ints or SymInts (export)
    return (a + b - 1) // b


def pack_keys(scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as (score descending, index ascending); the kernels' order."""
    bits = scores.float().view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.long() << 32) | (0xFFFFFFFF - idx.long())


def unpack_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ordered = (keys >> 32).int()
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    return bits.view(torch.float32), 0xFFFFFFFF - (keys & 0xFFFFFFFF)


def sample_threshold(
    group_max: torch.Tensor, need: int | torch.SymInt, margin: torch.Tensor
) -> torch.Tensor:
    """Per-user threshold from sampled maxima [B, G]: strictly below the ``need``-th
    largest minus ``margin`` [B], so that ``score > threshold`` keeps every score
    ``>= L - margin``; ``-inf`` when fewer than ``need`` maxima exist.

    Why it is safe: the maxima are scores of ``need`` distinct items, so with ``E``
    exclusions and ``need = k + E`` at least ``k`` retrievable items score ``>= L``."""
    pad = group_max.new_full((group_max.shape[0], need), float("-inf"))
    lower = torch.topk(torch.cat([group_max, pad], dim=1), need, dim=1).values[:, -1]  # [B]
    return torch.nextafter(lower - margin, torch.full_like(lower, float("-inf")))


def sorted_exclusions(exclude: torch.Tensor, num_items: int) -> torch.Tensor:
    """[B, E] int32 sorted rows for the kernels' binary search (ids past the table act
    on its last row, as in ``mm`` + ``topk``)."""
    return exclude.clamp(max=num_items - 1).to(torch.int32).sort(dim=1).values.contiguous()


if triton is not None:
    _SENT = tl.constexpr(SENTINEL)

    @triton.jit
    def pack(score, idx):
        bits = score.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return (ordered.to(tl.int64) << 32) | (4294967295 - idx.to(tl.int64))

    @triton.jit
    def unpack(key):
        ordered = (key >> 32).to(tl.int32)
        bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
        return bits.to(tl.float32, bitcast=True), (4294967295 - (key & 4294967295)).to(tl.int32)

    @triton.jit
    def count_le(row_ptr, n, x, steps):
        """How many of the n sorted int32 values at ``row_ptr`` are <= x (elementwise)."""
        pos = (x * 0).to(tl.int32)
        for t in range(steps):
            cand = pos + (1 << (steps - 1 - t))
            ok = cand <= n
            v = tl.load(row_ptr + cand - 1, mask=ok, other=0)
            pos = tl.where(ok & (v <= x), cand, pos)
        return pos

    @triton.jit
    def excluded(idx, ex_row, num_ex, steps):
        pos = count_le(ex_row, num_ex, idx, steps)
        hit = tl.load(ex_row + pos - 1, mask=pos > 0, other=-1)
        return (pos > 0) & (hit == idx)

    @triton.jit
    def top_of_region(sc_ptr, ix_ptr, base, n, ex_row, num_ex, ex_steps,
                      CAP: tl.constexpr, KEEP: tl.constexpr):  # fmt: skip
        """Keys [KEEP] of the best KEEP of a region's n entries, excluded items as -inf
        (a region that fills up is compacted to these; ``SENTINEL`` pads)."""
        offs = tl.arange(0, CAP)
        s = tl.load(sc_ptr + base + offs, mask=offs < n, other=float("-inf"))
        i = tl.load(ix_ptr + base + offs, mask=offs < n, other=0)
        s = tl.where(excluded(i, ex_row, num_ex, ex_steps), float("-inf"), s)
        return tl.topk(tl.where(offs < n, pack(s, i), _SENT), KEEP)

    @triton.jit
    def best_of_region(sc_ptr, ix_ptr, base, n, ex_row, num_ex, ex_steps,
                       WIN: tl.constexpr, KEEP: tl.constexpr):  # fmt: skip
        """``top_of_region`` in windows of WIN entries (WIN >= KEEP): the registers of a
        WIN-key sort instead of a region-sized one, for a kernel whose hot loop is a
        memory stream that wants many programs per SM."""
        offs = tl.arange(0, WIN)
        best = tl.full([KEEP], _SENT, tl.int64)
        for w0 in range(0, n, WIN):
            j = w0 + offs
            s = tl.load(sc_ptr + base + j, mask=j < n, other=float("-inf"))
            i = tl.load(ix_ptr + base + j, mask=j < n, other=0)
            s = tl.where(excluded(i, ex_row, num_ex, ex_steps), float("-inf"), s)
            top = tl.topk(tl.where(j < n, pack(s, i), _SENT), KEEP)
            best = tl.topk(tl.reshape(tl.join(best, top), [2 * KEEP]), KEEP)
        return best

    @triton.jit
    def _merge_kernel(
        sc_ptr, ix_ptr, cnt_ptr, pre_ptr, ex_ptr, out_s_ptr, out_i_ptr, num_chunks,
        chunk_steps, stride_ex, num_ex, ex_steps, k,
        CAP: tl.constexpr, KEEP: tl.constexpr, WIN: tl.constexpr,
    ):  # fmt: skip
        """Top k of user ``program_id(0)``'s candidates, excluded items as -inf."""
        b = tl.program_id(0)
        pre_row = pre_ptr + b * num_chunks  # exclusive prefix of the region counts
        ex_row = ex_ptr + b * stride_ex
        last = b * num_chunks + num_chunks - 1
        total = tl.load(pre_ptr + last) + tl.load(cnt_ptr + last)
        offs = tl.arange(0, WIN)
        best = tl.full([KEEP], _SENT, tl.int64)
        for w0 in range(0, total, WIN):
            j = w0 + offs  # candidate number within the user's regions
            valid = j < total
            c = tl.maximum(count_le(pre_row, num_chunks, j, chunk_steps) - 1, 0)
            src = (b * num_chunks + c) * CAP + (j - tl.load(pre_row + c))
            s = tl.load(sc_ptr + src, mask=valid, other=float("-inf"))
            i = tl.load(ix_ptr + src, mask=valid, other=0)
            s = tl.where(excluded(i, ex_row, num_ex, ex_steps), float("-inf"), s)
            top = tl.topk(tl.where(valid, pack(s, i), _SENT), KEEP)
            best = tl.topk(tl.reshape(tl.join(best, top), [2 * KEEP]), KEEP)
        score, idx = unpack(best)
        o = tl.arange(0, KEEP)
        tl.store(out_s_ptr + b * k + o, score, mask=o < k)
        tl.store(out_i_ptr + b * k + o, idx.to(tl.int64), mask=o < k)

    def launch_merge(
        sc: torch.Tensor,
        ix: torch.Tensor,
        counts: torch.Tensor,
        ex: torch.Tensor,
        ex_steps: int,
        k: int,
        cap: int,
        keep: int,
        merge_window: int = MERGE_WINDOW,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top k of the regions: sc/ix [B * R * cap] (region r of user b at (b*R + r)*cap),
        counts [B, R] int32 entries per region, ex the sorted exclusions. Returns fp32
        scores [B, k] and rows [B, k] int64."""
        num_users, regions = counts.shape
        pre = (torch.cumsum(counts, dim=1, dtype=torch.int32) - counts).contiguous()
        region_steps = int(regions).bit_length()  # callers plan an int count of regions
        scores = torch.empty(num_users, k, device=sc.device, dtype=torch.float32)
        rows = torch.empty(num_users, k, device=sc.device, dtype=torch.int64)
        torch.library.wrap_triton(_merge_kernel)[(num_users,)](
            sc, ix, counts, pre, ex, scores, rows, regions, region_steps, ex.stride(0),
            ex.shape[1], ex_steps, k, CAP=cap, KEEP=keep, WIN=max(merge_window, keep),
            num_warps=MERGE_WARPS,
        )  # fmt: skip
        return scores, rows
