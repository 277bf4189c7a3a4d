"""Sampled generation follows the target's distribution, with and without a draft.

One user is replicated into thousands of rows of one batch (all reading the same cached
blocks), so a single ``generate`` call draws thousands of independent continuations with
a fixed seed. Their first three items are compared (chi-square) with the exact
distribution, computed item by item from full recomputes and the same candidate rule.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from streamrec.models.hstu import HSTU
from streamrec.pipeline import generator as generator_module
from streamrec.pipeline.generation_config import GenerationConfig
from streamrec.pipeline.generator import GenerationInputs, Generator
from streamrec.pipeline.sampling import candidate_probs, speculative_accept
from tests.pipeline.generation_fixtures import CachedUsers, gen_model, random_hstu, recompute_next
from tests.pipeline.test_sampling import chi_square_p

pytestmark = pytest.mark.slow
ROWS = 6_000
CONFIG = GenerationConfig(k=3, gamma=2, temperature=0.25, top_p=0.95, sample_pool=6, seed=11)


def _replicated(inputs: GenerationInputs, rows: int) -> GenerationInputs:
    def rep(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:1].expand(rows, *t.shape[1:]).contiguous()

    reps = [rep(t) for t in (inputs.user_emb, inputs.block_tables, inputs.cached_lens,
                             inputs.last_ts, inputs.consumed)]  # fmt: skip
    assert all(t is not None for t in reps)
    return GenerationInputs(*reps, window=rep(inputs.window), window_lens=rep(inputs.window_lens))  # type: ignore[arg-type]


@torch.no_grad()
def _dist(model: HSTU, emb: torch.Tensor, banned: list[int]) -> dict[int, float]:
    exclude = torch.tensor([banned or [-1]])
    scores, ids = model.retrieve(emb.view(1, -1), CONFIG.sample_pool, exclude)
    probs = candidate_probs(scores.float(), CONFIG.temperature, CONFIG.top_p)[0]
    return {int(i): float(p) for i, p in zip(ids[0], probs, strict=True) if p > 0}


def _exact(model: HSTU, users: CachedUsers) -> dict[tuple[int, int, int], float]:
    """P(c1, c2, c3) of the target alone."""
    history = users.histories[0]
    consumed = history[-users.consumed :, 0].tolist()
    step, action = CONFIG.time_step_ms, CONFIG.action_id
    out: dict[tuple[int, int, int], float] = {}
    for c1, p1 in _dist(model, users.user_emb[0], consumed).items():
        emb1 = recompute_next(model, history, [c1], step, action)
        for c2, p2 in _dist(model, emb1, [*consumed, c1]).items():
            emb2 = recompute_next(model, history, [c1, c2], step, action)
            for c3, p3 in _dist(model, emb2, [*consumed, c1, c2]).items():
                out[(c1, c2, c3)] = p1 * p2 * p3
    return out


def _p_value(items: np.ndarray, exact: dict[tuple[int, int, int], float]) -> float:
    cells = sorted(exact)
    index = {cell: n for n, cell in enumerate(cells)}
    counts = torch.zeros(len(cells) + 1)
    for row in items[:, :3].tolist():
        counts[index.get(tuple(row), len(cells))] += 1  # impossible triples: the last cell
    probs = torch.tensor([exact[c] for c in cells] + [0.0])
    if counts[-1] > 0:
        return 0.0
    return chi_square_p(counts, probs)


@pytest.fixture(scope="module")
def setup() -> tuple[HSTU, HSTU, CachedUsers, dict[tuple[int, int, int], float]]:
    target = random_hstu(21, num_items=14)
    draft = random_hstu(22, num_items=14, num_layers=1, max_seq_len=16)
    users = CachedUsers(target, [6], seed=21, consumed=2)
    return target, draft, users, _exact(target, users)


def _sample(
    target: HSTU,
    draft: HSTU | None,
    users: CachedUsers,
    rows: int = ROWS,
    config: GenerationConfig = CONFIG,
) -> tuple[np.ndarray, Generator]:
    gen = Generator(
        gen_model(target), users.cache.kv, users.cache.ts, config,
        None if draft is None else gen_model(draft), max_rows=rows,
    )  # fmt: skip
    inputs = users.inputs(gen.window if draft is not None else None)
    return gen.generate(_replicated(inputs, rows)).items, gen


def test_exact_distribution_is_a_distribution(setup) -> None:
    *_, exact = setup
    assert abs(sum(exact.values()) - 1.0) < 1e-5
    assert len(exact) > 20  # enough cells for the test to say something


def test_autoregressive_sampling_follows_the_target(setup) -> None:
    target, _, users, exact = setup
    items, _ = _sample(target, None, users)
    assert _p_value(items, exact) > 1e-3


def test_speculative_sampling_follows_the_target(setup) -> None:
    target, draft, users, exact = setup
    items, gen = _sample(target, draft, users)
    assert _p_value(items, exact) > 1e-3
    rate = gen.stats.acceptance_rate
    assert 0.05 < rate < 0.95  # the draft really is a different model: both paths taken
    assert all(len(set(row)) == 3 for row in items.tolist())  # never an item twice


def test_compacted_speculative_sampling_follows_the_target(setup) -> None:
    """Longer generations finish at different rounds, so the live rows move into smaller
    workspaces mid-generation (their draws then come in other shapes)."""
    target, draft, users, exact = setup
    items, gen = _sample(target, draft, users, config=replace(CONFIG, k=6))
    assert gen.stats.compactions >= 1
    assert _p_value(items, exact) > 1e-3  # the first three items of each continuation
    assert all(len(set(row)) == 6 for row in items.tolist())


def test_the_check_rejects_a_draft_that_is_always_trusted(setup, monkeypatch) -> None:
    target, draft, users, exact = setup

    def always_keep(draft_items, *args):
        kept, pick = speculative_accept(draft_items, *args)
        return torch.full_like(kept, draft_items.shape[1]), pick

    monkeypatch.setattr(generator_module, "speculative_accept", always_keep)
    items, _ = _sample(target, draft, users)
    assert _p_value(items, exact) < 1e-6


def test_same_seed_same_draws(setup) -> None:
    target, draft, users, _ = setup
    first, _ = _sample(target, draft, users, rows=300)
    again, _ = _sample(target, draft, users, rows=300)
    np.testing.assert_array_equal(first, again)
    assert len({tuple(r) for r in first.tolist()}) > 5
