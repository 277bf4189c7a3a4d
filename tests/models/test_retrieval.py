"""Fused retrieval top-k (issue 14, item 4) against ``torch.topk``.

- CPU: the torch side of the op (keys, threshold, cached table) and ``simulate``, the
  kernels' algorithm written in torch, against an oracle — exact top-k by (score
  descending, index ascending) — on inputs that stress it: ties, a zero user, clustered
  items (regions fill up and are compacted), exclusions of the best items, a catalog
  with fewer valid rows than k.
- Interpreter (``TRITON_INTERPRET=1`` with /work/triton-venv): the kernels themselves at
  small shapes. Scores on a dyadic grid are exact in fp32, so the kernels must equal the
  oracle bit for bit, tie order included.
- ``gpu``: 1M items x 512, batch 1/64/256, k = 256, 16 exclusions, fp32 and bf16, against
  ``mm`` + ``topk``; a CUDA-graph replay; ``HSTU.retrieve``; an AOTInductor package.

Tolerances (gpu): the kernel and cuBLAS sum the 512 products in different orders, so
scores agree to 2e-6 (fp32) or one bf16 rounding (2**-8 absolute for |score| <= 1); the
index sets agree except for items whose exact score lies within that tolerance of the
k-th score (ties at the boundary, where ``torch.topk`` picks arbitrarily).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.models.retrieval import (
    SAMPLE_GROUP,
    NormalizedTable,
    default_config,
    fused_retrieval_enabled,
    retrieve_reference,
    sample_every,
)
from streamrec.models.topk_merge import next_pow2, pack_keys, sample_threshold, unpack_keys
from tests.models.retrieval_cases import CASES, FIRST, case, oracle

INTERPRETER = (
    os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
)


def simulate(
    scores: torch.Tensor, exclude: torch.Tensor, k: int, first: int, block_v: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The three kernels in torch, per user: threshold from sampled group maxima, chunks
    of ``chunk`` tiles whose candidate regions are compacted to KEEP when they might not
    hold one more tile, then the merge. scores [B, V] fp32 (the kernels' tile scores)."""
    num_users, num_items = scores.shape
    keep, cap = next_pow2(k), next_pow2(next_pow2(k) + block_v)
    ex = exclude.clamp(max=num_items - 1)
    maxima = []
    for start in range(first, num_items, block_v * sample_every(k)):
        tile = torch.full((num_users, block_v), float("-inf"))
        stop = min(start + block_v, num_items)
        tile[:, : stop - start] = scores[:, start:stop]
        maxima.append(tile.view(num_users, -1, SAMPLE_GROUP).amax(dim=2))
    thr = sample_threshold(torch.cat(maxima, 1), k + ex.shape[1], torch.zeros(num_users))
    out_s, out_i = [], []
    for b in range(num_users):
        dropped = torch.isin(torch.arange(num_items), ex[b])
        cand_s, cand_i = [], []
        for c0 in range(first, num_items, chunk * block_v):
            t, rs, ri = thr[b], torch.empty(0), torch.empty(0, dtype=torch.long)
            for v0 in range(c0, min(c0 + chunk * block_v, num_items), block_v):
                cols = torch.arange(v0, min(v0 + block_v, num_items))
                take = scores[b, cols] > t
                rs, ri = torch.cat([rs, scores[b, cols][take]]), torch.cat([ri, cols[take]])
                if len(rs) > cap - block_v:
                    rs = torch.where(dropped[ri], float("-inf"), rs)
                    rs, ri = unpack_keys(torch.topk(pack_keys(rs, ri), keep).values)
                    t = torch.maximum(t, rs[-1])
            cand_s.append(rs)
            cand_i.append(ri)
        s, i = torch.cat(cand_s), torch.cat(cand_i)
        s = torch.where(dropped[i], float("-inf"), s)
        top_s, top_i = unpack_keys(torch.topk(pack_keys(s, i), k).values)
        out_s.append(top_s)
        out_i.append(top_i)
    return torch.stack(out_s), torch.stack(out_i)


# ------------------------------------------------------------------ CPU


def test_keys_order_by_score_then_lower_index() -> None:
    scores = torch.tensor([0.5, -0.25, 0.5, float("-inf"), 3.0, -0.0, 0.0, -7.5])
    idx = torch.tensor([9, 4, 2, 1, 7, 5, 6, 3])
    order = torch.argsort(pack_keys(scores, idx), descending=True)
    assert idx[order].tolist() == [7, 2, 9, 6, 5, 4, 3, 1]  # (-0.0 sorts just below 0.0)
    back_s, back_i = unpack_keys(pack_keys(scores, idx))
    assert torch.equal(back_s.view(torch.int32), scores.view(torch.int32))
    assert torch.equal(back_i, idx)


def test_sample_threshold_bounds_the_need_th_maximum() -> None:
    maxima = torch.tensor([[0.1, 0.9, 0.5, 0.7], [0.3, 0.2, 0.1, 0.0]])
    margin = torch.tensor([0.0, 0.05])
    thr = sample_threshold(maxima, 3, margin)  # third largest: 0.5 and 0.1
    lower = torch.tensor([0.5, 0.1]) - margin
    assert torch.equal(thr, torch.nextafter(lower, torch.tensor(float("-inf"))))
    too_few = sample_threshold(maxima, 5, torch.zeros(2))
    assert torch.isneginf(too_few).all()


def test_sample_every_aims_at_about_a_thousand_candidates() -> None:
    assert sample_every(1) == 16  # the verify's k = 1: ~270 candidates per user
    assert sample_every(64) == 16 and sample_every(96) == 8
    assert sample_every(256) == 4  # (256 + 16) x 4 = 1,088
    assert sample_every(4096) == 1  # the whole table, never less


def test_a_denser_sample_stays_exact() -> None:
    users, table, exclude, _ = case("clustered")
    scores = users @ table.t()
    for k in (96, 256):  # 1 tile in 8, in 4
        got_s, got_i = simulate(scores, exclude, k, FIRST, 32, 40)
        want_s, want_i = oracle(scores, exclude, k, FIRST)
        assert torch.equal(got_i, want_i) and torch.equal(got_s, want_s)


def test_large_batches_default_to_wide_item_tiles_with_the_branched_append() -> None:
    big = default_config(256, torch.bfloat16, 512)
    assert (big.block_b, big.block_v, big.branch, big.resident) == (128, 256, True, False)
    assert not default_config(64, torch.bfloat16, 512).branch  # it lost at batch 64


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("block_v,chunk", [(16, 7), (32, 40)])
def test_algorithm_equals_exact_top_k(name: str, block_v: int, chunk: int) -> None:
    users, table, exclude, k = case(name)
    scores = users @ table.t()  # [B, V], exact on the dyadic grid
    got_s, got_i = simulate(scores, exclude, k, FIRST, block_v, chunk)
    want_s, want_i = oracle(scores, exclude, k, FIRST)
    assert torch.equal(got_i, want_i) and torch.equal(got_s, want_s)
    ref_s, _ = retrieve_reference(users, table, exclude, k, FIRST)  # mm + topk
    assert torch.equal(got_s, ref_s)  # same scores; only tie order may differ


def test_normalized_table_is_cached_until_the_weight_changes() -> None:
    emb = torch.nn.Embedding(50, 8)
    cache = NormalizedTable()
    with torch.no_grad():
        first = cache.get(emb.weight)
        assert cache.get(emb.weight) is first
        torch.testing.assert_close(first, F.normalize(emb.weight, dim=-1))
        emb.weight[3].mul_(2.0)  # in place: _version moves
        second = cache.get(emb.weight)
        assert second is not first
        torch.testing.assert_close(second, F.normalize(emb.weight, dim=-1))
        assert cache.get(emb.weight.double()).dtype == torch.float64
    with torch.inference_mode():
        inside = cache.get(emb.weight)
    assert not inside.is_inference()  # usable outside inference mode too
    fresh = cache.get(emb.weight)  # grad enabled and weight requires grad: not cached
    assert fresh.grad_fn is not None


def test_fused_path_is_cuda_and_triton_only() -> None:
    users, table, _, k = case("random")
    assert not fused_retrieval_enabled("auto", users, table, k, FIRST)  # CPU tensors
    assert not fused_retrieval_enabled("torch", users, table, k, FIRST)


@torch.no_grad()
def test_hstu_retrieve_reads_the_cached_table() -> None:
    torch.manual_seed(0)
    model = HSTU(HSTUConfig(num_items=300, d_model=16)).eval()
    user = F.normalize(torch.randn(2, 16), dim=-1)
    none = torch.full((2, 1), -1)
    want = retrieve_reference(user, model.item_table(), none, 5, FIRST)
    got = model.retrieve(user, 5, none)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    model.item_emb.weight[got[1][0, 0]].mul_(-1.0)  # the best row of user 0 turns away
    again = model.retrieve(user, 5, none)
    assert int(got[1][0, 0]) not in again[1][0].tolist()


# ------------------------------------------------------------------ interpreter


@pytest.fixture
def kernels() -> Iterator[Any]:
    """streamrec.models.retrieval with the CPU interpreter patched for NumPy >= 2.4
    (its ``range`` over a kernel scalar calls int() on a 1-element array)."""
    if not INTERPRETER:
        pytest.skip("needs TRITON_INTERPRET=1 and Triton (/work/triton-venv)")
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    from streamrec.models import retrieval

    yield retrieval
    interpreter._patch_lang_tensor = original


@pytest.mark.parametrize(
    "name,dtype,flat",
    [
        ("random", torch.float32, False),
        ("random", torch.bfloat16, True),
        ("clustered", torch.float32, False),
        ("clustered", torch.bfloat16, True),
        ("zero_user", torch.bfloat16, False),
        # every item ties at 0 for the zero user: regions fill and compact between the
        # flat loop's segments
        ("zero_user", torch.bfloat16, True),
        ("exclude_best", torch.float32, True),
        # "resident": the users' tile loaded once, one dot over D per item tile; the
        # clustered and zero users fill a region within a run (compaction between runs)
        ("random", torch.bfloat16, "resident"),
        ("clustered", torch.float32, "resident"),
        ("zero_user", torch.bfloat16, "resident"),
        ("exclude_best", torch.float32, "resident"),
        ("tiny", torch.bfloat16, "resident"),
    ],
)
def test_kernels_equal_exact_top_k_on_the_interpreter(
    kernels: Any, name: str, dtype: torch.dtype, flat: bool | str
) -> None:
    users, table, exclude, k = case(name)
    resident = flat == "resident"
    config = kernels.LaunchConfig(  # 2 K steps per tile
        16, 16, 16, num_warps=4, flat=flat is True, resident=resident
    )
    got_s, got_i, counts = kernels.launch_retrieval(
        users.to(dtype), table.to(dtype), exclude, k, FIRST, config, programs=3, merge_window=32
    )
    want_s, want_i = oracle(users @ table.t(), exclude, k, FIRST)
    print(f"{name} {dtype} flat={flat}: candidates per user {counts.sum(1).tolist()}")
    assert torch.equal(got_i, want_i) and torch.equal(got_s, want_s)


def test_wide_item_tiles_and_a_denser_sample_on_the_interpreter(kernels: Any) -> None:
    """The large-batch default's 256-item tiles, with k = 96 (1 tile in 8 sampled)."""
    users, table, exclude, _ = case("clustered")
    config = kernels.LaunchConfig(16, 256, 16, num_warps=4, branch=True)  # no PTX on CPU
    got_s, got_i, _ = kernels.launch_retrieval(
        users.bfloat16(), table.bfloat16(), exclude, 96, FIRST, config, programs=3
    )
    want_s, want_i = oracle(users @ table.t(), exclude, 96, FIRST)
    assert torch.equal(got_i, want_i) and torch.equal(got_s, want_s)


def test_op_equals_exact_top_k_on_the_interpreter(kernels: Any) -> None:
    users, table, exclude, k = case("random", seed=1)
    got = kernels.fused_retrieve(users.bfloat16(), table.bfloat16(), exclude, k, FIRST)
    want_s, want_i = oracle(users @ table.t(), exclude, k, FIRST)
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[1], want_i)
    assert torch.equal(got[0], want_s.bfloat16())


# ------------------------------------------------------------------ gpu

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2.0**-8}
NUM_ITEMS = 1_000_000
DIM = 512
K = 256


CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def catalog() -> dict[torch.dtype, torch.Tensor]:
    """The reference catalog: 1M normalised rows of 512, fp32 and bf16."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    table = F.normalize(torch.randn(NUM_ITEMS, DIM, device="cuda", generator=gen), dim=-1)
    return {torch.float32: table, torch.bfloat16: table.bfloat16()}


def users_and_exclusions(
    table: torch.Tensor, batch: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised users and 16 exclusions each: their 8 best rows, 8 random, some -1."""
    dev = table.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    users = F.normalize(torch.randn(batch, table.shape[1], device=dev, generator=gen), dim=-1)
    users = users.to(table.dtype)
    none = torch.full((batch, 1), -1, device=dev)
    best = retrieve_reference(users, table, none, 8, FIRST)[1]
    rand = torch.randint(-1, table.shape[0], (batch, 8), device=dev, generator=gen)
    return users, torch.cat([best, rand], dim=1)


def assert_top_k(
    users: torch.Tensor,
    table: torch.Tensor,
    exclude: torch.Tensor,
    got: tuple[torch.Tensor, torch.Tensor],
    k: int,
) -> int:
    """The checks of the module docstring; returns how many rows differ from topk's."""
    tol = TOLERANCE[users.dtype]
    want_s, want_i = retrieve_reference(users, table, exclude, k, FIRST)
    got_s, got_i = got
    assert got_s.shape == want_s.shape and got_s.dtype == users.dtype
    assert got_i.dtype == torch.int64
    assert bool((got_s[:, :-1] >= got_s[:, 1:]).all()), "not sorted"
    assert bool((got_i >= FIRST).all()) and bool((got_i < table.shape[0]).all())
    for row in range(got_i.shape[0]):
        assert not bool(torch.isin(got_i[row], exclude[row]).any()), f"excluded row {row}"
        assert got_i[row].unique().numel() == k
    exact = (users.double().unsqueeze(1) * table[got_i].double()).sum(-1)  # [B, k]
    assert float((got_s.double() - exact).abs().max()) <= tol
    assert float((got_s.double() - want_s.double()).abs().max()) <= tol
    differ = 0
    kth = want_s[:, -1].double()
    for row in range(got_i.shape[0]):
        extra = set(got_i[row].tolist()) - set(want_i[row].tolist())
        differ += len(extra)
        if extra:  # ties at the boundary only
            rows = torch.tensor(sorted(extra), device=table.device)
            score = (users[row].double() * table[rows].double()).sum(-1)
            assert float((score - kth[row]).abs().max()) <= tol, f"row {row}: {extra}"
    return differ


@pytest.mark.gpu
@CUDA_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 64, 256])
@torch.no_grad()
def test_fused_equals_mm_topk_over_1m_items(
    catalog: dict[torch.dtype, torch.Tensor], batch: int, dtype: torch.dtype
) -> None:
    """The op (the fused kernels), their flat select loop, and the score scan."""
    from streamrec.models.retrieval import (
        default_config,
        fused_retrieve,
        launch_retrieval,
        resident_config,
    )
    from streamrec.models.score_scan import launch_score_scan

    table = catalog[dtype]
    users, exclude = users_and_exclusions(table, batch, seed=batch)
    assert fused_retrieval_enabled("auto", users, table, K, FIRST)
    got = fused_retrieve(users, table, exclude, K, FIRST)
    differ = assert_top_k(users, table, exclude, got, K)
    branched = dataclasses.replace(default_config(batch, dtype, DIM), branch=True)
    br_s, br_i, _ = launch_retrieval(users, table, exclude, K, FIRST, branched)
    branch_differ = assert_top_k(users, table, exclude, (br_s.to(dtype), br_i), K)
    flat = dataclasses.replace(default_config(batch, dtype, DIM), flat=True)
    flat_s, flat_i, _ = launch_retrieval(users, table, exclude, K, FIRST, flat)
    flat_differ = assert_top_k(users, table, exclude, (flat_s.to(dtype), flat_i), K)
    scan_s, scan_i, scan_counts = launch_score_scan(users, table, exclude, K, FIRST)
    scan_differ = assert_top_k(users, table, exclude, (scan_s.to(dtype), scan_i), K)
    resident = resident_config(batch, dtype, DIM)
    resident_differ = -1
    if resident is not None:  # bf16: the users' tile in shared memory
        res_s, res_i, _ = launch_retrieval(users, table, exclude, K, FIRST, resident)
        resident_differ = assert_top_k(users, table, exclude, (res_s.to(dtype), res_i), K)
    counts = launch_retrieval(users, table, exclude, K, FIRST)[2].sum(1).float()
    scan_counts = scan_counts.sum(1).float()
    print(
        f"B={batch} {dtype}: rows differing from topk (boundary ties): op {differ}, flat "
        f"{flat_differ}, branch {branch_differ}, resident {resident_differ}, scan "
        f"{scan_differ} of {batch * K}; "
        "candidates per user mean (max): "
        f"scan {scan_counts.mean():.0f} ({scan_counts.max():.0f}), fused "
        f"{counts.mean():.0f} ({counts.max():.0f})"
    )


@pytest.mark.gpu
@CUDA_ONLY
@pytest.mark.parametrize("k", [1, 2, 3])
@torch.no_grad()
def test_fused_top_few_equal_mm_topk(catalog: dict[torch.dtype, torch.Tensor], k: int) -> None:
    """Greedy generation retrieves k = 1 (a one-lane tl.topk failed to compile on the
    H200 before the kernels kept at least two lanes); the resident select too."""
    from streamrec.models.retrieval import fused_retrieve, launch_retrieval, resident_config

    table = catalog[torch.bfloat16]
    users, exclude = users_and_exclusions(table, 64, seed=k)
    assert fused_retrieval_enabled("auto", users, table, k, FIRST)
    assert_top_k(users, table, exclude, fused_retrieve(users, table, exclude, k, FIRST), k)
    resident = resident_config(320, torch.bfloat16, DIM)  # the verify's 5 rows per user
    assert resident is not None
    many, many_ex = users_and_exclusions(table, 320, seed=k + 10)
    got_s, got_i, _ = launch_retrieval(many, table, many_ex, k, FIRST, resident)
    assert_top_k(many, table, many_ex, (got_s.bfloat16(), got_i), k)


@pytest.mark.gpu
@CUDA_ONLY
@torch.no_grad()
def test_fused_orders_ties_by_index_through_compaction() -> None:
    """3,000 copies of user 0's direction (one chunk's region overflows and is compacted)
    and a zero user (every score 0): both get the lowest non-excluded rows in order."""
    from streamrec.models.retrieval import fused_retrieve, launch_retrieval, resident_config

    gen = torch.Generator(device="cuda").manual_seed(1)
    table = F.normalize(torch.randn(200_000, 128, device="cuda", generator=gen), dim=-1)
    users = F.normalize(torch.randn(3, 128, device="cuda", generator=gen), dim=-1)
    start = FIRST + 5_000
    table[start : start + 3_000] = users[0]
    users[1] = 0
    table, users = table.bfloat16(), users.bfloat16()
    exclude = torch.tensor([[start + 3, start + 7], [FIRST, FIRST + 10], [-1, -1]], device="cuda")
    scores, idx = fused_retrieve(users, table, exclude, K, FIRST)
    rows0 = [r for r in range(start, start + K + 2) if r not in (start + 3, start + 7)][:K]
    assert idx[0].tolist() == rows0 and bool((scores[0] == scores[0, 0]).all())
    rows1 = [r for r in range(FIRST, FIRST + K + 2) if r not in (FIRST, FIRST + 10)][:K]
    assert idx[1].tolist() == rows1 and bool((scores[1] == 0).all())
    assert_top_k(users[2:], table, exclude[2:], (scores[2:], idx[2:]), K)
    resident = resident_config(3, torch.bfloat16, 128)  # the same ties, resident select
    assert resident is not None
    res_s, res_i, _ = launch_retrieval(users, table, exclude, K, FIRST, resident)
    assert torch.equal(res_i, idx) and torch.equal(res_s.bfloat16(), scores)


@pytest.mark.gpu
@CUDA_ONLY
@torch.no_grad()
def test_fused_replays_in_a_cuda_graph(catalog: dict[torch.dtype, torch.Tensor]) -> None:
    from streamrec.models.retrieval import fused_retrieve

    table = catalog[torch.bfloat16]
    users, exclude = users_and_exclusions(table, 64, seed=7)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_retrieve(users, table, exclude, K, FIRST)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_retrieve(users, table, exclude, K, FIRST)
    fresh, fresh_ex = users_and_exclusions(table, 64, seed=8)
    users.copy_(fresh)
    exclude.copy_(fresh_ex)
    graph.replay()
    want = fused_retrieve(fresh, table, fresh_ex, K, FIRST)
    assert torch.equal(out[1], want[1]) and torch.equal(out[0], want[0])


def _cuda_model(num_items: int) -> HSTU:
    torch.manual_seed(0)
    cfg = HSTUConfig(num_items=num_items, d_model=64, dtype="bfloat16")
    return HSTU(cfg).eval().to("cuda", torch.bfloat16)


@pytest.mark.gpu
@CUDA_ONLY
@torch.no_grad()
def test_hstu_retrieve_runs_the_fused_op_on_cuda() -> None:
    model = _cuda_model(100_000)
    table = model.retrieval_table.get(model.item_emb.weight)
    users, exclude = users_and_exclusions(model.item_table(), 32, seed=3)
    assert fused_retrieval_enabled(model.attention_backend, users, table, 64, FIRST)
    got = model.retrieve(users, 64, exclude)
    assert model.retrieval_table.get(model.item_emb.weight) is table  # cached
    assert_top_k(users, model.item_table(), exclude, got, 64)


@pytest.mark.gpu
@CUDA_ONLY
def test_aoti_package_of_fused_retrieve(tmp_path: Path) -> None:
    from streamrec.models.aoti_export import ExportConfig, compile_entry_point

    model = _cuda_model(40_000)
    config = ExportConfig(entry_points=("retrieve",), retrieve_k=64)
    path = tmp_path / "retrieve.pt2"
    times = compile_entry_point(model, "retrieve", config, torch.device("cuda"), path)
    runner = torch._inductor.aoti_load_package(str(path))
    print(f"aoti retrieve with the fused op: {times}")
    for batch, width in ((1, 2), (5, 9)):
        users, exclude = users_and_exclusions(model.item_table(), batch, seed=batch)
        with torch.no_grad():
            got = runner(users, exclude[:, :width].contiguous())
        assert_top_k(users, model.item_table(), exclude[:, :width], tuple(got), 64)


def test_select_chunks_plan_a_symbolic_batch_as_one_user_tile() -> None:
    from streamrec.models.retrieval import select_chunks

    tiles = 7_813  # 1M items in tiles of 128
    # One user tile: about two programs per SM of 132 (30 tiles each, 261 chunks).
    assert select_chunks(1, tiles, 264) == (261, 30)
    # A symbolic batch (not an int under export) is planned the same way.
    assert select_chunks(object(), tiles, 264) == (261, 30)  # type: ignore[arg-type]
    # Four user tiles share the programs; the cap and the tile count bound the chunks.
    assert select_chunks(4, tiles, 264) == (66, 119)
    assert select_chunks(1, tiles, 100_000)[0] <= 1024 and select_chunks(1, 10, 264) == (10, 1)
