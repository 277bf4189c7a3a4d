"""How a generated item is chosen: greedy or sampled, and how a draft's guesses are kept.

A position's distribution is defined over the retrieval top-``pool`` of the model that
scores it (consumed and already generated items excluded): ``softmax(score / T)`` over
those candidates, cut to the smallest prefix holding ``top_p`` of the mass and
renormalised. Greedy (``T = 0``) takes the top candidate. Defining the distribution on a
candidate list rather than on the whole catalog keeps every tensor ``[rows, pool]``
(1M-item catalogs need no dense ``[rows, V]`` probabilities) and gives the speculative
rule below an exact target distribution to preserve.

Speculative acceptance (Leviathan et al. 2023; Chen et al. 2023): draft token ``x_j`` with
draft probability ``p(x_j)`` and target probability ``q(x_j)`` is kept with probability
``min(1, q/p)``; at the first rejection the replacement is drawn from ``max(0, q - p)``
renormalised, and when all γ are kept a bonus token is drawn from the target's next
distribution. The emitted sequence then follows the target's distribution exactly. The
greedy case reduces to "keep the longest prefix on which the target's top choice agrees",
plus the target's own choice after it.

All functions are shape-static tensor code (no host syncs), so a generation round can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch


def candidate_probs(scores: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """scores [..., N] sorted best first (-inf = excluded) -> probabilities [..., N].

    Softmax at ``temperature``, then the nucleus: a candidate is kept while the mass
    before it is below ``top_p`` (so the best one always is). Rows with no finite score
    put all their mass on candidate 0 (callers never draw from such rows).
    """
    logits = (scores.float() / temperature).nan_to_num(neginf=-1e30)
    probs = torch.softmax(logits, dim=-1)  # [..., N]
    before = probs.cumsum(-1) - probs
    probs = torch.where(before < top_p, probs, torch.zeros_like(probs))
    probs = torch.where(torch.isfinite(scores), probs, torch.zeros_like(probs))
    total = probs.sum(-1, keepdim=True)
    first = torch.zeros_like(probs)
    first[..., 0] = 1.0
    return torch.where(total > 0, probs / total.clamp(min=1e-30), first)


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index [...] drawn from probs [..., N] by inverting the CDF at ``uniform`` [...]."""
    cdf = probs.cumsum(-1)
    target = uniform.unsqueeze(-1) * cdf[..., -1:]
    return (cdf <= target).sum(-1).clamp(max=probs.shape[-1] - 1)


def prob_of(tokens: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Probability of tokens [...] under the candidate lists ids, probs [..., N] (0 if absent)."""
    hit = ids == tokens.unsqueeze(-1)
    return torch.where(hit, probs, torch.zeros_like(probs)).sum(-1)


def greedy_accept(draft: torch.Tensor, target_top: torch.Tensor) -> torch.Tensor:
    """Kept draft tokens per row: the longest prefix equal to the target's choices.

    draft [B, γ]; target_top [B, γ+1] (the target's top item after each verified prefix).
    Returns n [B] in 0..γ; the row then emits ``target_top[:, : n + 1]``.
    """
    agree = (draft == target_top[:, : draft.shape[1]]).to(torch.int64)
    return agree.cumprod(1).sum(1)


def speculative_accept(
    draft: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_ids: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_final: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The accept/reject rule: (kept draft tokens n [B], index into target_ids[:, n]).

    draft [B, γ] tokens, drawn from (draft_ids, draft_probs) [B, γ, N]; target_ids,
    target_probs [B, γ+1, N] (the target's lists after each prefix); u_accept [B, γ] and
    u_final [B] uniforms in [0, 1). The row emits ``draft[:, :n]`` and then
    ``target_ids[b, n, index]``: a draw from the residual ``max(0, q - p)`` after a
    rejection, or from ``q`` itself when every draft token was kept.
    """
    gamma = draft.shape[1]
    p = prob_of(draft, draft_ids, draft_probs)  # [B, γ], > 0: x was drawn from p
    q = prob_of(draft, target_ids[:, :gamma], target_probs[:, :gamma])  # [B, γ]
    keep = (u_accept * p < q).to(torch.int64)  # u < min(1, q / p)
    n = keep.cumprod(1).sum(1)  # [B]
    at = n.view(-1, 1, 1).expand(-1, 1, target_ids.shape[-1])
    t_ids = target_ids.gather(1, at).squeeze(1)  # [B, N]
    t_probs = target_probs.gather(1, at).squeeze(1)  # [B, N]
    d_at = n.clamp(max=gamma - 1).view(-1, 1, 1).expand(-1, 1, draft_ids.shape[-1])
    d_ids = draft_ids.gather(1, d_at).squeeze(1)  # [B, N]
    d_probs = draft_probs.gather(1, d_at).squeeze(1)  # [B, N]
    hit = t_ids.unsqueeze(2) == d_ids.unsqueeze(1)  # [B, N, N]
    p_on_t = torch.where(hit, d_probs.unsqueeze(1), torch.zeros_like(d_probs).unsqueeze(1))
    rejected = (n < gamma).unsqueeze(1)  # [B, 1]
    residual = torch.where(rejected, (t_probs - p_on_t.sum(2)).clamp(min=0.0), t_probs)
    residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, t_probs)
    return n, draw(residual, u_final)
