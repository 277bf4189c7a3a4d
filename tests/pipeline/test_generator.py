"""Next-k generation: autoregressive equals a full recompute per item, speculative greedy
equals autoregressive greedy exactly (fp32, CPU), and the user's cache is never written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrec.errors import ConfigError, PipelineError
from streamrec.pipeline.generation_config import GenerationConfig
from streamrec.pipeline.generator import Generator
from streamrec.schemas.events import Action
from tests.pipeline.generation_fixtures import CachedUsers, gen_model, random_hstu, recompute_next


def _generator(target, users: CachedUsers, config: GenerationConfig, draft=None) -> Generator:
    return Generator(
        gen_model(target), users.cache.kv, users.cache.ts, config,
        None if draft is None else gen_model(draft),
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(3))
def test_autoregressive_greedy_equals_full_recompute(seed: int) -> None:
    model = random_hstu(seed)
    users = CachedUsers(model, [1, 7, 12, 4], seed)
    cfg = GenerationConfig(k=6, time_step_ms=45_000, action="like")
    before = (users.cache.kv.clone(), users.cache.ts.clone())
    out = _generator(model, users, cfg).generate(users.inputs())
    assert out.items.shape == (4, 6) and out.scores.shape == (4, 6)
    table = model.item_table().detach()
    for b, history in enumerate(users.histories):
        generated: list[int] = []
        for i in range(cfg.k):
            emb = recompute_next(model, history, generated, cfg.time_step_ms, cfg.action_id)
            scores = table @ emb
            scores[: model.config.first_item_row] = float("-inf")
            scores[history[-users.consumed :, 0]] = float("-inf")  # consumed
            scores[generated] = float("-inf")  # no item twice
            assert int(out.items[b, i]) == int(scores.argmax()), (b, i)
            assert abs(float(out.scores[b, i]) - float(scores.max())) < 1e-5
            generated.append(int(out.items[b, i]))
    assert torch.equal(users.cache.kv, before[0]) and torch.equal(users.cache.ts, before[1])


@pytest.mark.parametrize(
    ("seed", "k", "gamma", "draft_layers"),
    [(0, 8, 3, 1), (1, 12, 4, 1), (2, 5, 1, 2), (3, 10, 6, 1), (4, 2, 2, 1)],
)
def test_speculative_greedy_is_the_target_greedy_exactly(
    seed: int, k: int, gamma: int, draft_layers: int
) -> None:
    target = random_hstu(seed, num_layers=3)
    draft = random_hstu(100 + seed, num_layers=draft_layers, max_seq_len=40)
    users = CachedUsers(target, [3, 9, 1, 15, 6], seed)
    cfg = GenerationConfig(k=k, gamma=gamma)
    plain = _generator(target, users, cfg).generate(users.inputs())
    before = (users.cache.kv.clone(), users.cache.ts.clone())
    spec = _generator(target, users, cfg, draft)
    window = spec.window
    got = spec.generate(users.inputs(window))
    np.testing.assert_array_equal(got.items, plain.items)
    np.testing.assert_allclose(got.scores, plain.scores, rtol=0, atol=1e-5)
    assert torch.equal(users.cache.kv, before[0]) and torch.equal(users.cache.ts, before[1])
    stats = spec.stats
    assert stats.tokens == 5 * k and stats.users == 5
    assert stats.rounds <= k - 1 and stats.target_calls == 1 + stats.rounds
    assert 0 <= stats.accepted <= stats.proposed


def test_a_draft_that_agrees_saves_target_calls() -> None:
    """A draft equal to the target (histories within its window) is always right: each
    round keeps all γ items plus one, so k items take ceil((k - 1) / (γ + 1)) rounds."""
    target = random_hstu(5, num_layers=2, max_seq_len=48)
    users = CachedUsers(target, [4, 6, 2], seed=5)
    cfg = GenerationConfig(k=11, gamma=4)
    plain = _generator(target, users, cfg).generate(users.inputs())
    spec = _generator(target, users, cfg, draft=target)
    got = spec.generate(users.inputs(spec.window))
    np.testing.assert_array_equal(got.items, plain.items)
    assert spec.stats.rounds == 2 and spec.stats.acceptance_rate == 1.0


def test_rows_that_finish_early_leave_the_batch_and_the_output_is_unchanged() -> None:
    """A draft equal to the target is always right on users whose history fits its window
    (they finish in two rounds) and often wrong on longer ones: once only those are left
    the generator moves them into a smaller workspace, and greedy output stays the
    target's own, item for item and score for score."""
    target = random_hstu(8, num_layers=2, max_seq_len=48)
    users = CachedUsers(target, [4, 6, 2, 44, 3, 5, 2, 40], seed=8)
    cfg = GenerationConfig(k=11, gamma=4)
    plain = _generator(target, users, cfg).generate(users.inputs())
    spec = _generator(target, users, cfg, draft=target)
    got = spec.generate(users.inputs(spec.window))
    np.testing.assert_array_equal(got.items, plain.items)
    np.testing.assert_allclose(got.scores, plain.scores, rtol=0, atol=1e-5)
    assert spec.stats.compactions >= 1 and spec.stats.rounds > 2
    assert 0 < spec.stats.accepted < spec.stats.proposed  # the long rows were refused some
    again = spec.generate(users.inputs(spec.window))  # workspaces reused: same answer
    np.testing.assert_array_equal(again.items, plain.items)
    whole = Generator(gen_model(target), users.cache.kv, users.cache.ts, cfg, gen_model(target),
                      compact=False)  # fmt: skip
    kept = whole.generate(users.inputs(whole.window))
    np.testing.assert_array_equal(kept.items, plain.items)
    assert whole.stats.compactions == 0 and whole.stats.rounds == spec.stats.rounds // 2
    assert whole.stats.row_rounds == 8 * whole.stats.rounds  # every round over all 8 rows
    assert spec.stats.row_rounds < 2 * whole.stats.row_rounds  # spec ran twice


def test_exclusion_of_consumed_items_is_optional() -> None:
    model = random_hstu(6, num_items=24)
    users = CachedUsers(model, [20, 20], seed=6, consumed=20)
    consumed = {int(i) for h in users.histories for i in h[:, 0]}
    on = _generator(model, users, GenerationConfig(k=3)).generate(users.inputs())
    off = _generator(model, users, GenerationConfig(k=3, exclude_consumed=False))
    out = off.generate(users.inputs())
    for b, h in enumerate(users.histories):
        assert not set(on.items[b].tolist()) & set(h[:, 0].tolist())
        assert len(set(out.items[b].tolist())) == 3  # still never the same item twice
    assert set(out.items.ravel().tolist()) & consumed  # some consumed item came back


def test_batches_larger_than_the_row_limit_are_split() -> None:
    model = random_hstu(7)
    users = CachedUsers(model, [5, 3, 8, 2, 6], seed=7)
    cfg = GenerationConfig(k=4)
    whole = _generator(model, users, cfg).generate(users.inputs())
    split = Generator(gen_model(model), users.cache.kv, users.cache.ts, cfg, max_rows=2)
    np.testing.assert_array_equal(split.generate(users.inputs()).items, whole.items)


def test_configuration_errors_name_the_value() -> None:
    with pytest.raises(ConfigError, match="gamma = 0"):
        GenerationConfig(k=3, gamma=0)
    with pytest.raises(ConfigError, match="action = 'candidate'"):
        GenerationConfig(k=3, action="candidate")
    with pytest.raises(ConfigError, match=r"top_p = 1\.5"):
        GenerationConfig(k=3, top_p=1.5)
    assert GenerationConfig().candidates == 1
    assert GenerationConfig(temperature=0.5, sample_pool=16).candidates == 16
    assert GenerationConfig(action="like").action_id == int(Action.LIKE)
    target = random_hstu(8)
    users = CachedUsers(target, [3], seed=8)
    short = random_hstu(9, max_seq_len=12)
    with pytest.raises(ConfigError, match="max_seq_len = 12"):
        _generator(target, users, GenerationConfig(k=8, gamma=4), short)
    with pytest.raises(ConfigError, match="k = 0"):
        _generator(target, users, GenerationConfig(k=0))
    spec = _generator(target, users, GenerationConfig(k=3), random_hstu(10))
    with pytest.raises(PipelineError, match="window"):
        spec.generate(users.inputs())
