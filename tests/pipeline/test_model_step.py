"""ModelStep: a batch's outputs belong to its users whatever mix of rebuilt and cached
users it holds, in whatever order (the embeddings come back per call and are reordered
once)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_tiers import KVTiers
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.pipeline.model_step import ModelStep, UserWork
from streamrec.pipeline.scorer import Scorer
from streamrec.pipeline.scoring_config import ScoringConfig

CFG = HSTUConfig(
    num_items=300, num_oov_buckets=4, d_model=32, num_layers=2, num_heads=2, head_dim=16,
    max_seq_len=64, num_time_buckets=16,
)  # fmt: skip


def _step(model: HSTU) -> ModelStep:
    geo = KVCacheConfig(CFG.num_layers, CFG.num_heads, CFG.head_dim, 4, torch.float32)
    cache = KVCache(geo, 200, "cpu")
    tiers = KVTiers(cache, None, CFG.max_seq_len)
    scoring = ScoringConfig(top_k=8, num_candidates=20, exclude_recent=3)
    return ModelStep(model, tiers, Scorer(model, cache, scoring, CFG.task_names), cache.device)


def _tokens(rng: np.random.Generator, n: int, t0: int) -> np.ndarray:
    items = rng.integers(CFG.first_item_row, CFG.num_items, n)
    ts = t0 + np.arange(n, dtype=np.int64) * 60_000
    return np.stack([items, rng.integers(1, 4, n), ts], axis=1).astype(np.int64)


@torch.no_grad()
def test_mixed_rebuilt_and_cached_users_get_their_own_outputs() -> None:
    torch.manual_seed(0)
    model = HSTU(CFG).eval()
    rng = np.random.default_rng(1)
    first = {u: _tokens(rng, n, 1_700_000_000_000) for u, n in (("a", 9), ("b", 30), ("e", 2))}
    later = {u: _tokens(rng, n, 1_700_100_000_000) for u, n in (("a", 1), ("b", 3), ("e", 2))}
    fresh = {u: _tokens(rng, n, 1_700_000_000_000) for u, n in (("c", 12), ("d", 1))}

    def work(user: str, cached: bool) -> UserWork:
        tokens = later[user] if cached else (first | fresh)[user]
        return UserWork(user, tokens, not cached, tokens[-3:, 0].copy(), 0)

    mixed, apart = _step(model), _step(model)
    for step in (mixed, apart):
        step.run([work(u, False) for u in first])
    order = [work("b", True), work("c", False), work("a", True), work("d", False),
             work("e", True)]  # fmt: skip
    got = {o.user_id: o for o in mixed.run(order)[0]}
    assert [o.user_id for o in mixed.run([])[0]] == []
    want = {}
    for w in order:  # one user per step: nothing to reorder
        (out,) = apart.run([w])[0]
        want[out.user_id] = out
    assert list(got) == [w.user_id for w in order]
    for user, out in want.items():
        np.testing.assert_array_equal(got[user].items, out.items)
        np.testing.assert_allclose(got[user].scores, out.scores, rtol=1e-5, atol=1e-6)
        assert got[user].task_scores is not None and out.task_scores is not None
        np.testing.assert_allclose(got[user].task_scores, out.task_scores, rtol=1e-5, atol=1e-6)


class _CountingHSTU(HSTU):
    """The model, counting its prefill calls and the users in each."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__(config)
        self.prefill_users: list[int] = []

    def prefill(
        self, items: torch.Tensor, actions: torch.Tensor, ts: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.prefill_users.append(offsets.shape[0] - 1)
        return super().prefill(items, actions, ts, offsets)


@torch.no_grad()
@pytest.mark.parametrize(("call_tokens", "jagged_calls"), [(32_768, [3]), (220, [2, 1])])
def test_jagged_prefill_rebuilds_every_length_class_in_one_call(
    call_tokens: int, jagged_calls: list[int]
) -> None:
    """A dense prefill goes per power-of-two length class; a jagged one pads nothing, so
    the step makes one call (cut only at ``prefill_call_tokens``), with the same outputs."""
    cfg = dataclasses.replace(CFG, max_seq_len=256)
    torch.manual_seed(0)
    weights = HSTU(cfg).state_dict()
    rng = np.random.default_rng(2)
    lengths = {"short": 10, "long": 200, "mid": 40}  # classes 7, 8, 7
    tokens = {u: _tokens(rng, n, 1_700_000_000_000) for u, n in lengths.items()}
    work = [UserWork(u, t, True, t[-3:, 0].copy(), 0) for u, t in tokens.items()]
    outputs = {}
    for jagged in (False, True):
        model = _CountingHSTU(cfg).eval()
        model.load_state_dict(weights)
        geo = KVCacheConfig(cfg.num_layers, cfg.num_heads, cfg.head_dim, 4, torch.float32)
        cache = KVCache(geo, 200, "cpu")
        scoring = ScoringConfig(top_k=8, num_candidates=20, exclude_recent=3)
        step = ModelStep(
            model, KVTiers(cache, None, cfg.max_seq_len), Scorer(model, cache, scoring,
            cfg.task_names), cache.device, jagged_prefill=jagged, prefill_call_tokens=call_tokens,
        )  # fmt: skip
        outputs[jagged] = {o.user_id: o for o in step.run(work)[0]}
        assert model.prefill_users == (jagged_calls if jagged else [2, 1])
    assert list(outputs[True]) == list(lengths)
    for user, want in outputs[False].items():
        np.testing.assert_array_equal(outputs[True][user].items, want.items)
        np.testing.assert_allclose(outputs[True][user].scores, want.scores, rtol=1e-5, atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize(("jagged", "calls"), [(True, [3]), (False, [])])
def test_prefill_warm_up_makes_one_full_call_and_leaves_the_cache_alone(
    jagged: bool, calls: list[int]
) -> None:
    """The start-up warm-up is one jagged call of ``prefill_call_tokens`` tokens (users of
    ``max_seq_len``, the rest in a last one), and no user enters the cache; a dense
    prefill has no single largest call, so it is skipped."""
    model = _CountingHSTU(CFG).eval()
    geo = KVCacheConfig(CFG.num_layers, CFG.num_heads, CFG.head_dim, 4, torch.float32)
    cache = KVCache(geo, 200, "cpu")
    free = cache.pool.num_free
    scoring = ScoringConfig(top_k=8, num_candidates=20, exclude_recent=3)
    step = ModelStep(
        model, KVTiers(cache, None, CFG.max_seq_len), Scorer(model, cache, scoring,
        CFG.task_names), cache.device, jagged_prefill=jagged, prefill_call_tokens=150,
    )  # fmt: skip
    assert step.warm_up_prefill(CFG.max_seq_len, CFG.first_item_row) == (150 if jagged else 0)
    assert model.prefill_users == calls  # 64 + 64 + 22 tokens
    assert cache.pool.num_free == free
    assert len(cache.pool) == 0
