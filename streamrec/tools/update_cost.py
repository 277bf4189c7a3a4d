"""What one user update costs both ways, measured the same way for the same users.

*Incremental*: the user's cache holds all but its newest event, and the step extends it by
that one event and scores. *Full recompute*: the whole history prefilled into an empty
cache, then scored. Both go through the pipeline's ``ModelStep`` (the code the worker's
engine and the exactness oracle run), one user at a time, on the serving device, timed on
the wall clock with the device synchronised; allocations and first-call costs are left
out of both. The two answers are compared too: they must agree to float tolerance.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from streamrec.cache.history_store import History
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_tiers import KVTiers
from streamrec.models.config import HSTUConfig
from streamrec.pipeline.model_step import ModelStep, UserOutput, UserWork
from streamrec.pipeline.scorer import Scorer
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.pipeline.serving_model import ServingModel


@dataclass(frozen=True)
class UpdateCosts:
    incremental_ms: list[float]  # per user
    recompute_ms: list[float]  # per user
    max_abs_diff: float  # incremental against recompute, over every user's scores


class _Bench:
    """A scratch cache for two users (the incremental one and the recomputed one)."""

    def __init__(
        self,
        model: ServingModel,
        hstu: HSTUConfig,
        scoring: ScoringConfig,
        device: torch.device,
        block_size: int,
    ) -> None:
        blocks = -(-hstu.max_seq_len // block_size) + 1
        geometry = KVCacheConfig(
            hstu.num_layers, hstu.num_heads, hstu.head_dim, block_size, hstu.torch_dtype
        )
        cache = KVCache(geometry, 2 * blocks, device)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        scorer = Scorer(model, cache, scoring, hstu.task_names)
        self.step = ModelStep(model, KVTiers(cache, None, hstu.max_seq_len), scorer, device)
        self.keep = scoring.exclude_recent

    def _recent(self, items: np.ndarray) -> np.ndarray:
        return items[-self.keep :].copy() if self.keep else np.zeros(0, dtype=np.int64)

    def _timed(self, work: UserWork) -> tuple[UserOutput, float]:
        self.sync()
        started = time.perf_counter()
        (out,), _ = self.step.run([work])
        self.sync()
        return out, (time.perf_counter() - started) * 1000.0

    def update(self, history: History) -> tuple[float, float, float]:
        """(incremental ms, recompute ms, max |score difference|) of the newest event."""
        tokens = np.stack([history.items, history.actions, history.ts], axis=1)  # [L, 3]
        tokens = tokens.astype(np.int64)
        n = history.total_appended
        items = history.items
        self.step.run([UserWork("inc", tokens[:-1], True, self._recent(items[:-1]), n - 1)])
        inc, inc_ms = self._timed(UserWork("inc", tokens[-1:], False, self._recent(items), n))
        full, full_ms = self._timed(UserWork("full", tokens, True, self._recent(items), n))
        self.step.tiers.drop(["inc", "full"])
        same = inc.items.tolist() == full.items.tolist()
        diff = float(np.abs(inc.scores - full.scores).max()) if same else float("inf")
        return inc_ms, full_ms, diff


def measure_update_costs(
    model: ServingModel,
    hstu: HSTUConfig,
    scoring: ScoringConfig,
    histories: Mapping[str, History],
    device: torch.device,
    block_size: int,
) -> UpdateCosts:
    """Both costs for every history of at least two events (within the window)."""
    bench = _Bench(model, hstu, scoring, device, block_size)
    usable = [h for h in histories.values() if 2 <= len(h) == h.total_appended]
    incremental, recompute, worst = [], [], 0.0
    with torch.inference_mode():
        if usable:
            bench.update(usable[0])  # first calls (allocator, kernels) are not the claim
        for history in usable:
            inc_ms, full_ms, diff = bench.update(history)
            incremental.append(inc_ms)
            recompute.append(full_ms)
            worst = max(worst, diff)
    return UpdateCosts(incremental, recompute, worst)
