"""GraphedModel: padding to a bucket changes nothing; replayed graphs equal eager calls.

The CPU tests run the padded calls eagerly (``capture=False``), which is where the
padding logic lives; the ``gpu`` tests capture and replay real CUDA graphs, of the eager
module and of the AOTI package (whose input checks run before each replay).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrec.errors import ConfigError, ModelError
from streamrec.models.checkpoint import load_checkpoint
from streamrec.models.config import HSTUConfig
from streamrec.pipeline.graphed_model import GraphConfig, GraphedModel, bucket_ladder
from streamrec.schemas.events import NUM_ACTIONS
from tests.models.aoti_fixtures import cuda_aoti_model, make_batch, tiny_aoti_model, tiny_model_dir
from tests.models.paged import FakePagedCache
from tests.models.test_hstu import filled_cache, jagged, random_history, random_model, rel_err

BLOCK = 4
TOL = 1e-5


def _setup(seed: int, cached: list[int], device: str = "cpu"):
    model = random_model(seed).to(device)
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    hist = [random_history(cfg, cfg.max_seq_len, gen) for _ in cached]
    cache = filled_cache(model.cpu(), hist, cached, block_size=BLOCK, seed=seed)
    model.to(device)
    cache.kv, cache.ts = cache.kv.to(device), cache.ts.to(device)
    return model, cache, hist, gen


def _graphed(model, cache: FakePagedCache, cands: int, capture: bool) -> GraphedModel:
    cfg = GraphConfig(
        max_blocks=model.config.max_seq_len // BLOCK + 2,
        num_candidates=cands,
        buckets=(1, 2, 8),
        capture=capture,
    )
    return GraphedModel(model, cache.kv, cache.ts, cfg)


def _extend_args(model, cache, hist, cached, new, device="cpu"):
    tables, lens = cache.batch_tables()
    items, actions, ts, offsets = jagged(hist, new, cached)
    args = (items, actions, ts, offsets, cache.kv, cache.ts, tables, lens)
    return tuple(a.to(device) for a in args)


@pytest.mark.parametrize("seed", range(3))
@torch.no_grad()
def test_padded_extend_and_rank_equal_the_plain_calls(seed: int) -> None:
    cached, new = [0, 3, 7, 1, 10], [1, 2, 1, 1, 1]  # 6 tokens, 5 users -> bucket 8
    model, cache, hist, gen = _setup(seed, cached)
    graphed = _graphed(model, cache, cands=6, capture=False)
    args = _extend_args(model, cache, hist, cached, new)
    for got, want in zip(graphed.extend(*args), model.extend(*args), strict=True):
        assert got.shape == want.shape
        assert rel_err(got, want) < TOL
    cand = torch.randint(1, model.config.num_items, (len(cached), 6), generator=gen)
    query_ts = args[2][args[3][1:] - 1]  # each user's newest timestamp
    rank_args = (cand, query_ts, cache.kv, cache.ts, args[6], args[7])
    got_r, want_r = graphed.rank(*rank_args), model.rank(*rank_args)
    assert got_r.shape == want_r.shape == (len(cached), 6, model.config.num_tasks)
    assert rel_err(got_r, want_r) < TOL
    assert graphed.stats.by_bucket == {"extend/8": 1, "rank/8": 1}
    assert graphed.stats.eager_calls == 0


@torch.no_grad()
def test_calls_that_fit_no_graph_run_eagerly() -> None:
    cached = [2] * 9
    model, cache, hist, gen = _setup(1, cached)
    graphed = _graphed(model, cache, cands=4, capture=False)
    args = _extend_args(model, cache, hist, cached, [1] * 9)  # 9 tokens > the last bucket
    for got, want in zip(graphed.extend(*args), model.extend(*args), strict=True):
        assert torch.equal(got, want)
    cand = torch.randint(1, model.config.num_items, (2, 5), generator=gen)  # C=5, not 4
    ts = args[2][:2]
    got = graphed.rank(cand, ts, cache.kv, cache.ts, args[6][:2], args[7][:2])
    assert torch.equal(got, model.rank(cand, ts, cache.kv, cache.ts, args[6][:2], args[7][:2]))
    other_pool = cache.kv.clone()  # not the captured pool: eager as well
    graphed.rank(cand[:, :4], ts, other_pool, cache.ts, args[6][:2], args[7][:2])
    assert graphed.stats.eager_calls == 3
    assert graphed.stats.by_bucket == {}


@torch.no_grad()
def test_users_without_new_tokens_get_a_bucket_of_their_number() -> None:
    cached, new = [3, 5, 2, 4], [1, 0, 0, 1]  # 2 tokens, 4 users -> bucket 8 (not 2)
    model, cache, hist, _ = _setup(4, cached)
    graphed = _graphed(model, cache, cands=2, capture=False)
    args = _extend_args(model, cache, hist, cached, new)
    for got, want in zip(graphed.extend(*args), model.extend(*args), strict=True):
        assert got.shape == want.shape and rel_err(got, want) < TOL
    assert graphed.stats.by_bucket == {"extend/8": 1}


def test_bucket_ladder_pads_at_most_a_quarter_above_32() -> None:
    ladder = bucket_ladder(4096)
    assert ladder[:9] == (1, 2, 4, 8, 16, 32, 40, 48, 56)
    assert ladder[-1] == 4096 and list(ladder) == sorted(set(ladder))
    for n in range(33, 4097):  # the bucket a batch of n rows runs as
        bucket = next(b for b in ladder if b >= n)
        assert bucket <= 1.25 * n, (n, bucket)
    assert bucket_ladder(256, per_octave=1) == DEFAULT_POWERS
    assert bucket_ladder(137)[-1] == 160  # the first bucket holding the limit
    with pytest.raises(ConfigError, match="per_octave=0"):
        bucket_ladder(64, per_octave=0)


@torch.no_grad()
def test_a_bucket_between_powers_of_two_pads_like_any_other() -> None:
    cached, new = [0, 3, 7, 1, 10], [1, 2, 1, 1, 1]  # 6 tokens, 5 users -> bucket 6
    model, cache, hist, gen = _setup(5, cached)
    cfg = GraphConfig(
        max_blocks=model.config.max_seq_len // BLOCK + 2, num_candidates=3,
        buckets=(1, 2, 4, 5, 6), capture=False,
    )  # fmt: skip
    graphed = GraphedModel(model, cache.kv, cache.ts, cfg)
    args = _extend_args(model, cache, hist, cached, new)
    for got, want in zip(graphed.extend(*args), model.extend(*args), strict=True):
        assert got.shape == want.shape and rel_err(got, want) < TOL
    cand = torch.randint(1, model.config.num_items, (len(cached), 3), generator=gen)
    rank_args = (cand, args[2][args[3][1:] - 1], cache.kv, cache.ts, args[6], args[7])
    assert rel_err(graphed.rank(*rank_args), model.rank(*rank_args)) < TOL
    assert graphed.stats.by_bucket == {"extend/6": 1, "rank/5": 1}


DEFAULT_POWERS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def test_config_names_bad_values() -> None:
    with pytest.raises(ConfigError, match=r"buckets=\(4, 2\)"):
        GraphConfig(max_blocks=4, num_candidates=2, buckets=(4, 2))
    with pytest.raises(ConfigError, match="max_blocks=0"):
        GraphConfig(max_blocks=0, num_candidates=2)


@pytest.mark.gpu
@torch.no_grad()
def test_replayed_graphs_equal_eager_calls_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cached = [0, 3, 7, 1, 10]
    model, cache, hist, gen = _setup(2, cached, device="cuda")
    graphed = _graphed(model, cache, cands=6, capture=True)
    graphed.warm_up()
    assert graphed.stats.captures == 6  # 3 buckets x (extend, rank)
    for new in ([1, 2, 1, 1, 1], [2, 1, 1, 1, 1], [1, 1, 1, 1, 1]):  # same bucket, new data
        args = _extend_args(model, cache, hist, cached, new, device="cuda")
        for got, want in zip(graphed.extend(*args), model.extend(*args), strict=True):
            assert rel_err(got, want) < 1e-4
        cand = torch.randint(1, model.config.num_items, (len(cached), 6), generator=gen).cuda()
        rank_args = (cand, args[2][args[3][1:] - 1], cache.kv, cache.ts, args[6], args[7])
        assert rel_err(graphed.rank(*rank_args), model.rank(*rank_args)) < 1e-4
    assert graphed.stats.replays == 6
    assert graphed.stats.eager_calls == 0


# ------------------------------------------------------------ the AOTI backend


def _new_tokens(cfg: HSTUConfig, new: list[int], gen: torch.Generator, device: str):
    total = sum(new)
    items = torch.randint(1, cfg.num_items, (total,), generator=gen)
    actions = torch.randint(1, NUM_ACTIONS, (total,), generator=gen)
    ts = 1_800_000_000_000 + torch.randint(0, 10**6, (total,), generator=gen).cumsum(0)
    offsets = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int64)
    return tuple(t.to(device) for t in (items, actions, ts, offsets))


@pytest.mark.slow
@pytest.mark.usefixtures("serving_prebuilt")
@torch.no_grad()
def test_aoti_backend_is_padded_and_checked_before_the_graph(tmp_path: Path) -> None:
    checkpoint = load_checkpoint(tiny_model_dir(tmp_path / "m"))
    eager = checkpoint.model
    aoti = tiny_aoti_model(checkpoint)  # the tests' serving package (background build)
    batch = make_batch(eager, [0, 3, 7, 1, 10], [1, 2, 1, 1, 1], seed=5)  # 6 tokens: bucket 8
    config = GraphConfig(
        max_blocks=eager.config.max_seq_len // 4 + 2, num_candidates=3, buckets=(1, 2, 8),
        capture=False,
    )  # fmt: skip
    graphed = GraphedModel(aoti, batch.kv, batch.ts_pool, config)
    args = batch.extend_args()
    for got, want in zip(graphed.extend(*args), eager.extend(*args), strict=True):
        assert got.shape == want.shape and rel_err(got, want) < TOL
    got_r, want_r = graphed.rank(*batch.rank_args()), eager.rank(*batch.rank_args())
    assert rel_err(got_r, want_r) < TOL
    assert graphed.stats.by_bucket == {"extend/8": 1, "rank/8": 1}
    # Bad batches are refused before anything is copied into the graph's buffers.
    with pytest.raises(ModelError, match="invalid jagged batch: offsets"):
        graphed.extend(*args[:3], torch.tensor([0, 2, 1, 3, 4, 6]), *args[4:])
    too_long = torch.full_like(batch.lens, 10_000)
    with pytest.raises(ModelError, match="cached_lens"):
        graphed.rank(*batch.rank_args()[:5], too_long)
    with pytest.raises(ModelError, match="block_tables"):
        graphed.extend(*args[:6], batch.tables.long(), args[7])
    assert graphed.stats.by_bucket == {"extend/8": 1, "rank/8": 1}
    assert graphed.stats.eager_calls == 0


@pytest.mark.gpu
@torch.no_grad()
def test_aoti_replayed_graphs_equal_eager_calls_on_cuda(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model_dir = tiny_model_dir(tmp_path / "m")
    checkpoint = load_checkpoint(model_dir, "cuda")
    eager = checkpoint.model
    aoti = cuda_aoti_model(checkpoint)
    cached = [0, 3, 7, 1, 10]
    pool = make_batch(load_checkpoint(model_dir).model, cached, [1] * 5, seed=9).to("cuda")
    config = GraphConfig(
        max_blocks=eager.config.max_seq_len // 4 + 2, num_candidates=3, buckets=(1, 2, 8)
    )
    graphed = GraphedModel(aoti, pool.kv, pool.ts_pool, config)
    graphed.warm_up()
    assert graphed.stats.captures == 6 and graphed.stats.failed == []
    gen = torch.Generator().manual_seed(0)
    tail = (pool.kv, pool.ts_pool, pool.tables, pool.lens)
    for new in ([1, 2, 1, 1, 1], [2, 1, 1, 1, 1], [1, 1, 1, 1, 1]):  # same bucket, new data
        args = (*_new_tokens(eager.config, new, gen, "cuda"), *tail)
        for got, want in zip(graphed.extend(*args), eager.extend(*args), strict=True):
            assert rel_err(got, want) < 1e-4
        cand = torch.randint(1, eager.config.num_items, (len(cached), 3), generator=gen).cuda()
        rank_args = (cand, args[2][args[3][1:] - 1], *tail)
        assert rel_err(graphed.rank(*rank_args), eager.rank(*rank_args)) < 1e-4
    assert graphed.stats.replays == 6 and graphed.stats.eager_calls == 0
    with pytest.raises(ModelError, match="invalid jagged batch"):
        bad = torch.tensor([0, 2, 1, 3, 4, 6], device="cuda")
        graphed.extend(*args[:3], bad, *tail)
    assert graphed.stats.replays == 6


def test_retrieve_is_padded_to_its_bucket_and_equals_the_direct_call() -> None:
    model, cache, _, _ = _setup(2, [3, 5, 2])
    graphed = _graphed(model, cache, cands=2, capture=False)
    gen = torch.Generator().manual_seed(4)
    emb = torch.nn.functional.normalize(torch.randn(3, model.config.d_model, generator=gen), dim=-1)
    exclude = torch.tensor([[20, 21], [-1, -1], [22, -1]])
    got = graphed.retrieve(emb, 5, exclude)
    want = model.retrieve(emb, 5, exclude)
    assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0])
    assert list(graphed.stats.by_bucket) == [f"retrieve/{graphed._bucket(3)}"]
    wide = torch.full((3, graphed.config.exclude_width + 1), -1)
    graphed.retrieve(emb, 5, wide)  # wider than any capture: the direct call
    assert graphed.stats.eager_calls == 1


def test_retrieve_pads_with_a_real_users_embedding_not_zeros() -> None:
    """A zero row ties every item at score 0, the fused top-k's worst case."""
    model, cache, _, _ = _setup(2, [3, 5, 2])
    graphed = _graphed(model, cache, cands=2, capture=False)
    seen: list[torch.Tensor] = []
    direct = model.retrieve

    def recording(user_emb: torch.Tensor, k: int, exclude: torch.Tensor):
        seen.append(user_emb.clone())
        return direct(user_emb, k, exclude)

    model.retrieve = recording  # type: ignore[method-assign]
    emb = torch.nn.functional.normalize(torch.randn(3, model.config.d_model), dim=-1)
    graphed.retrieve(emb, 5, torch.full((3, 2), -1))
    (padded,) = seen
    assert padded.shape[0] == graphed._bucket(3) > 3
    assert torch.equal(padded[:3], emb)
    assert torch.equal(padded[3:], emb[:1].expand(padded.shape[0] - 3, -1))


class _CountingChecks:
    """The eager module behind a ``CheckedModel`` face that counts its checks."""

    def __init__(self, model, check_values: bool) -> None:
        self.model, self.check_values, self.checks = model, check_values, 0

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def check_extend(self, *args) -> None:
        self.checks += 1

    def check_rank(self, *args) -> None:
        self.checks += 1

    def unchecked(self):
        return self.model


@pytest.mark.parametrize("check_values", [True, False])
@torch.no_grad()
def test_only_a_value_checking_backend_is_checked_before_each_replay(check_values: bool) -> None:
    cached, new = [0, 3, 7], [1, 2, 1]
    model, cache, hist, gen = _setup(0, cached)
    backend = _CountingChecks(model, check_values)
    graphed = _graphed(backend, cache, cands=4, capture=False)
    args = _extend_args(model, cache, hist, cached, new)
    for got, want in zip(graphed.extend(*args), model.extend(*args), strict=True):
        assert rel_err(got, want) < TOL
    cand = torch.randint(1, model.config.num_items, (len(cached), 4), generator=gen)
    rank_args = (cand, args[2][args[3][1:] - 1], cache.kv, cache.ts, args[6], args[7])
    assert rel_err(graphed.rank(*rank_args), model.rank(*rank_args)) < TOL
    assert backend.checks == (2 if check_values else 0)
    assert graphed.stats.by_bucket == {"extend/8": 1, "rank/8": 1}


# ------------------------------------------------------------ capture order and memory


def test_warm_up_captures_retrieve_rank_extend_each_largest_first() -> None:
    model, cache, _, _ = _setup(0, [3, 5])
    graphed = _graphed(model, cache, cands=2, capture=False)  # buckets (1, 2, 8)
    assert graphed.capture_plan(retrieve=(2, 8)) == [
        ("retrieve", 8), ("retrieve", 2), ("rank", 8), ("rank", 2), ("rank", 1),
        ("extend", 8), ("extend", 2), ("extend", 1),
    ]  # fmt: skip
    shape = (5, model.config.d_model, torch.float32)
    graphed.warm_up(extend=[1, 8], rank=[2], retrieve=([1, 2], *shape))
    assert list(graphed._retrieve) == [2, 1] and list(graphed._rank) == [2]
    assert list(graphed._extend) == [8, 1]
    graphed.capture("extend", 8)  # captured already: nothing happens
    assert list(graphed._extend) == [8, 1] and graphed.capture_stream is None
    with pytest.raises(ConfigError, match="retrieve_shape"):
        graphed.capture("retrieve", 8)
    with pytest.raises(ConfigError, match="unknown entry point 'prefill'"):
        graphed.capture("prefill", 1)


MIB = 1 << 20


class _Transient:
    """extend and rank that free a large temporary per row, as a model's activations do
    (extend: 4 MiB per token, rank: 2 MiB per user)."""

    def extend(self, items, actions, ts, offsets, kv_pool, ts_pool, tables, lens):
        row = torch.ones(items.shape[0], 1 << 20, device=items.device).sum(1)  # [T]
        return row[None], row[None], row[:, None]

    def rank(self, cand, query_ts, kv_pool, ts_pool, tables, lens):
        return torch.ones(cand.shape[0], 1 << 19, device=cand.device).sum(1)[:, None, None]


def _pool_reserved(graphed: GraphedModel) -> int:
    pool = tuple(graphed._pool or ())
    segments = torch.cuda.memory_snapshot()
    return sum(s["total_size"] for s in segments if tuple(s["segment_pool_id"]) == pool)


@pytest.mark.gpu
@torch.no_grad()
def test_captures_share_one_stream_and_reuse_what_the_larger_ones_freed() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kv = torch.zeros(1, 2, 4, BLOCK, 1, 8, device="cuda")
    ts = torch.zeros(4, BLOCK, dtype=torch.int64, device="cuda")
    cfg = GraphConfig(max_blocks=2, num_candidates=1, buckets=(1, 2, 4, 8, 16))
    graphed = GraphedModel(_Transient(), kv, ts, cfg)
    graphed.warm_up(rank=[])
    stream = graphed.capture_stream
    graphed.warm_up(extend=[])
    assert stream is not None and graphed.capture_stream is stream
    assert graphed.stats.captures == 10 and graphed.stats.failed == []
    # extend/16 frees 64 MiB; every later capture (at most 32 MiB) fits in it.
    assert _pool_reserved(graphed) < 80 * MIB
    # Before: smallest first, a stream per capture; nothing freed was reused (4 + ... + 64
    # MiB of extend, 2 + ... + 32 of rank: 186 MiB at least).
    before = GraphedModel(_Transient(), kv, ts, cfg)
    for entry in ("extend", "rank"):
        for bucket in cfg.buckets:
            before.capture_stream = torch.cuda.Stream()
            before.capture(entry, bucket)
    assert _pool_reserved(before) > 180 * MIB
    got = graphed.extend(*(torch.zeros(3, dtype=torch.int64, device="cuda"),) * 3,
                         torch.tensor([0, 3], device="cuda"), kv, ts,
                         torch.zeros(1, 2, dtype=torch.int32, device="cuda"),
                         torch.zeros(1, dtype=torch.int64, device="cuda"))  # fmt: skip
    assert got[2].tolist() == [[float(1 << 20)]] and graphed.stats.replays == 1
