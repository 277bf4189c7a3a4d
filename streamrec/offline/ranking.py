"""Full-catalog ranking of each user's held-out item: the core every offline figure uses.

One code path ranks for the test split, for the validation split that early stopping
reads, for the HSTU, for the SASRec-style baseline and for most-popular, so a difference
between two figures is a difference between the models, never between two evaluators.
A model is anything with ``item_table()`` and either HSTU's ``prefill`` or a
``user_embedding(items, actions, ts, offsets)`` of the same jagged layout.

Per-user figures (``UserMetrics``) are kept, not only their means: the paired bootstrap
(``bootstrap.py``) resamples users.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from streamrec.models.hstu import HSTU
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.offline.datasets import InteractionLog

METRICS = ("hr", "ndcg", "mrr")


class SequenceEncoder(Protocol):
    """What ranking needs of a non-HSTU model (the SASRec-style baseline)."""

    def item_table(self) -> torch.Tensor: ...

    def user_embedding(
        self, items: torch.Tensor, actions: torch.Tensor, ts: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor: ...


Ranker = HSTU | SequenceEncoder


@dataclass(frozen=True)
class RankingMetrics:
    hr: float
    ndcg: float
    mrr: float

    @classmethod
    def from_ranks(cls, ranks: np.ndarray, k: int) -> RankingMetrics:
        """ranks: 0-based rank of each held-out item (inf when it cannot be ranked)."""
        return UserMetrics.from_ranks(ranks, k).mean()

    def get(self, name: str) -> float:
        return float(getattr(self, name))


@dataclass(frozen=True)
class UserMetrics:
    """Each user's HR@k, NDCG@k and reciprocal rank: [U] arrays in the log's user order."""

    hr: np.ndarray  # [U] 0/1
    ndcg: np.ndarray  # [U]
    mrr: np.ndarray  # [U]

    @classmethod
    def from_ranks(cls, ranks: np.ndarray, k: int) -> UserMetrics:
        hit = ranks < k
        ndcg = np.where(hit, 1.0 / np.log2(np.minimum(ranks, k) + 2.0), 0.0)
        return cls(hr=hit.astype(np.float64), ndcg=ndcg, mrr=1.0 / (ranks + 1.0))

    def mean(self) -> RankingMetrics:
        return RankingMetrics(
            hr=float(self.hr.mean()), ndcg=float(self.ndcg.mean()), mrr=float(self.mrr.mean())
        )

    def get(self, name: str) -> np.ndarray:
        values: np.ndarray = getattr(self, name)
        return values


def rank_of(scores: np.ndarray, target: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """0-based rank of scores[u, target[u]] among allowed rows; ties counted by row order."""
    rows = np.arange(scores.shape[1])
    tscore = scores[np.arange(len(target)), target][:, None]
    ahead = (scores > tscore) | ((scores == tscore) & (rows[None, :] < target[:, None]))
    ranks = (ahead & allowed).sum(axis=1).astype(np.float64)
    return np.where(allowed[np.arange(len(target)), target], ranks, np.inf)


def _user_vectors(
    model: Ranker,
    items: torch.Tensor,
    actions: torch.Tensor,
    ts: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """[B, D] user embedding after each jagged history (HSTU: the serving prefill)."""
    if isinstance(model, HSTU):
        return model.prefill(items, actions, ts, offsets)[2]
    return model.user_embedding(items, actions, ts, offsets)


@dataclass(frozen=True)
class HeldOutRanks:
    """0-based ranks of each user's held-out item: [U] model, [U] most-popular."""

    model: np.ndarray
    popular: np.ndarray
    num_users: int


@torch.no_grad()
def rank_held_out(
    model: Ranker,
    vocab: ItemVocabulary,
    data: InteractionLog,
    *,
    max_seq_len: int,
    batch_size: int = 128,
    exclude_history: bool = False,
    device: str = "cpu",
) -> HeldOutRanks:
    """Rank each user's last event of ``data`` given the rest (its last ``max_seq_len``).

    Every retrievable row competes (padding and OOV buckets excluded; the user's own past
    items too with ``exclude_history``). Most-popular ranks by count in the same history
    part, ties by row.
    """
    history, held_out = data.leave_last_out()
    rows = vocab.lookup(history.items.tolist())
    targets = vocab.lookup(held_out.items.tolist())
    first = vocab.first_item_row
    popularity = np.bincount(rows, minlength=vocab.size).astype(np.float64)  # [V]
    table = model.item_table()  # [V, D]
    model_ranks: list[np.ndarray] = []
    pop_ranks: list[np.ndarray] = []
    for lo in range(0, history.num_users, batch_size):
        users = range(lo, min(lo + batch_size, history.num_users))
        spans = [history.user_slice(u) for u in users]
        spans = [slice(max(s.start, s.stop - max_seq_len), s.stop) for s in spans]
        idx = np.concatenate([np.arange(s.start, s.stop) for s in spans])
        lens = [s.stop - s.start for s in spans]
        offsets = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64)
        user_emb = _user_vectors(
            model,
            torch.from_numpy(rows[idx]).to(device),
            torch.from_numpy(history.actions[idx]).to(device),
            torch.from_numpy(history.ts_ms[idx]).to(device),
            offsets.to(device),
        )  # [B, D]
        scores = (user_emb @ table.t()).float().cpu().numpy()  # [B, V]
        allowed = np.zeros_like(scores, dtype=bool)
        allowed[:, first:] = True
        if exclude_history:
            for r, u in enumerate(users):
                allowed[r, rows[history.user_slice(u)]] = False
        target = targets[lo : lo + len(spans)]
        model_ranks.append(rank_of(scores, target, allowed))
        pop = np.broadcast_to(popularity, scores.shape)
        pop_ranks.append(rank_of(pop, target, allowed))
    return HeldOutRanks(
        model=np.concatenate(model_ranks),
        popular=np.concatenate(pop_ranks),
        num_users=history.num_users,
    )
