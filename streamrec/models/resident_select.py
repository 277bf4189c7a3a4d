# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""The retrieval select kernel with the users' tile resident in shared memory.

The tile select kernel (``retrieval._select_kernel``) loads a ``[BLOCK_B, BLOCK_K]`` slice
of its users beside every ``[BLOCK_V, BLOCK_K]`` slice of items: per item tile it moves
as many user bytes as item bytes, and its K loop (8 steps at D = 512) drains Triton's
software pipeline at every tile. Here a program loads its ``[BLOCK_B, D]`` users once
(128 KB at 128 x 512 bf16, kept in shared memory: Triton hoists the loop-invariant
operand's copy out of the loop) and walks its item chunk one ``[BLOCK_V, D]`` tile per
iteration, a single ``tl.dot`` over all of D, so that the pipeline streams item tiles
only and never drains inside a run of ``SEG`` tiles (the region check between two runs
syncs the CTA, which Triton's pipeliner does not cross). At 128 x 512 users and 32-item
tiles in three stages that is 224 of the 227 KB a Hopper CTA may hold: one program per
SM, item bytes per tile a quarter of the tile kernel's, 64 registers.

Same contract as the tile kernel (``retrieval.py``'s docstring): every item of the
chunk scored in fp32, every score above the user's threshold appended to the user's
region (``region_append.py``), regions compacted before a run could overflow them.
"""

from __future__ import annotations

from streamrec.errors import ModelError
from streamrec.models.topk_merge import next_pow2
from streamrec.models.triton_lang import tl, triton

# Items a program scores between two checks of its regions (the regions hold that many
# past KEEP, so that no check is needed inside a run).
SEG_ITEMS = 256
SHARED_BYTES = 227 * 1024  # what one Hopper CTA may hold


def resident_plan(keep: int, block_v: int) -> tuple[int, int]:
    """(tiles per run between two region checks, region capacity CAP) for ``keep``."""
    cap = next_pow2(keep + max(SEG_ITEMS, block_v))
    return max(1, (cap - keep) // block_v), cap


def shared_bytes(block_b: int, block_v: int, stages: int, dim: int, itemsize: int) -> int:
    """Shared memory of the users' tile and ``stages`` item tiles."""
    return (block_b + stages * block_v) * dim * itemsize


def check_resident_fits(block_b: int, block_v: int, stages: int, dim: int, itemsize: int) -> None:
    """The users' tile and ``stages`` item tiles must fit one CTA's shared memory, and D
    must be a power of two (one ``tl.arange`` over it)."""
    if dim & (dim - 1):
        raise ModelError(f"the resident select needs a power-of-two dim, got {dim}")
    need = shared_bytes(block_b, block_v, stages, dim, itemsize)
    if need > SHARED_BYTES:
        raise ModelError(
            f"resident select: {block_b} users + {stages} x {block_v} items of {dim} x "
            f"{itemsize} B need {need} B of shared memory, more than {SHARED_BYTES}"
        )


if triton is not None:
    from streamrec.models.region_append import (
        branched_counts,
        make_room,
        program_regions,
        store_passing,
    )

    @triton.jit
    def _users(u_ptr, rows, row_ok, stride_u, D: tl.constexpr, IEEE: tl.constexpr):
        """The users' tile [BB, D] (the dot's loop-invariant operand: Triton copies it into
        shared memory once, outside the item loop)."""
        u_at = u_ptr + rows.to(tl.int64)[:, None] * stride_u + tl.arange(0, D)[None, :]
        u = tl.load(u_at, mask=row_ok[:, None], other=0.0)
        if IEEE:  # (fp32 inputs, or the CPU interpreter, whose bf16 dot is wrong)
            u = u.to(tl.float32)
        return u

    @triton.jit
    def _item_scores(u, t_ptr, cols, num_items, stride_t, D: tl.constexpr, IEEE: tl.constexpr):
        """fp32 scores [BB, BV] of the resident users ``u`` [BB, D] x items ``cols``, one
        dot over all of D; -inf past V."""
        col_ok = cols < num_items
        t_at = t_ptr + cols.to(tl.int64)[:, None] * stride_t + tl.arange(0, D)[None, :]
        t = tl.load(t_at, mask=col_ok[:, None], other=0.0)  # [BV, D]
        if IEEE:
            acc = tl.dot(u, tl.trans(t.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(u, tl.trans(t))
        return tl.where(col_ok[None, :], acc, float("-inf"))

    @triton.jit
    def resident_select_kernel(
        u_ptr, t_ptr, thr_ptr, ex_ptr, cnt_ptr, sc_ptr, ix_ptr, num_users, num_items, first,
        num_chunks, chunk_tiles, stride_u, stride_t, stride_ex, num_ex, ex_steps,
        D: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, IEEE: tl.constexpr,
        CAP: tl.constexpr, KEEP: tl.constexpr, SEG: tl.constexpr, BRANCH: tl.constexpr,
    ):  # fmt: skip
        """Candidates of users ``program_id(0)`` in item chunk ``program_id(1)``."""
        rows, chunk, row_ok, thr, slots = program_regions(thr_ptr, num_users, num_chunks, BLOCK_B)
        u = _users(u_ptr, rows, row_ok, stride_u, D, IEEE)  # [BB, D], loaded once
        cnt = tl.zeros([BLOCK_B], dtype=tl.int32)  # a row's count (at least) since its last check
        start = first + chunk * chunk_tiles * BLOCK_V
        stop = tl.minimum(start + chunk_tiles * BLOCK_V, num_items)
        for run in range(start, stop, SEG * BLOCK_V):
            thr, cnt = make_room(
                thr, cnt, rows, slots, num_users, cnt_ptr, sc_ptr, ix_ptr, ex_ptr, stride_ex,
                num_ex, ex_steps, BLOCK_B, SEG * BLOCK_V, CAP, KEEP,
            )  # fmt: skip
            for v0 in range(run, tl.minimum(run + SEG * BLOCK_V, stop), BLOCK_V):
                cols = v0 + tl.arange(0, BLOCK_V)
                acc = _item_scores(u, t_ptr, cols, num_items, stride_t, D, IEEE)  # [BB, BV]
                if BRANCH:
                    counts = branched_counts(acc, cols, thr, slots, cnt_ptr, sc_ptr, ix_ptr, CAP)
                    cnt = tl.maximum(cnt, tl.max(counts, axis=1))
                else:  # (the interpreter's: it runs no PTX)
                    cnt = store_passing(acc, cols, thr, cnt, slots, cnt_ptr, sc_ptr, ix_ptr,
                                        BLOCK_B, BLOCK_V, CAP)  # fmt: skip

    @triton.jit
    def resident_sample_kernel(
        u_ptr, t_ptr, gmax_ptr, num_users, num_items, first, num_groups, num_sampled,
        sampled_per_chunk, stride_u, stride_t,
        D: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, IEEE: tl.constexpr,
        GROUP: tl.constexpr, EVERY: tl.constexpr,
    ):  # fmt: skip
        """The threshold pass with the users' tile resident: maxima of groups of GROUP
        items over every EVERY-th tile of BLOCK_V items, sampled tiles ``program_id(1)``
        x ``sampled_per_chunk`` on (any sample of whole groups bounds the threshold)."""
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        row_ok = rows < num_users
        u = _users(u_ptr, rows, row_ok, stride_u, D, IEEE)  # [BB, D], loaded once
        lo = tl.program_id(1) * sampled_per_chunk
        hi = tl.minimum(lo + sampled_per_chunk, num_sampled)
        gmax_rows = gmax_ptr + rows.to(tl.int64)[:, None] * num_groups  # [BB, 1]
        for tile in range(lo, hi):
            cols = first + tile * (BLOCK_V * EVERY) + tl.arange(0, BLOCK_V)
            acc = _item_scores(u, t_ptr, cols, num_items, stride_t, D, IEEE)  # [BB, BV]
            gmax = tl.max(tl.reshape(acc, [BLOCK_B, BLOCK_V // GROUP, GROUP]), axis=2)
            groups = tile * (BLOCK_V // GROUP) + tl.arange(0, BLOCK_V // GROUP)
            tl.store(gmax_rows + groups[None, :], gmax, mask=row_ok[:, None])
