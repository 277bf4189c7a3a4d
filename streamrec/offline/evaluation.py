"""Leave-last-out evaluation over the full catalog, beside a most-popular baseline.

For every user with at least two events, the model sees the rest of the history (its last
``max_seq_len`` tokens, through ``prefill``) and ranks every retrievable row (padding and
OOV buckets excluded, nothing else unless ``exclude_history``); the held-out item's rank
gives HR@k, NDCG@k and MRR. The baseline ranks items by their count in the training part
(ties broken by row), i.e. the same split the model was trained on.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from streamrec.models.checkpoint import load_checkpoint
from streamrec.models.quantization import apply_precision
from streamrec.models.serving_precision import MODEL_PRECISION, ServingPrecision
from streamrec.offline.datasets import InteractionLog


@dataclass(frozen=True)
class RankingMetrics:
    hr: float
    ndcg: float
    mrr: float

    @classmethod
    def from_ranks(cls, ranks: np.ndarray, k: int) -> RankingMetrics:
        """ranks: 0-based rank of each held-out item (inf when it cannot be ranked)."""
        hit = ranks < k
        ndcg = np.where(hit, 1.0 / np.log2(np.minimum(ranks, k) + 2.0), 0.0)
        return cls(
            hr=float(hit.mean()), ndcg=float(ndcg.mean()), mrr=float((1.0 / (ranks + 1)).mean())
        )


@dataclass(frozen=True)
class EvalResult:
    model: RankingMetrics
    popular: RankingMetrics
    k: int
    num_users: int
    num_items: int
    model_version: str
    exclude_history: bool

    def table(self) -> str:
        k = self.k
        rows = [
            f"{'metric':<10}{'model':>10}{'most-pop':>10}{'ratio':>8}",
            *(
                f"{name:<10}{m:>10.4f}{p:>10.4f}{(m / p if p else math.inf):>8.2f}"
                for name, m, p in (
                    (f"HR@{k}", self.model.hr, self.popular.hr),
                    (f"NDCG@{k}", self.model.ndcg, self.popular.ndcg),
                    ("MRR", self.model.mrr, self.popular.mrr),
                )
            ),
            f"users={self.num_users} items={self.num_items} model_version={self.model_version}"
            + (" (history excluded)" if self.exclude_history else ""),
        ]
        return "\n".join(rows)


def _rank_of(scores: np.ndarray, target: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """0-based rank of scores[u, target[u]] among allowed rows; ties counted by row order."""
    rows = np.arange(scores.shape[1])
    tscore = scores[np.arange(len(target)), target][:, None]
    ahead = (scores > tscore) | ((scores == tscore) & (rows[None, :] < target[:, None]))
    ranks = (ahead & allowed).sum(axis=1).astype(np.float64)
    return np.where(allowed[np.arange(len(target)), target], ranks, np.inf)


@torch.no_grad()
def evaluate(
    model_dir: Path | str,
    data: InteractionLog,
    *,
    k: int = 10,
    batch_size: int = 128,
    exclude_history: bool = False,
    device: str = "cpu",
    report: TextIO | None = sys.stdout,
    dtype: str = "float32",
    precision: ServingPrecision = MODEL_PRECISION,
) -> EvalResult:
    """Leave-last-out HR@k / NDCG@k / MRR of a model directory and of most-popular.

    ``dtype`` and ``precision`` (FP8 KV cache, FP8 weights) evaluate the model as it would
    serve: a prefill at that precision is what incremental serving computes.
    """
    ckpt = load_checkpoint(model_dir, device=device, dtype=dtype)
    model, vocab, cfg = apply_precision(ckpt.model, precision), ckpt.vocab, ckpt.config
    history, held_out = data.leave_last_out()
    rows = vocab.lookup(history.items.tolist())
    targets = vocab.lookup(held_out.items.tolist())
    first = cfg.first_item_row
    popularity = np.bincount(rows, minlength=cfg.num_items).astype(np.float64)
    model_ranks: list[np.ndarray] = []
    pop_ranks: list[np.ndarray] = []
    for lo in range(0, history.num_users, batch_size):
        users = range(lo, min(lo + batch_size, history.num_users))
        spans = [history.user_slice(u) for u in users]
        spans = [slice(max(s.start, s.stop - cfg.max_seq_len), s.stop) for s in spans]
        idx = np.concatenate([np.arange(s.start, s.stop) for s in spans])
        lens = [s.stop - s.start for s in spans]
        offsets = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64)
        _, _, user_emb = model.prefill(
            torch.from_numpy(rows[idx]).to(device),
            torch.from_numpy(history.actions[idx]).to(device),
            torch.from_numpy(history.ts_ms[idx]).to(device),
            offsets.to(device),
        )
        scores = (user_emb @ model.item_table().t()).float().cpu().numpy()  # [B, V]
        allowed = np.zeros_like(scores, dtype=bool)
        allowed[:, first:] = True
        if exclude_history:
            for r, u in enumerate(users):
                allowed[r, rows[history.user_slice(u)]] = False
        target = targets[lo : lo + len(spans)]
        model_ranks.append(_rank_of(scores, target, allowed))
        pop = np.broadcast_to(popularity, scores.shape)
        pop_ranks.append(_rank_of(pop, target, allowed))
    result = EvalResult(
        model=RankingMetrics.from_ranks(np.concatenate(model_ranks), k),
        popular=RankingMetrics.from_ranks(np.concatenate(pop_ranks), k),
        k=k,
        num_users=history.num_users,
        num_items=cfg.num_items - first,
        model_version=ckpt.version,
        exclude_history=exclude_history,
    )
    if report is not None:
        report.write(result.table() + "\n")
        report.flush()
    return result
