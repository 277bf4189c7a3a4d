"""GraphedModel: padding to a bucket changes nothing; replayed graphs equal eager calls.

The CPU tests run the padded calls eagerly (``capture=False``), which is where the
padding logic lives; the ``gpu`` test captures and replays real CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from streamrec.errors import ConfigError
from streamrec.pipeline.graphed_model import GraphConfig, GraphedModel
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
