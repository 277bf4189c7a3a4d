# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""Appending a tile's candidates to per-(user, chunk) regions: the select kernels' epilogue.

Each (user, item chunk) owns a region of ``CAP`` (score, item) entries in a scratch buffer
and a count. A tile's scores above the user's threshold are appended with an atomic on the
count; before a tile (or a run of tiles) could overflow a region, the region keeps its top
``KEEP`` entries (excluded items as -inf) and the user's threshold rises to the ``KEEP``-th
score. The merge (``topk_merge.py``) reads the regions.

Two forms of the append: masked (``store_passing``: Triton's masked atomic and stores,
which issue about a dozen instructions per score whether it passes or not; what the CPU
interpreter runs) and branched (``branched_counts``: PTX that branches around the
atomic and stores, so a score that does not pass costs a compare and a branch; CUDA only).
Almost no score passes (a user keeps ~(k + E) x 16 of 1M items), so the branch is taken
rarely.
"""

from __future__ import annotations

from streamrec.models.triton_lang import tl, triton

if triton is not None:
    from streamrec.models.topk_merge import top_of_region, unpack

    @triton.jit
    def compact_regions(
        thr, rows, slots, num_users, cnt_ptr, sc_ptr, ix_ptr, ex_ptr, stride_ex, num_ex,
        ex_steps, BLOCK_B: tl.constexpr, ROOM: tl.constexpr, CAP: tl.constexpr,
        KEEP: tl.constexpr,
    ):  # fmt: skip
        """Rows whose region might not hold ROOM more entries keep their top KEEP
        entries (excluded items as -inf) and raise their threshold to the KEEP-th score."""
        lane = tl.arange(0, BLOCK_B)
        for r in range(BLOCK_B):
            sel = lane == r
            row = tl.sum(tl.where(sel, rows, 0), axis=0)
            slot = tl.sum(tl.where(sel, slots, 0), axis=0)
            n = tl.load(cnt_ptr + slot, mask=row < num_users, other=0)
            if n > CAP - ROOM:
                base = slot * CAP
                top = top_of_region(
                    sc_ptr, ix_ptr, base, n, ex_ptr + row * stride_ex, num_ex, ex_steps,
                    CAP, KEEP,
                )  # fmt: skip
                ts, ti = unpack(top)
                keep = tl.arange(0, KEEP)
                tl.store(sc_ptr + base + keep, ts)
                tl.store(ix_ptr + base + keep, ti)
                tl.store(cnt_ptr + slot, KEEP)
                kth, _ = unpack(tl.min(top, axis=0))
                thr = tl.where(sel, tl.maximum(thr, kth), thr)
        return thr

    @triton.jit
    def store_passing(
        acc, cols, thr, cnt, slots, cnt_ptr, sc_ptr, ix_ptr, BLOCK_B: tl.constexpr,
        BLOCK_V: tl.constexpr, CAP: tl.constexpr,
    ):  # fmt: skip
        """Append a tile's scores above threshold to the rows' regions (the caller has
        made room for the tile, so slot < CAP). Returns the new counts."""
        take = acc > thr[:, None]  # [BB, BV]
        cnt_ptrs = tl.broadcast_to(cnt_ptr + slots[:, None], [BLOCK_B, BLOCK_V])
        ones = tl.full([BLOCK_B, BLOCK_V], 1, tl.int32)
        slot = tl.atomic_add(cnt_ptrs, ones, mask=take, sem="relaxed", scope="cta")
        dest = slots[:, None] * CAP + slot
        tl.store(sc_ptr + dest, acc, mask=take)
        tl.store(ix_ptr + dest, tl.broadcast_to(cols[None, :], [BLOCK_B, BLOCK_V]), mask=take)
        return cnt + tl.sum(take.to(tl.int32), axis=1)

    @triton.jit
    def program_regions(thr_ptr, num_users, num_chunks, BLOCK_B: tl.constexpr):
        """A select program's users ``program_id(0)`` and chunk ``program_id(1)``: (rows,
        chunk, row_ok, thresholds, region slots), each [BB] but chunk."""
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        chunk = tl.program_id(1)
        row_ok = rows < num_users
        thr = tl.load(thr_ptr + rows, mask=row_ok, other=float("inf"))
        slots = rows * num_chunks + chunk  # (user, chunk); int32 offsets (host check)
        return rows, chunk, row_ok, thr, slots

    @triton.jit
    def make_room(
        thr, cnt, rows, slots, num_users, cnt_ptr, sc_ptr, ix_ptr, ex_ptr, stride_ex, num_ex,
        ex_steps, BLOCK_B: tl.constexpr, ROOM: tl.constexpr, CAP: tl.constexpr,
        KEEP: tl.constexpr,
    ):  # fmt: skip
        """Compact the rows whose region might not hold ROOM more entries (the CTA's
        appends made visible first). Returns the new (thr, cnt)."""
        if tl.max(cnt, axis=0) > CAP - ROOM:
            tl.debug_barrier()
            thr = compact_regions(
                thr, rows, slots, num_users, cnt_ptr, sc_ptr, ix_ptr, ex_ptr, stride_ex,
                num_ex, ex_steps, BLOCK_B, ROOM, CAP, KEEP,
            )  # fmt: skip
            tl.debug_barrier()
            cnt = tl.load(cnt_ptr + slots, mask=rows < num_users, other=0)
        return thr, cnt

    @triton.jit
    def append_masked(
        acc, cols, thr, cnt, rows, slots, num_users, cnt_ptr, sc_ptr, ix_ptr, ex_ptr,
        stride_ex, num_ex, ex_steps, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
        CAP: tl.constexpr, KEEP: tl.constexpr,
    ):  # fmt: skip
        """Append a tile's scores above threshold; compact the rows that might not hold
        another tile. Returns the new (thr, cnt)."""
        cnt = store_passing(acc, cols, thr, cnt, slots, cnt_ptr, sc_ptr, ix_ptr, BLOCK_B,
                             BLOCK_V, CAP)  # fmt: skip
        return make_room(
            thr, cnt, rows, slots, num_users, cnt_ptr, sc_ptr, ix_ptr, ex_ptr, stride_ex,
            num_ex, ex_steps, BLOCK_B, BLOCK_V, CAP, KEEP,
        )  # fmt: skip

    # One score's append, in PTX: $0 = its region's count after the append (0: the score
    # did not pass), $1 score, $2 threshold, $3 the region's count, $4 / $5 the region's
    # score / item rows, $6 the item. The branch is what the masked form cannot say.
    APPEND_PTX = tl.constexpr(
        """
    {
    .reg .pred p;
    .reg .b32 old;
    .reg .b64 off, at;
    mov.b32 $0, 0;
    setp.gt.f32 p, $1, $2;
    @!p bra skip${:uid};
    atom.relaxed.cta.global.add.u32 old, [$3], 1;
    add.u32 $0, old, 1;
    mul.wide.u32 off, old, 4;
    add.u64 at, $4, off;
    st.global.f32 [at], $1;
    add.u64 at, $5, off;
    st.global.b32 [at], $6;
    skip${:uid}:
    }
    """
    )

    @triton.jit
    def branched_counts(acc, cols, thr, slots, cnt_ptr, sc_ptr, ix_ptr, CAP: tl.constexpr):
        """Append a tile's scores above threshold, one branch per score (the caller has
        made room for the tile). Returns, per score, its region's count after its append
        (0: not appended), [BB, BV]: a row's maximum is its new count."""
        return tl.inline_asm_elementwise(
            asm=APPEND_PTX,
            constraints="=r,f,f,l,l,l,r",
            args=[
                acc,  # [BB, BV]
                thr[:, None],
                (cnt_ptr + slots).to(tl.int64)[:, None],
                (sc_ptr + slots * CAP).to(tl.int64)[:, None],
                (ix_ptr + slots * CAP).to(tl.int64)[:, None],
                cols[None, :],
            ],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit
    def append_branched(
        acc, cols, thr, rows, slots, num_users, cnt_ptr, sc_ptr, ix_ptr, ex_ptr, stride_ex,
        num_ex, ex_steps, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, CAP: tl.constexpr,
        KEEP: tl.constexpr,
    ):  # fmt: skip
        """``append_masked`` with a branch per score: the counts come back from the atomics, so
        none is summed per tile; rows the next tile could overflow are compacted. Returns
        the new thresholds."""
        counts = branched_counts(acc, cols, thr, slots, cnt_ptr, sc_ptr, ix_ptr, CAP)
        thr, _ = make_room(
            thr, tl.max(counts, axis=1), rows, slots, num_users, cnt_ptr, sc_ptr, ix_ptr,
            ex_ptr, stride_ex, num_ex, ex_steps, BLOCK_B, BLOCK_V, CAP, KEEP,
        )  # fmt: skip
        return thr
