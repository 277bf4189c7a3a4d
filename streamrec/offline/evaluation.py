"""Leave-last-out evaluation over the full catalog, beside a most-popular baseline.

For every user with at least two events, the model sees the rest of the history (its last
``max_seq_len`` tokens, through ``prefill``) and ranks every retrievable row (padding and
OOV buckets excluded, nothing else unless ``exclude_history``); the held-out item's rank
gives HR@k, NDCG@k and MRR (``ranking.py``, the code validation uses too). The baseline
ranks items by their count in the history part (ties broken by row). A model directory
of the SASRec-style baseline (``sasrec.py``) is evaluated by the same code.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from streamrec.models.checkpoint import load_checkpoint
from streamrec.models.quantization import apply_precision
from streamrec.models.serving_precision import MODEL_PRECISION, ServingPrecision
from streamrec.offline.datasets import InteractionLog
from streamrec.offline.ranking import Ranker, RankingMetrics, UserMetrics, rank_held_out
from streamrec.offline.sasrec import is_sasrec_dir, load_sasrec

__all__ = ["EvalResult", "RankingMetrics", "evaluate"]


@dataclass(frozen=True)
class EvalResult:
    model: RankingMetrics
    popular: RankingMetrics
    k: int
    num_users: int
    num_items: int
    model_version: str
    exclude_history: bool
    per_user: UserMetrics | None = None  # the model's figures per user (bootstrap)
    popular_per_user: UserMetrics | None = None

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

    ``dtype`` and ``precision`` (FP8 KV cache, FP8 weights) evaluate an HSTU as it would
    serve: a prefill at that precision is what incremental serving computes. Pass
    ``data.without_last()`` to score the validation split instead of the test split.
    """
    model: Ranker
    if is_sasrec_dir(model_dir):
        baseline = load_sasrec(model_dir, device=device)
        model, vocab, version = baseline.model, baseline.vocab, baseline.version
        max_seq_len = baseline.model.config.max_seq_len
    else:
        ckpt = load_checkpoint(model_dir, device=device, dtype=dtype)
        model, vocab, version = apply_precision(ckpt.model, precision), ckpt.vocab, ckpt.version
        max_seq_len = ckpt.config.max_seq_len
    ranks = rank_held_out(
        model,
        vocab,
        data,
        max_seq_len=max_seq_len,
        batch_size=batch_size,
        exclude_history=exclude_history,
        device=device,
    )
    mine = UserMetrics.from_ranks(ranks.model, k)
    popular = UserMetrics.from_ranks(ranks.popular, k)
    result = EvalResult(
        model=mine.mean(),
        popular=popular.mean(),
        k=k,
        num_users=ranks.num_users,
        num_items=vocab.size - vocab.first_item_row,
        model_version=version,
        exclude_history=exclude_history,
        per_user=mine,
        popular_per_user=popular,
    )
    if report is not None:
        report.write(result.table() + "\n")
        report.flush()
    return result
