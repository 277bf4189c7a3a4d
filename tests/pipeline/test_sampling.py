"""The next-item rules: candidate distributions, draws, and both acceptance rules.

Statistical checks use fixed seeds and Pearson's chi-square against the exact
distribution (cells with few expected counts pooled), with a power check: the same test
rejects a deliberately wrong rule.
"""

from __future__ import annotations

import torch

from streamrec.pipeline.sampling import (
    candidate_probs,
    draw,
    greedy_accept,
    speculative_accept,
)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of observed ``counts`` under ``probs`` (small cells pooled into one)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if obs.numel() < 2:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(float(obs.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def test_candidate_probs_temperature_nucleus_and_exclusions() -> None:
    scores = torch.tensor([[2.0, 1.0, 0.0, float("-inf")]])
    full = candidate_probs(scores, 1.0, 1.0)
    want = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), 0)
    torch.testing.assert_close(full[0, :3], want)
    assert full[0, 3] == 0  # excluded
    cut = candidate_probs(scores, 1.0, 0.7)  # 0.665 before the second: kept; third cut
    torch.testing.assert_close(cut[0], torch.cat([want[:2] / want[:2].sum(), torch.zeros(2)]))
    only_best = candidate_probs(scores, 1.0, 0.1)
    torch.testing.assert_close(only_best[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    hot = candidate_probs(scores, 100.0, 1.0)
    assert float(hot[0, :3].max() - hot[0, :3].min()) < 0.01  # near uniform
    nothing = candidate_probs(torch.full((1, 3), float("-inf")), 1.0, 1.0)
    torch.testing.assert_close(nothing[0], torch.tensor([1.0, 0.0, 0.0]))


def test_draw_inverts_the_cdf() -> None:
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25]]).expand(5, -1)
    u = torch.tensor([0.0, 0.49, 0.5, 0.74, 0.99])
    assert draw(probs, u).tolist() == [0, 0, 2, 2, 3]
    gen = torch.Generator().manual_seed(0)
    many = draw(probs[:1].expand(40_000, -1), torch.rand(40_000, generator=gen))
    assert chi_square_p(torch.bincount(many, minlength=4), probs[0]) > 1e-3


def test_greedy_accept_keeps_the_agreeing_prefix() -> None:
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 6, 7], [5, 6, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [5, 6, 7, 8], [5, 6, 2, 8]])
    assert greedy_accept(draft, target).tolist() == [3, 1, 0, 2]


def _one_round(
    p: torch.Tensor, q0: torch.Tensor, q1: torch.Tensor, rows: int, seed: int, rule=None
) -> torch.Tensor:
    """γ = 1 over a 4-item support: the first emitted item of each of ``rows`` rounds."""
    rule = rule or speculative_accept
    gen = torch.Generator().manual_seed(seed)
    ids = torch.arange(4).expand(rows, 1, 4)
    draft = draw(p.expand(rows, 4), torch.rand(rows, generator=gen)).unsqueeze(1)  # [R, 1]
    target_probs = torch.stack([q0, q1]).expand(rows, 2, 4)
    kept, pick = rule(
        draft, ids, p.expand(rows, 1, 4), torch.arange(4).expand(rows, 2, 4), target_probs,
        torch.rand(rows, 1, generator=gen), torch.rand(rows, generator=gen),
    )  # fmt: skip
    return torch.where(kept > 0, draft[:, 0], pick)


def test_speculative_rule_emits_the_target_distribution() -> None:
    p = torch.tensor([0.6, 0.3, 0.1, 0.0])  # the draft likes item 0 too much
    q0 = torch.tensor([0.1, 0.2, 0.3, 0.4])  # and never proposes item 3
    q1 = torch.tensor([0.25, 0.25, 0.25, 0.25])
    first = _one_round(p, q0, q1, 60_000, seed=1)
    assert chi_square_p(torch.bincount(first, minlength=4), q0) > 1e-3

    def always_keep(draft, *args):  # the wrong rule: trust the draft
        kept, pick = speculative_accept(draft, *args)
        return torch.ones_like(kept), pick

    wrong = _one_round(p, q0, q1, 60_000, seed=1, rule=always_keep)
    assert chi_square_p(torch.bincount(wrong, minlength=4), q0) < 1e-6


def test_identical_models_always_accept() -> None:
    q = torch.tensor([0.4, 0.3, 0.2, 0.1])
    gen = torch.Generator().manual_seed(2)
    rows = 1000
    draft = draw(q.expand(rows, 4), torch.rand(rows, generator=gen)).view(rows, 1)
    probs = q.expand(rows, 1, 4)
    kept, _ = speculative_accept(
        draft, torch.arange(4).expand(rows, 1, 4), probs, torch.arange(4).expand(rows, 2, 4),
        q.expand(rows, 2, 4), torch.rand(rows, 1, generator=gen), torch.rand(rows, generator=gen),
    )  # fmt: skip
    assert bool((kept == 1).all())
