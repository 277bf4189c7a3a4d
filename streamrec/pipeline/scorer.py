"""Retrieval top-K, then candidate ranking, then one ordered list per user.

Shared by the engine's incremental path and by the full-recompute reference, so the two
can only differ in how the user's cache was built, never in how it is scored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from streamrec.cache.kv_cache import KVCache, to_device, to_host
from streamrec.errors import ConfigError
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.pipeline.serving_model import ServingModel

if TYPE_CHECKING:
    from streamrec.pipeline.item_catalog import ItemCatalog


@dataclass(frozen=True)
class ScoredUsers:
    items: np.ndarray  # [B, top_k] int64 item rows, best first
    scores: np.ndarray  # [B, top_k] float32
    task_scores: np.ndarray | None  # [B, top_k, tasks] float32


class Scorer:
    def __init__(
        self,
        model: ServingModel,
        cache: KVCache,
        config: ScoringConfig,
        task_names: Sequence[str],
        catalog: ItemCatalog | None = None,
    ) -> None:
        unknown = sorted(set(config.task_weights) - set(task_names))
        if unknown:
            raise ConfigError(f"task_weights name tasks {unknown} the model lacks ({task_names})")
        self.model = model
        self.cache = cache
        self.config = config
        self.task_names = tuple(task_names)
        weights = [float(config.task_weights.get(name, 0.0)) for name in self.task_names]
        self._weights = torch.tensor(weights, dtype=torch.float32, device=cache.device)  # [tasks]
        # Past the GPU budget: retrieval over the retrievable set, rank inputs as slots.
        self.catalog = catalog
        pool = config.num_candidates or config.top_k
        if catalog is not None and catalog.size < pool:
            raise ConfigError(
                f"the retrievable set holds {catalog.size} items, fewer than the {pool} "
                "candidates retrieval must return"
            )

    def score(
        self,
        user_emb: torch.Tensor,  # [B, D]
        recent: Sequence[np.ndarray],
        query_ts: Sequence[int],
        users: Sequence[str],
        mark: Callable[[str], None] = lambda phase: None,
    ) -> ScoredUsers:
        """Top-K per user; ``mark("retrieve")``/``mark("rank")`` end those phases."""
        cfg = self.config
        device = user_emb.device
        num_users = user_emb.shape[0]
        width = max(1, max((len(r) for r in recent), default=0))
        exclude = np.full((num_users, width), -1, dtype=np.int64)  # [B, E]
        for row, rows in enumerate(recent):
            exclude[row, : len(rows)] = rows
        pool = cfg.num_candidates or cfg.top_k
        if self.catalog is None:
            ret_scores, ret_items = self.model.retrieve(
                user_emb, pool, to_device(exclude, device)
            )  # [B, pool] each
        else:
            ret_scores, ret_items, cand_slots = self.catalog.retrieve(user_emb, pool, exclude)
        mark("retrieve")
        if not cfg.num_candidates:
            items_h, scores_h = to_host(ret_items, ret_scores.float())
            mark("rank")
            return ScoredUsers(items=items_h, scores=scores_h, task_scores=None)
        tables, lens = self.cache.batch_tables(list(users))  # [B, MB], [B]
        ts = to_device(np.asarray(query_ts, dtype=np.int64), device)  # [B]
        cands = ret_items if self.catalog is None else cand_slots
        probs = self.model.rank(
            cands, ts, self.cache.kv, self.cache.ts, tables, lens
        ).float()  # [B, pool, tasks]
        combined = probs @ self._weights  # [B, pool]
        top_scores, order = torch.topk(combined, cfg.top_k, dim=1)  # [B, top_k]
        items = torch.gather(ret_items, 1, order)
        task = torch.gather(probs, 1, order.unsqueeze(-1).expand(-1, -1, probs.shape[-1]))
        mark("rank")
        items_h, scores_h, task_h = to_host(items, top_scores, task)
        return ScoredUsers(items=items_h, scores=scores_h, task_scores=task_h)
