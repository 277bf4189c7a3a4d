# mypy: disable-error-code="no-untyped-def"
# (Triton reads the annotations of @jit kernels, so their parameters stay unannotated.)
"""Retrieval top-k over the item table: the op, and the fused kernels it used to run.

The op ``streamrec::retrieve_topk`` (``fused_retrieve``) serves ``HSTU.retrieve`` and the
retrievable set on CUDA with Triton. It runs this module's kernels — a Triton GEMM with a
top-k epilogue, scores never written. ``score_scan.py`` (cuBLAS writes the scores once per
item chunk, one scan keeps the candidates) was built to beat them and lost on the GPU
(2026-12-06, H100, 1M items, D 512: 4,165 against 1,531 µs at batch 256, 952 against 646
at batch 64, even at batch 1 and the verify's 320 rows at k 1); it stays as the side by
side in ``bench/retrieval_bench.py``. The algorithm here:

1. **Threshold.** A sample — every ``sample_every(k)``-th tile of ``BLOCK_V`` items — is
   scored and the maximum of each group of ``SAMPLE_GROUP`` items kept. The
   ``(k + E)``-th largest of those maxima, ``L_b``, bounds the k-th best non-excluded
   score from below: ``k + E`` distinct items score at least ``L_b`` and at most ``E`` of
   them are excluded. (Expected candidates per user: ~``(k + E) * sample_every(k)``,
   whatever the group size: only the sampled fraction sets it.)
2. **Select.** A program scores a tile of users against a chunk of items (``tl.dot``,
   fp32 accumulation) and appends every (score, item) above the user's threshold to its
   own region of a scratch buffer. A region that fills up keeps its top ``KEEP`` entries
   (``tl.topk``) and raises that user's threshold to the ``KEEP``-th score: the chunk is
   walked in item order, so a later item with an equal score ranks below all of them.
   (The append and the compaction are ``region_append.py``'s; ``resident_select.py`` is
   the same select with the users' tile kept in shared memory, ``LaunchConfig.resident``:
   exact, measured slower, opt-in.)
3. **Merge** (``topk_merge.py``). One program per user walks its candidates in windows,
   turns excluded items into ``-inf`` and keeps the top k.

Both are exact — the same set as ``torch.topk`` over the masked scores — for every input,
with fixed shapes and no host synchronisation, so the op is captured in CUDA graphs and
exported into AOTInductor (``triton_op`` + ``wrap_triton``). Ranking uses a 64-bit key
(``topk_merge.pack_keys``): score descending, then item index ascending. ``torch.topk``
breaks ties in no documented way; at the k-th place the two may pick different items of
equal score. The fused kernels rank fp32 accumulations and return them rounded once to the
input dtype; the scan ranks what ``mm`` returns (the same rounding). NaN scores
(non-finite user embeddings) never qualify. In the fused kernels the scores of the
threshold pass and of the select pass come from the same tile code; a margin of ``D *
2**-23 * |u|`` (unit-norm item rows) covers any difference in rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from streamrec.errors import ModelError
from streamrec.models.resident_select import (
    SHARED_BYTES,
    check_resident_fits,
    resident_plan,
    shared_bytes,
)
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

OP_RETRIEVE = "streamrec::retrieve_topk"
SAMPLE_EVERY = 16  # at most 1 tile in 16 is scored for the threshold (``sample_every``)
# Candidates per user the sample aims at: each costs the select an append and the merge a
# read; a denser sample costs a larger share of the GEMM. On the H100 (1M items, D 512,
# 2026-12-06) k = 256 ran fastest at 1 tile in 4 (~1,100 candidates: 1.31x against 1 in
# 16 at batch 256), k = 1 at 1 in 16 (~270); BENCHMARKS.md issue 14, twenty-first session.
SAMPLE_CANDIDATES = 1536
NOMINAL_EXCLUDED = 16  # exclusions assumed by ``sample_every`` (an exported E is symbolic)
SAMPLE_GROUP = 16  # items per sampled maximum
MAX_K = 1024  # larger k: torch reference
MIN_FUSED_ITEMS = 1 << 15  # smaller catalogs: mm + topk costs nothing worth fusing
MAX_CHUNKS = 1024
# Item tiles the flat select loop scores between two checks of its regions (its regions
# hold FLAT_TILES tiles past KEEP): the check syncs the CTA, and a loop holding that
# barrier is left unpipelined by Triton (0 asynchronous copies for sm_90a); between two
# checks the loop holds none (6).
FLAT_TILES = 4


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape of the threshold and select kernels (both use the same one)."""

    block_b: int
    block_v: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    programs_per_sm: int = 2
    # One loop over (tile, K step) instead of a K loop per tile, so that the pipeliner
    # prefetches the next tile's first K steps while this tile's candidates are stored;
    # its regions are checked (and compacted) every FLAT_TILES tiles.
    flat: bool = False
    # (CUDA only; the interpreter runs no PTX) each score above its threshold appended
    # under a branch, so that a score that does not pass costs a compare and a branch
    # instead of the masked atomic and stores' dozen instructions (BENCHMARKS.md, issue
    # 14, twentieth and twenty-first sessions)
    branch: bool = False
    # The users' [block_b, D] tile loaded once into shared memory and the item chunk
    # streamed one [block_v, D] tile per iteration (``resident_select.py``; block_k is
    # then the threshold pass's only). Measured slower than the tile kernel (0.96x at
    # batch 256, 0.84x at 64, H100): it stays opt-in
    resident: bool = False

    def __post_init__(self) -> None:
        for name in ("block_b", "block_v", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ModelError(f"LaunchConfig.{name}={value} must be a power of two >= 16")
        if self.block_v % SAMPLE_GROUP:
            raise ModelError(f"LaunchConfig.block_v={self.block_v} must be a multiple of 16")


def sample_every(k: int) -> int:
    """1 tile in this many is sampled for the threshold: the sparsest power of two up to
    ``SAMPLE_EVERY`` whose expected candidates, ``(k + E) * every``, stay within
    ``SAMPLE_CANDIDATES`` (a function of k alone, so that an export fixes it)."""
    every = SAMPLE_EVERY
    while every > 1 and (k + NOMINAL_EXCLUDED) * every > SAMPLE_CANDIDATES:
        every //= 2
    return every


def default_config(batch: int | torch.SymInt, dtype: torch.dtype, dim: int) -> LaunchConfig:
    """Tile shape by batch size (a symbolic batch, under export, gets the middle one)."""
    block_k = 64 if dim % 64 == 0 else 32 if dim % 32 == 0 else 16
    small = isinstance(batch, int) and batch <= 16
    if dtype == torch.float32:  # IEEE dots run on the FMA units: smaller tiles
        return LaunchConfig(16 if small else 64, 64, min(block_k, 32), 4, 2)
    if not isinstance(batch, int):
        return LaunchConfig(64, 128, block_k, 4, 4)
    if batch <= 64:
        return LaunchConfig(16 if small else 32 if batch <= 32 else 64, 128, block_k, 4, 4)
    # 256-item tiles and the branched append, at batch 256 on the H100: the op 1.12x and
    # 1.03x (the append 1.3x for the verify's 320 rows at k = 1; at batch 64 it lost, 0.97x)
    return LaunchConfig(128, 256, block_k, 8, 3, branch=True)


def resident_config(batch: int | torch.SymInt, dtype: torch.dtype, dim: int) -> LaunchConfig | None:
    """The resident select's tile for this call, or None where it does not apply (fp32,
    whose IEEE dots would double the shared memory; a dim that is not a power of two):
    64 users for a batch of <= 64 (one tile: the table is read once), else (a symbolic
    batch, under export, too) 128, and the widest item tile that fits beside them in 3
    stages, or in 2."""
    if dtype == torch.float32 or dim & (dim - 1) or dim < 16:
        return None
    block_b = 64 if isinstance(batch, int) and batch <= 64 else 128
    for block_v in (128, 64, 32, 16):
        for stages in (3, 2):
            if shared_bytes(block_b, block_v, stages, dim, dtype.itemsize) <= SHARED_BYTES:
                warps = 4 if block_b == 64 else 8
                return LaunchConfig(
                    block_b, block_v, 64, warps, stages, 1, branch=True, resident=True
                )
    return None


def triton_available() -> bool:
    return triton is not None


# ---------------------------------------------------------------- torch side


def select_chunks(user_tiles: int | torch.SymInt, tiles: int, programs: int) -> tuple[int, int]:
    """(chunks, item tiles per chunk) of the select kernel: chunks per user tile so that
    about ``programs`` run. A symbolic batch (export) is planned as one user tile (sizes
    stay plain expressions of B; only speed depends on it): a worker step's batch is mostly
    one tile (<= 64 users), and planning for two halved its programs to one per SM of the
    H200 (132) where the eager op runs two per SM (0.33 ms for 40 users, 2026-12-04)."""
    tiles_b = user_tiles if isinstance(user_tiles, int) else 1
    chunk_tiles = cdiv(tiles, max(1, min(cdiv(programs, tiles_b), MAX_CHUNKS, tiles)))
    return cdiv(tiles, chunk_tiles), chunk_tiles


def retrieve_reference(
    user_emb: torch.Tensor, table: torch.Tensor, exclude: torch.Tensor, k: int, first_row: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mm`` + masks + ``topk``: the contract's semantics and the oracle of the tests.

    user_emb [B, D]; table [V, D] (normalised rows); exclude [B, E] row ids, -1 = none.
    """
    scores = user_emb @ table.t()  # [B, V], a fresh tensor: masked in place
    # (masking in place saves three passes over [B, V], 1M items each, per step)
    scores[:, :first_row] = float("-inf")
    # -1 maps to row 0 (padding), which is already blocked.
    drop = exclude.clamp(min=0, max=scores.shape[1] - 1)
    scores.scatter_(1, drop, float("-inf"))
    top_scores, top_idx = torch.topk(scores, k, dim=1)
    return top_scores, top_idx  # a plain tuple: export cannot serialise return_types


class NormalizedTable:
    """The L2-normalised item table, kept until the embedding weight changes.

    ``F.normalize`` over 1M x 512 reads and writes 2 GB per call; the weight changes only
    by training or loading (``_version``, address, dtype or device move). Traced code
    (export, compile) and autograd get a fresh normalisation, as before.
    """

    def __init__(self) -> None:
        self._key: tuple[int, int, torch.dtype, torch.device] | None = None
        self._table: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        if (
            torch.compiler.is_compiling()
            or is_fake(weight)
            or (torch.is_grad_enabled() and weight.requires_grad)
        ):
            return F.normalize(weight, dim=-1)
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if self._table is None or self._key != key:
            self._table = None  # free the stale copy before making the new one
            with torch.inference_mode(False), torch.no_grad():
                self._table = F.normalize(weight, dim=-1)
            self._key = key
        return self._table


def fused_retrieval_enabled(
    backend: str, user_emb: torch.Tensor, table: torch.Tensor, k: int, first_row: int
) -> bool:
    """Whether ``fused_retrieve`` serves this call: Triton, CUDA, a large catalog, k <=
    MAX_K, matching 16/32-bit dtypes and a dim that is a multiple of 16; ``backend``
    "torch" (the model's kernel switch) never."""
    if backend == "torch" or not triton_available() or not user_emb.is_cuda:
        return False
    num_items, dim = table.shape
    return (
        0 < k <= MAX_K
        and num_items - first_row >= max(k, MIN_FUSED_ITEMS)
        and user_emb.dtype == table.dtype
        and user_emb.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and dim % 16 == 0
        and user_emb.shape[-1] == dim
        and table.stride(-1) == 1
    )


def fused_retrieve(
    user_emb: torch.Tensor, table: torch.Tensor, exclude: torch.Tensor, k: int, first_row: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op: (scores [B, k] in user_emb's dtype, item rows [B, k] int64)."""
    if exclude.dim() != 2 or exclude.shape[0] != user_emb.shape[0]:
        raise ModelError(f"exclude must be [B, E], got {tuple(exclude.shape)}")
    return torch.ops.streamrec.retrieve_topk(user_emb, table, exclude, k, first_row)


# ---------------------------------------------------------------- kernels

if triton is not None:
    from streamrec.models.region_append import (
        append_branched,
        append_masked,
        branched_counts,
        make_room,
        program_regions,
        store_passing,
    )
    from streamrec.models.resident_select import resident_sample_kernel, resident_select_kernel
    from streamrec.models.topk_merge import launch_merge

    @triton.jit
    def _dot_step(
        acc, u_rows, t_rows, kk, row_ok, col_ok, BLOCK_K: tl.constexpr, IEEE: tl.constexpr
    ):
        """acc += users [BB, BLOCK_K] @ items [BV, BLOCK_K]^T at K offset kk.

        IEEE: fp32 dots (fp32 inputs, or 16-bit inputs on the CPU interpreter, whose
        bf16 ``tl.dot`` is wrong: there the operands are widened, which is exact)."""
        offs_k = kk + tl.arange(0, BLOCK_K)
        a = tl.load(u_rows + offs_k[None, :], mask=row_ok[:, None], other=0.0)  # [BB, BK]
        b = tl.load(t_rows + offs_k[None, :], mask=col_ok[:, None], other=0.0)  # [BV, BK]
        if IEEE:
            a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        return acc

    @triton.jit
    def _tile_scores(
        u_ptr, t_ptr, rows, cols, num_users, num_items, stride_u, stride_t,
        D: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr = True,
    ):  # fmt: skip
        """fp32 scores [BLOCK_B, BLOCK_V] of users ``rows`` x items ``cols``; -inf past V
        (MASKED: a tile that may reach past V; a full tile skips the two instructions per
        score)."""
        u_rows = u_ptr + rows.to(tl.int64)[:, None] * stride_u  # [BB, 1]
        t_rows = t_ptr + cols.to(tl.int64)[:, None] * stride_t  # [BV, 1]
        col_ok = cols < num_items
        acc = tl.zeros([BLOCK_B, BLOCK_V], dtype=tl.float32)
        for kk in range(0, D, BLOCK_K):
            acc = _dot_step(acc, u_rows, t_rows, kk, rows < num_users, col_ok, BLOCK_K, IEEE)
        if MASKED:
            acc = tl.where(col_ok[None, :], acc, float("-inf"))
        return acc

    @triton.jit
    def _sample_kernel(
        u_ptr, t_ptr, gmax_ptr, num_users, num_items, first, num_groups, stride_u, stride_t,
        D: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr, IEEE: tl.constexpr, GROUP: tl.constexpr, EVERY: tl.constexpr,
    ):  # fmt: skip
        """Maxima of groups of GROUP items in sampled tile ``program_id(1)``."""
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        tile = tl.program_id(1)
        cols = first + tile * (BLOCK_V * EVERY) + tl.arange(0, BLOCK_V)
        acc = _tile_scores(
            u_ptr, t_ptr, rows, cols, num_users, num_items, stride_u, stride_t,
            D, BLOCK_B, BLOCK_V, BLOCK_K, IEEE,
        )  # fmt: skip
        gmax = tl.max(tl.reshape(acc, [BLOCK_B, BLOCK_V // GROUP, GROUP]), axis=2)
        groups = tile * (BLOCK_V // GROUP) + tl.arange(0, BLOCK_V // GROUP)
        ptrs = gmax_ptr + rows.to(tl.int64)[:, None] * num_groups + groups[None, :]
        tl.store(ptrs, gmax, mask=(rows < num_users)[:, None])

    @triton.jit
    def _select_kernel(
        u_ptr, t_ptr, thr_ptr, ex_ptr, cnt_ptr, sc_ptr, ix_ptr, num_users, num_items, first,
        num_chunks, chunk_tiles, stride_u, stride_t, stride_ex, num_ex, ex_steps,
        D: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr, IEEE: tl.constexpr, CAP: tl.constexpr, KEEP: tl.constexpr,
        FLAT: tl.constexpr, BRANCH: tl.constexpr = False,
    ):  # fmt: skip
        """Candidates of users ``program_id(0)`` in item chunk ``program_id(1)``."""
        rows, chunk, row_ok, thr, slots = program_regions(thr_ptr, num_users, num_chunks, BLOCK_B)
        cnt = tl.zeros([BLOCK_B], dtype=tl.int32)
        start = first + chunk * chunk_tiles * BLOCK_V
        stop = tl.minimum(start + chunk_tiles * BLOCK_V, num_items)
        if FLAT:
            steps: tl.constexpr = D // BLOCK_K
            seg: tl.constexpr = (CAP - KEEP) // BLOCK_V  # tiles between two region checks
            u_rows = u_ptr + rows.to(tl.int64)[:, None] * stride_u  # [BB, 1]
            acc = tl.zeros([BLOCK_B, BLOCK_V], dtype=tl.float32)
            n_tiles = tl.cdiv(stop - start, BLOCK_V)
            for tile0 in range(0, n_tiles, seg):
                thr, cnt = make_room(
                    thr, cnt, rows, slots, num_users, cnt_ptr, sc_ptr, ix_ptr, ex_ptr,
                    stride_ex, num_ex, ex_steps, BLOCK_B, seg * BLOCK_V, CAP, KEEP,
                )  # fmt: skip
                for it in range(tile0 * steps, tl.minimum(tile0 + seg, n_tiles) * steps):
                    cols = start + (it // steps) * BLOCK_V + tl.arange(0, BLOCK_V)
                    t_rows = t_ptr + cols.to(tl.int64)[:, None] * stride_t  # [BV, 1]
                    kk = (it % steps) * BLOCK_K
                    acc = _dot_step(acc, u_rows, t_rows, kk, row_ok, cols < num_items,
                                    BLOCK_K, IEEE)  # fmt: skip
                    if it % steps == steps - 1:
                        acc = tl.where((cols < num_items)[None, :], acc, float("-inf"))
                        if BRANCH:  # (a row's count: an upper bound since its last check)
                            counts = branched_counts(acc, cols, thr, slots, cnt_ptr, sc_ptr,
                                                      ix_ptr, CAP)  # fmt: skip
                            cnt = tl.maximum(cnt, tl.max(counts, axis=1))
                        else:
                            cnt = store_passing(acc, cols, thr, cnt, slots, cnt_ptr, sc_ptr,
                                                 ix_ptr, BLOCK_B, BLOCK_V, CAP)  # fmt: skip
                        acc = tl.zeros([BLOCK_B, BLOCK_V], dtype=tl.float32)
        elif BRANCH:
            # full tiles unmasked, then the one that reaches past V (if any)
            full = start + (stop - start) // BLOCK_V * BLOCK_V
            for v0 in range(start, full, BLOCK_V):
                cols = v0 + tl.arange(0, BLOCK_V)
                acc = _tile_scores(
                    u_ptr, t_ptr, rows, cols, num_users, num_items, stride_u, stride_t,
                    D, BLOCK_B, BLOCK_V, BLOCK_K, IEEE, MASKED=False,
                )  # fmt: skip
                thr = append_branched(
                    acc, cols, thr, rows, slots, num_users, cnt_ptr, sc_ptr, ix_ptr,
                    ex_ptr, stride_ex, num_ex, ex_steps, BLOCK_B, BLOCK_V, CAP, KEEP,
                )  # fmt: skip
            if full < stop:
                cols = full + tl.arange(0, BLOCK_V)
                acc = _tile_scores(
                    u_ptr, t_ptr, rows, cols, num_users, num_items, stride_u, stride_t,
                    D, BLOCK_B, BLOCK_V, BLOCK_K, IEEE,
                )  # fmt: skip
                thr = append_branched(
                    acc, cols, thr, rows, slots, num_users, cnt_ptr, sc_ptr, ix_ptr,
                    ex_ptr, stride_ex, num_ex, ex_steps, BLOCK_B, BLOCK_V, CAP, KEEP,
                )  # fmt: skip
        else:
            for v0 in range(start, stop, BLOCK_V):
                cols = v0 + tl.arange(0, BLOCK_V)
                acc = _tile_scores(
                    u_ptr, t_ptr, rows, cols, num_users, num_items, stride_u, stride_t,
                    D, BLOCK_B, BLOCK_V, BLOCK_K, IEEE,
                )  # fmt: skip
                thr, cnt = append_masked(
                    acc, cols, thr, cnt, rows, slots, num_users, cnt_ptr, sc_ptr, ix_ptr,
                    ex_ptr, stride_ex, num_ex, ex_steps, BLOCK_B, BLOCK_V, CAP, KEEP,
                )  # fmt: skip

    def launch_retrieval(
        user_emb: torch.Tensor,
        table: torch.Tensor,
        exclude: torch.Tensor,
        k: int,
        first_row: int,
        config: LaunchConfig | None = None,
        programs: int | None = None,
        merge_window: int = MERGE_WINDOW,
        every: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three kernels with an explicit tile shape, number of select programs, merge
        window and sampled fraction (1 tile in ``every``; the op uses the defaults, the
        bench sweeps them). Returns fp32
        scores [B, k], rows [B, k] int64 and the candidates kept per (user, chunk)
        [B, chunks] int32."""
        num_users, dim = user_emb.shape
        num_items = table.shape[0]
        num_ex = exclude.shape[1]
        cfg = config or default_config(num_users, user_emb.dtype, dim)
        if dim % cfg.block_k:
            raise ModelError(f"dim {dim} is not a multiple of block_k={cfg.block_k}")
        bb, bv = cfg.block_b, cfg.block_v
        keep = max(2, next_pow2(k))  # tl.topk and the merge need at least 2 lanes
        cap = next_pow2(keep + (FLAT_TILES if cfg.flat else 1) * bv)
        launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        ieee = user_emb.dtype == torch.float32 or not user_emb.is_cuda
        tile = {"D": dim, "BLOCK_B": bb, "BLOCK_V": bv, "BLOCK_K": cfg.block_k, "IEEE": ieee}
        if cfg.resident:
            check_resident_fits(bb, bv, cfg.num_stages, dim, user_emb.element_size())
            seg, cap = resident_plan(keep, bv)
        dev = user_emb.device
        u = user_emb.contiguous()
        ex = sorted_exclusions(exclude, num_items)
        ex_steps = num_ex.bit_length() if isinstance(num_ex, int) else EXCLUDE_STEPS
        user_tiles = cdiv(num_users, bb)

        if programs is None:
            sms = DEFAULT_SMS
            if dev.type == "cuda":
                sms = torch.cuda.get_device_properties(dev).multi_processor_count
            programs = cfg.programs_per_sm * sms
        every = every or sample_every(k)
        sampled = cdiv(num_items - first_row, bv * every)  # sampled tiles of bv items
        groups = sampled * (bv // SAMPLE_GROUP)
        gmax = torch.empty(num_users, groups, device=dev, dtype=torch.float32)
        if cfg.resident:
            per_chunk = cdiv(sampled, max(1, min(cdiv(programs, user_tiles), sampled)))
            torch.library.wrap_triton(resident_sample_kernel)[
                (user_tiles, cdiv(sampled, per_chunk))
            ](
                u, table, gmax, num_users, num_items, first_row, groups, sampled, per_chunk,
                u.stride(0), table.stride(0), D=dim, BLOCK_B=bb, BLOCK_V=bv, IEEE=ieee,
                GROUP=SAMPLE_GROUP, EVERY=every, **launch,
            )  # fmt: skip
        else:
            torch.library.wrap_triton(_sample_kernel)[(user_tiles, sampled)](
                u, table, gmax, num_users, num_items, first_row, groups, u.stride(0),
                table.stride(0), GROUP=SAMPLE_GROUP, EVERY=every, **tile, **launch,
            )  # fmt: skip
        margin = torch.linalg.vector_norm(u.float(), dim=1) * (dim * 2.0**-23)
        thr = sample_threshold(gmax, k + num_ex, margin).contiguous()  # [B]

        tiles = cdiv(num_items - first_row, bv)
        chunks, chunk_tiles = select_chunks(user_tiles, tiles, programs)
        if isinstance(num_users, int) and num_users * chunks * cap >= 2**31:
            raise ModelError(f"batch {num_users} too large for one call (int32 offsets)")
        counts = torch.zeros(num_users, chunks, device=dev, dtype=torch.int32)
        sc = torch.empty(num_users * chunks * cap, device=dev, dtype=torch.float32)
        ix = torch.empty(num_users * chunks * cap, device=dev, dtype=torch.int32)
        branch = cfg.branch and dev.type == "cuda"
        args = (u, table, thr, ex, counts, sc, ix, num_users, num_items, first_row, chunks,
                chunk_tiles, u.stride(0), table.stride(0), ex.stride(0), num_ex,
                ex_steps)  # fmt: skip
        if cfg.resident:
            torch.library.wrap_triton(resident_select_kernel)[(user_tiles, chunks)](
                *args, D=dim, BLOCK_B=bb, BLOCK_V=bv, IEEE=ieee, CAP=cap, KEEP=keep, SEG=seg,
                BRANCH=branch, **launch,
            )  # fmt: skip
        else:
            torch.library.wrap_triton(_select_kernel)[(user_tiles, chunks)](
                *args, CAP=cap, KEEP=keep, FLAT=cfg.flat, BRANCH=branch, **tile, **launch
            )

        scores, rows = launch_merge(sc, ix, counts, ex, ex_steps, k, cap, keep, merge_window)
        return scores, rows, counts

    @torch.library.triton_op(OP_RETRIEVE, mutates_args={})
    def retrieve_topk(
        user_emb: torch.Tensor, table: torch.Tensor, exclude: torch.Tensor, k: int, first_row: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k rows >= first_row by user_emb @ table.T, excluded rows last (-inf)."""
        scores, rows, _ = launch_retrieval(user_emb, table, exclude, k, first_row)
        return scores.to(user_emb.dtype), rows
