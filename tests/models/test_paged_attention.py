"""The fused paged SiLU attention ops against their torch references (issues 8, 13, 14).

CPU tests pin the references to the model's own torch attention and check the backend
switch; ``gpu`` tests run the Triton kernels (default and swept launch shapes) at batch
1…256 with cached lengths of 0, block boundaries and multi-split lengths, 0…40 new
tokens per user (decode: one-token chunks on the vector body, longer ones on tensor
cores, each user checked on its own in ``test_multi_token_users_match_the_reference``)
and the candidates' own keys (rank). The same ``gpu`` tests run
on the CPU interpreter at small shapes (fp32 only):

    TRITON_INTERPRET=1 PYTHONPATH=$PWD /work/triton-venv/bin/python -m pytest \
        -c /dev/null --noconftest -o markers=gpu -p no:cacheprovider -q -m gpu \
        tests/models/test_paged_attention.py

Tolerances: fp32 inputs use IEEE fp32 dots in the kernels, so the ops match the fp32
reference within 1e-5 relative error. bf16 inputs: the ops accumulate in fp32 and round
the SiLU weights to bf16 once before the second matmul; they are compared with the fp32
reference on the same (bf16-rounded) inputs within 1e-2 relative error, and must be no
worse than 2x the error of the bf16 torch path itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from streamrec.errors import ModelError
from streamrec.models.attention import time_bucket_edges
from streamrec.models.candidate_attention import (
    candidate_attention_reference,
    fused_candidate_attention,
)
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.models.multi_query_attention import CHUNK_M, busy_programs, chunk_programs
from streamrec.models.paged_attention import (
    check_inputs,
    fast_silu_allowed,
    fused_attention_enabled,
    fused_token_attention,
    paged_silu_attention_reference,
)
from tests.models.kernel_device import kernel_device
from tests.models.prefill_cases import rel_err

BF16_TOL = 1e-2
FP32_TOL = 1e-5
ON_GPU = torch.cuda.is_available()
# The interpreter runs a kernel program by program in NumPy: small shapes only there.
BATCHES = [1, 8, 64, 256] if ON_GPU else [1, 5]
LENGTH_CAP = 200 if ON_GPU else 40


@dataclass
class Case:
    """One layer's paged pool plus a batch of queries grouped by user.

    Decode (``rank`` False): the queries are each user's new tokens (counts may be 0),
    with their own keys/values ``k_new``/``v_new`` and ``q_start`` (first new token of
    the query's user). Rank: C candidates per user at one position/timestamp per user,
    each with its own key/value.
    """

    q: torch.Tensor  # [G, H, d]
    pos: torch.Tensor  # [G]
    ts: torch.Tensor  # [G]
    users: torch.Tensor  # [G]
    q_start: torch.Tensor  # [G]
    k_new: torch.Tensor  # [G, H, d]
    v_new: torch.Tensor  # [G, H, d]
    kv: torch.Tensor  # [2, NB, BS, H, d]
    ts_pool: torch.Tensor  # [NB, BS]
    tables: torch.Tensor  # [B, MB] int32
    lens: torch.Tensor  # [B]
    pos_bias: torch.Tensor  # [N, H]
    time_bias: torch.Tensor  # [NT, H]
    edges: torch.Tensor  # [NT - 1]
    rank: bool = False
    divisor: int = 4096

    def per_user(self, t: torch.Tensor) -> torch.Tensor:
        """[G, ...] -> [B, C, ...] (rank cases: every user has the same count)."""
        return t.view(self.lens.shape[0], -1, *t.shape[1:])

    def first(self, t: torch.Tensor) -> torch.Tensor:
        """The per-user value of a per-query tensor (rank: all candidates share it)."""
        num_users = self.lens.shape[0]
        return t[torch.arange(num_users, device=t.device) * (t.shape[0] // num_users)]

    def reference(self) -> torch.Tensor:
        if self.rank:
            return candidate_attention_reference(
                self.per_user(self.q), self.per_user(self.k_new), self.per_user(self.v_new),
                self.first(self.pos), self.first(self.ts), self.kv[0], self.kv[1],
                self.ts_pool, self.tables, self.lens, self.pos_bias, self.time_bias,
                self.edges, self.divisor,
            ).reshape(self.q.shape)  # fmt: skip
        return paged_silu_attention_reference(
            self.q, self.pos, self.ts, self.users, self.q_start, self.k_new, self.v_new,
            self.kv[0], self.kv[1], self.ts_pool, self.tables, self.lens, self.pos_bias,
            self.time_bias, self.edges, self.divisor,
        )  # fmt: skip

    def fused(self) -> torch.Tensor:
        if self.rank:
            return fused_candidate_attention(
                self.per_user(self.q), self.per_user(self.k_new), self.per_user(self.v_new),
                self.first(self.pos), self.first(self.ts), self.kv, self.ts_pool,
                self.tables, self.lens, self.pos_bias, self.time_bias, self.edges,
                self.divisor,
            ).reshape(self.q.shape)  # fmt: skip
        return fused_token_attention(
            self.q, self.k_new, self.v_new, self.pos, self.ts, self.users, self.q_start,
            self.kv, self.ts_pool, self.tables, self.lens, self.pos_bias, self.time_bias,
            self.edges, self.divisor,
        )  # fmt: skip

    def to(self, dtype: torch.dtype) -> Case:
        """The same case with float tensors in ``dtype`` (index tensors untouched)."""
        fields = dict(self.__dict__)
        for name in ("q", "k_new", "v_new", "kv", "pos_bias", "time_bias"):
            fields[name] = fields[name].to(dtype)
        return Case(**fields)


def make_case(
    lens: list[int],
    queries: int | list[int],
    rank: bool,
    device: str,
    seed: int,
    head_dim: int = 64,
    max_gap: int = 10**8,
) -> Case:
    """Random non-contiguous blocks per user, NaN in every unwritten slot; ``queries``
    per user (one count for all, or one per user; rank needs one for all). Cached keys
    lie up to ``max_gap`` ms apart from the history's start; the queries ~10^11 ms after
    it."""
    gen = torch.Generator().manual_seed(seed)
    heads, block_size, num_pos, num_time = 2, 16, 4096, 32
    counts = [queries] * len(lens) if isinstance(queries, int) else list(queries)
    need = [-(-n // block_size) for n in lens]
    width = max(1, *need)
    num_blocks = sum(need) + 8
    kv = torch.full((2, num_blocks, block_size, heads, head_dim), float("nan"))
    ts_pool = torch.full((num_blocks, block_size), -(2**40), dtype=torch.int64)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lens), width), 10**6, dtype=torch.int32)  # garbage past the end
    base = 1_700_000_000_000
    for b, n in enumerate(lens):
        blocks = [perm.pop() for _ in range(need[b])]
        tables[b, : need[b]] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor(
            [blocks[i // block_size] * block_size + i % block_size for i in range(n)],
            dtype=torch.int64,
        )
        gaps = torch.randint(0, max_gap, (n,), generator=gen)
        kv.view(2, -1, heads, head_dim)[:, slots] = torch.randn(
            2, n, heads, head_dim, generator=gen
        )
        ts_pool.view(-1)[slots] = base + torch.cumsum(gaps, 0)
    count_t = torch.tensor(counts, dtype=torch.int64)
    users = torch.arange(len(lens)).repeat_interleave(count_t)
    starts = torch.cumsum(count_t, 0) - count_t  # [B]
    lens_t = torch.tensor(lens, dtype=torch.int64)
    g = users.shape[0]
    slot = torch.arange(g) - starts[users]  # index of each query among its user's
    if rank:  # candidates: the user's next position and one query timestamp per user
        pos = lens_t[users]
        ts = (base + 10**11 + torch.randint(0, 10**9, (len(lens),), generator=gen))[users]
    else:  # new tokens: consecutive positions, increasing timestamps
        pos = lens_t[users] + slot
        ts = base + 10**11 + slot * 10**7 + torch.randint(0, 10**7, (g,), generator=gen)
    case = Case(
        q=torch.randn(g, heads, head_dim, generator=gen),
        pos=pos,
        ts=ts,
        users=users,
        q_start=starts[users],
        k_new=torch.randn(g, heads, head_dim, generator=gen),
        v_new=torch.randn(g, heads, head_dim, generator=gen),
        kv=kv,
        ts_pool=ts_pool,
        tables=tables,
        lens=lens_t,
        pos_bias=torch.randn(num_pos, heads, generator=gen) * 0.5,
        time_bias=torch.randn(num_time, heads, generator=gen) * 0.5,
        edges=time_bucket_edges(num_time, 0.6),
        rank=rank,
    )
    for name, value in case.__dict__.items():
        if isinstance(value, torch.Tensor):
            setattr(case, name, value.to(device))
    return case


def edge_lengths(batch: int, seed: int, cap: int = LENGTH_CAP) -> list[int]:
    """0, block boundaries ±1, then random lengths up to ``cap``."""
    rng = random.Random(seed)
    fixed = [0, 1, 15, 16, 17, 32, 48, cap]
    return [fixed[i] if i < len(fixed) else rng.randint(0, cap) for i in range(batch)]


def new_token_counts(batch: int, seed: int, cap: int = 40) -> list[int]:
    """New tokens per user: 0 (idle users), 1, the cap, block-size edges, random."""
    rng = random.Random(seed + 1)
    fixed = [1, 0, cap, 16, 17, 2, 0, 31]
    return [fixed[i] if i < len(fixed) else rng.randint(0, cap) for i in range(batch)]


# New tokens per user of the multi-query cases: idle, one (the vector body), a chunk of 2,
# a partial chunk, a full chunk and a chunk of one, three chunks (16 + 16 + 8).
MIXED_COUNTS = [0, 1, 2, 5, 17, 40]


def mixed_case(device: str, seed: int, copies: int = 1) -> Case:
    """MIXED_COUNTS (``copies`` times) over caches past a block, empty, short, past
    several key ranges and long, in scattered blocks; keys up to 1.5·10^9 ms apart, so
    the last ones come close to the new tokens and key tiles straddle time buckets."""
    lens = [70, 0, 33, 257, 0, 130] if not ON_GPU else [700, 0, 33, 2049, 0, 1100]
    return make_case(lens * copies, MIXED_COUNTS * copies, rank=False, device=device,
                     seed=seed, max_gap=1_500_000_000)  # fmt: skip


def per_user_errors(c: Case, got: torch.Tensor, want: torch.Tensor) -> list[float]:
    """rel_err of each user that has new tokens (a small user cannot hide in the total)."""
    return [
        rel_err(got[c.users == b], want[c.users == b])
        for b in range(c.lens.shape[0])
        if bool((c.users == b).any())
    ]


def decode_args(c: Case) -> tuple[object, ...]:
    """launch_decode's leading arguments for a decode case."""
    return (c.q, c.pos, c.ts, c.users, c.q_start, c.k_new, c.v_new, c.kv[0], c.kv[1],
            c.ts_pool, c.tables, c.lens, c.pos_bias, c.time_bias, c.edges, c.divisor)  # fmt: skip


# ------------------------------------------------------------------------ CPU


def _model_and_case(rank: bool) -> tuple[HSTU, Case, torch.Tensor]:
    """A torch-backend model whose layer 1 biases the case uses, and a 2-layer pool."""
    cfg = HSTUConfig(num_items=50, d_model=32, num_heads=2, head_dim=16, max_seq_len=64)
    torch.manual_seed(0)
    model = HSTU(cfg, attention_backend="torch").eval()
    layer = model.layers[1]
    with torch.no_grad():
        layer.pos_bias.normal_(0, 0.5)
        layer.time_bias.normal_(0, 0.5)
    queries: int | list[int] = 3 if rank else [2, 0, 5, 3]
    case = make_case([0, 5, 16, 40], queries, rank=rank, device="cpu", seed=1, head_dim=16)
    case.divisor = cfg.max_seq_len
    case.pos_bias = layer.pos_bias.detach()
    case.time_bias = layer.time_bias.detach()
    case.edges = time_bucket_edges(cfg.num_time_buckets, cfg.time_bucket_width)
    pool = torch.stack([torch.zeros_like(case.kv), case.kv])  # layer 1 of a 2-layer pool
    return model, case, pool


@torch.no_grad()
def test_reference_is_the_model_token_attention() -> None:
    """Cached keys plus the user's own new keys, as the model's torch path of extend."""
    model, case, pool = _model_and_case(rank=False)
    counts = torch.bincount(case.users, minlength=case.lens.shape[0])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    slot = torch.arange(case.q.shape[0]) - case.q_start
    layer = model.layers[1]
    cached = model._context_attention(
        1, case.q, case.pos, case.ts, case.users, pool, case.ts_pool, case.tables, case.lens
    )
    geo = model._new_token_geometry(offsets, case.users, slot, case.pos, case.ts)
    assert geo.grid is not None and geo.mask.shape == (4, 5, 5)  # [B, longest, longest]
    fresh = model._new_token_attention(layer, case.q, case.k_new, case.v_new, geo)
    got = case.reference()
    assert torch.isfinite(got).all()
    assert rel_err(got, cached + fresh) < 1e-6


@torch.no_grad()
def test_new_token_attention_padded_equals_the_static_square(monkeypatch) -> None:
    """The per-user padded rows (eager) and the [T, T] square (traced) agree."""
    model, case, _ = _model_and_case(rank=False)
    counts = torch.bincount(case.users, minlength=case.lens.shape[0])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    slot = torch.arange(case.q.shape[0]) - case.q_start
    layer = model.layers[1]
    args = (offsets, case.users, slot, case.pos, case.ts)
    padded = model._new_token_attention(
        layer, case.q, case.k_new, case.v_new, model._new_token_geometry(*args)
    )
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    geo = model._new_token_geometry(*args)
    assert geo.grid is None and geo.mask.shape == (1, 10, 10)
    square = model._new_token_attention(layer, case.q, case.k_new, case.v_new, geo)
    assert rel_err(padded, square) < 1e-6


@torch.no_grad()
def test_candidate_reference_is_the_model_candidate_attention() -> None:
    """Cached keys plus each candidate's own key, as the model's torch path of rank."""
    model, case, pool = _model_and_case(rank=True)
    q, k, v = (case.per_user(t).flatten(-2) for t in (case.q, case.k_new, case.v_new))
    h = torch.cat([torch.zeros_like(q), v, q, k], dim=-1)  # the projection: u, v, q, k
    want = model._candidate_attention(
        1, h, True, case.first(case.ts), pool, case.ts_pool, case.tables, case.lens
    )
    assert rel_err(case.reference(), want.reshape(case.q.shape)) < 1e-6


def test_chunk_layout_fits_the_shape_only_grid() -> None:
    """The decode grid's chunk ids (multi_query_attention's layout, written out here) are
    disjoint and below ``chunk_programs`` for any counts, and exactly B when every user
    has one token (the one-token grid of before, no idle program)."""
    rng = random.Random(0)
    sizes = [0, 0, 1, 1, 2, 5, 15, 16, 17, 33, 40]
    for trial in range(2000):
        counts = [rng.choice(sizes) for _ in range(rng.randint(1, 9))]
        if trial % 7 == 0:
            counts = [1] * len(counts)
        ids, first = [], 0
        for b, n in enumerate(counts):
            base = (first + (CHUNK_M - 1) * b) // CHUNK_M
            ids += [base + c for c in range(-(-n // CHUNK_M))]
            first += n
        grid = chunk_programs(len(counts), sum(counts))
        assert len(set(ids)) == len(ids) and all(0 <= i < grid for i in ids), counts
        assert busy_programs(len(counts), sum(counts)) >= 1
        if all(n == 1 for n in counts):
            assert grid == len(counts) == len(ids)


def test_backend_switch_on_cpu() -> None:
    q = torch.zeros(2, 2, 64)
    assert not fused_attention_enabled("auto", q)
    assert not fused_attention_enabled("torch", q)
    with pytest.raises(ModelError, match="attention_backend='triton'"):
        fused_attention_enabled("triton", q)
    with pytest.raises(ModelError, match="'cuda-magic'"):
        fused_attention_enabled("cuda-magic", q)


@pytest.mark.parametrize(
    ("q_shape", "match"),
    [
        ((4, 2, 24), "power-of-two head_dim"),
        ((4, 3, 64), "wants q"),
        ((4, 2, 2, 64), None),
    ],
)
def test_check_inputs(q_shape: tuple[int, ...], match: str | None) -> None:
    k_cache = torch.zeros(3, 16, 2, q_shape[-1])
    if match is None:
        check_inputs(torch.zeros(q_shape), k_cache)  # [B, C, H, d] candidates are fine
        return
    with pytest.raises(ModelError, match=match):
        check_inputs(torch.zeros(q_shape), k_cache)


def test_kernels_want_power_of_two_blocks() -> None:
    """The tensor-core key tiles find a key's block and slot by a shift and a mask: a pool
    of 3-slot blocks is refused by name, by extend and rank, before any kernel runs."""
    c = make_case([5, 3], 2, True, "cpu", seed=0)
    kv3, ts3 = c.kv[:, :, :3].contiguous(), c.ts_pool[:, :3].contiguous()
    with pytest.raises(ModelError, match="power-of-two pool block size, got 3"):
        fused_candidate_attention(
            c.per_user(c.q), c.per_user(c.k_new), c.per_user(c.v_new), c.first(c.pos),
            c.first(c.ts), kv3, ts3, c.tables, c.lens, c.pos_bias, c.time_bias, c.edges,
            c.divisor,
        )  # fmt: skip
    with pytest.raises(ModelError, match="power-of-two pool block size, got 3"):
        fused_token_attention(
            c.q, c.k_new, c.v_new, c.pos, c.ts, c.users, c.q_start, kv3, ts3, c.tables,
            c.lens, c.pos_bias, c.time_bias, c.edges, c.divisor,
        )  # fmt: skip


def test_fast_silu_only_in_low_precision_launches() -> None:
    """The tanh.approx SiLU never reaches fp32 math; traced launches (fake tensors) take
    it like eager ones, so a package runs the eager kernels' arithmetic."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert fast_silu_allowed(True, torch.zeros(2, dtype=torch.bfloat16))
    assert not fast_silu_allowed(False, torch.zeros(2, dtype=torch.bfloat16))
    assert not fast_silu_allowed(True, torch.zeros(2, dtype=torch.float32))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.zeros(2, dtype=torch.bfloat16))
        assert fast_silu_allowed(True, fake)
        assert not fast_silu_allowed(True, fake.float())


def test_default_candidate_launch_by_dtype_and_batch() -> None:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from streamrec.models import candidate_attention as ca

    assert ca.default_launch(1, fp8=False, by_batch=False) == ca.CAND_LAUNCH
    assert ca.default_launch(1, fp8=True, by_batch=True) == ca.CAND_FP8_LAUNCH
    small = ca.CAND_SMALL_USERS
    assert ca.default_launch(small, fp8=False, by_batch=True) == ca.CAND_SMALL_LAUNCH
    assert ca.default_launch(small + 1, fp8=False, by_batch=True) == ca.CAND_LAUNCH
    symbolic = ShapeEnv().create_unbacked_symint()  # an exported op's batch
    assert ca.default_launch(symbolic, fp8=False, by_batch=True) == ca.CAND_LAUNCH


# ------------------------------------------------------------- GPU / interpreter


def _cuda_only() -> None:
    if not ON_GPU:
        pytest.skip("needs CUDA (bf16 and export are not checked on the interpreter)")


@pytest.mark.gpu
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("rank", [False, True])
def test_op_matches_reference_fp32(batch: int, rank: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    device = kernel_device(monkeypatch)
    queries = 32 if rank else new_token_counts(batch, batch)
    case = make_case(edge_lengths(batch, batch), queries, rank, device, seed=batch)
    got = case.fused()
    err = rel_err(got, case.reference())
    print(f"fp32 batch={batch} rank={rank}: rel err {err:.2e}")
    assert err < FP32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("rank", [False, True])
def test_op_bf16_error(batch: int, rank: bool) -> None:
    _cuda_only()
    queries = 32 if rank else new_token_counts(batch, batch)
    exact = make_case(edge_lengths(batch, batch), queries, rank, "cuda", seed=batch)
    low = exact.to(torch.bfloat16)
    want = low.to(torch.float32).reference()  # fp32 math on the bf16-rounded inputs
    got_err = rel_err(low.fused(), want)
    torch_err = rel_err(low.reference(), want)
    print(f"bf16 batch={batch} rank={rank}: op {got_err:.2e}, torch bf16 path {torch_err:.2e}")
    assert got_err < BF16_TOL
    assert got_err <= 2 * torch_err + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [False, True])
def test_long_histories_and_splits(rank: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lengths past one key range and one key tile, several candidate tiles per user,
    runs of new tokens longer than a key tile."""
    device = kernel_device(monkeypatch)
    if ON_GPU:
        lens, cands, counts = [0, 255, 256, 257, 700, 1100, 3, 4096], 130, [3, 40, 1, 0]
    else:
        lens, cands, counts = [0, 63, 64, 65, 130, 3], 20, [3, 40, 1, 0]
    queries = cands if rank else (counts * 2)[: len(lens)]
    case = make_case(lens, queries, rank=rank, device=device, seed=7)
    err = rel_err(case.fused(), case.reference())
    assert err < FP32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", [1, 64, 4096])  # one key range, a few, one tile each
def test_multi_token_users_match_the_reference(
    dtype: torch.dtype, target: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Users with 0/1/2/5/17/40 new tokens in one call: one-token chunks on the vector
    body, longer ones on tensor cores (a user's tokens share each cached key tile), each
    user against the reference; with several key ranges the sum is bit-identical from
    run to run."""
    from streamrec.models import paged_attention as pa

    device = kernel_device(monkeypatch)
    if dtype != torch.float32:
        _cuda_only()
    exact = mixed_case(device, seed=21, copies=8 if ON_GPU else 1)
    c = exact.to(dtype)
    want = c.to(torch.float32).reference()  # fp32 math on the (rounded) inputs
    launch = (pa.DECODE_BLOCK_N, pa.DECODE_WARPS, target)
    got = pa.launch_decode(*decode_args(c), *launch)  # type: ignore[arg-type]
    errors = per_user_errors(c, got, want)
    print(f"{dtype} target={target}: worst user rel err {max(errors):.2e}")
    if dtype == torch.float32:
        assert max(errors) < FP32_TOL
    else:
        assert rel_err(got, want) < BF16_TOL
        assert rel_err(got, want) <= 2 * rel_err(c.reference(), want) + 1e-4
    if target > 1:
        assert torch.equal(got, pa.launch_decode(*decode_args(c), *launch))  # type: ignore[arg-type]


@pytest.mark.gpu
def test_decode_launch_variants_and_determinism(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch shape the sweep tries gives the reference (the vector body's key tile
    and warps, the tensor-core chunk's tokens and key tile); one key range or many (the
    last range to finish adds the partials in a fixed order: bit-identical)."""
    device = kernel_device(monkeypatch)
    from streamrec.models import paged_attention as pa

    c = make_case([0, 17, 40, 33], [2, 0, 19, 1], rank=False, device=device, seed=11)
    want = c.reference()
    args = decode_args(c)
    for block_n, warps, target, acc2d, chunk, prefetch, stages in [
        (16, 2, 1, False, (16, 16), False, 1), (32, 4, 1, True, (16, 32), False, 1),
        (64, 2, 4096, False, (32, 16), False, 1), (16, 4, 4096, True, (16, 64), False, 1),
        (32, 4, 64, True, (64, 16), False, 1),
        # the next tile's loads before this tile's math: one key range and many
        (16, 4, 1, True, (16, 16), True, 1), (32, 4, 4096, False, (16, 16), True, 1),
        # Triton's pipeline over the one-token loop
        (32, 4, 1, True, (16, 16), False, 3), (16, 4, 4096, True, (16, 16), False, 2),
    ]:  # fmt: skip
        run = (block_n, warps, target, True, acc2d)
        launch = {"block_m": chunk[0], "chunk_n": chunk[1], "prefetch": prefetch,
                  "stages": stages}  # fmt: skip
        got = pa.launch_decode(*args, *run, **launch)  # type: ignore[arg-type]
        assert rel_err(got, want) < FP32_TOL, (run, chunk, prefetch, stages)
        if target > 1:
            again = pa.launch_decode(*args, *run, **launch)  # type: ignore[arg-type]
            assert torch.equal(got, again)


@pytest.mark.gpu
def test_candidate_launch_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    device = kernel_device(monkeypatch)
    from streamrec.models import candidate_attention as ca

    c = make_case([0, 17, 40, 70], 19, rank=True, device=device, seed=12)
    want = c.reference()
    args = (c.per_user(c.q), c.per_user(c.k_new), c.per_user(c.v_new), c.first(c.pos),
            c.first(c.ts), c.kv[0], c.kv[1], c.ts_pool, c.tables, c.lens, c.pos_bias,
            c.time_bias, c.edges, c.divisor)  # fmt: skip
    for block_m, block_n, warps, stages, target in [
        (16, 16, 4, 2, 1), (64, 32, 4, 2, 1024), (128, 64, 8, 3, 256), (128, 16, 8, 2, 4096),
        (64, 128, 4, 2, 256), (256, 32, 8, 2, 256),
    ]:  # fmt: skip
        got = ca.launch_candidates(*args, block_m, block_n, warps, stages, target)
        assert rel_err(got.view_as(c.q), want) < FP32_TOL, (block_m, block_n, target)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_small_batch_candidate_launch(batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """CAND_LAUNCH_BY_BATCH: the op at CAND_SMALL_LAUNCH equals the reference (fp32) and
    stays within bf16's tolerance on CUDA."""
    from streamrec.models import candidate_attention as ca

    device = kernel_device(monkeypatch)
    monkeypatch.setattr(ca, "CAND_LAUNCH_BY_BATCH", True)
    case = make_case(edge_lengths(batch, batch), 130, True, device, seed=40 + batch)
    assert rel_err(case.fused(), case.reference()) < FP32_TOL
    if device == "cuda":
        low = case.to(torch.bfloat16)
        assert rel_err(low.fused(), low.to(torch.float32).reference()) < BF16_TOL


@pytest.mark.gpu
def test_export_keeps_the_ops() -> None:
    """torch.export keeps one custom-op node each, so AOTInductor packages the kernels."""
    _cuda_only()
    dec = make_case([5, 20, 33], [2, 0, 3], rank=False, device="cuda", seed=5)
    cand = make_case([5, 20, 33], 4, rank=True, device="cuda", seed=6)

    class Attn(torch.nn.Module):
        def forward(self, q: torch.Tensor, qc: torch.Tensor) -> tuple[torch.Tensor, ...]:
            c, r = dec, cand
            tok = fused_token_attention(
                q, c.k_new, c.v_new, c.pos, c.ts, c.users, c.q_start, c.kv, c.ts_pool,
                c.tables, c.lens, c.pos_bias, c.time_bias, c.edges, c.divisor,
            )  # fmt: skip
            cands = fused_candidate_attention(
                qc, r.per_user(r.k_new), r.per_user(r.v_new), r.first(r.pos), r.first(r.ts),
                r.kv, r.ts_pool, r.tables, r.lens, r.pos_bias, r.time_bias, r.edges,
                r.divisor,
            )  # fmt: skip
            return tok, cands

    args = (dec.q, cand.per_user(cand.q))
    program = torch.export.export(Attn(), args, strict=False)
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert any("paged_silu_attention." in t for t in targets), targets
    assert any("paged_silu_attention_candidates" in t for t in targets), targets
    tok, cands = program.module()(*args)
    assert rel_err(tok, dec.reference()) < FP32_TOL
    assert rel_err(cands.view_as(cand.q), cand.reference()) < FP32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [False, True])
def test_non_contiguous_index_tensors_read_right(
    rank: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block table sliced out of a wider one, and index vectors taken every other
    element, give the contiguous answer (the kernel indexes them as dense rows)."""
    device = kernel_device(monkeypatch)
    queries = 8 if rank else new_token_counts(4, 4)
    case = make_case(edge_lengths(4, 4), queries, rank, device, seed=5)
    want = case.fused()
    wide = torch.full(
        (case.tables.shape[0], case.tables.shape[1] + 3), -1, dtype=case.tables.dtype,
        device=device,
    )  # fmt: skip
    wide[:, : case.tables.shape[1]] = case.tables

    def strided(t: torch.Tensor) -> torch.Tensor:
        return torch.stack([t, t], dim=1)[:, 0]  # same values, stride 2

    fields = dict(case.__dict__)
    fields["tables"] = wide[:, : case.tables.shape[1]]
    for name in ("pos", "ts", "users", "q_start", "lens"):
        fields[name] = strided(fields[name])
    assert not fields["tables"].is_contiguous() and not fields["pos"].is_contiguous()
    got = Case(**fields).fused()
    assert torch.equal(got, want)
