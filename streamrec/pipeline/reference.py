"""Full recompute: what the engine's incremental answer must equal (the exactness oracle).

Each user's whole stored history is prefilled into a scratch KV pool of its own, then
scored by the same ``Scorer``; nothing is shared with a running engine. Tests, the worker's
end-state checks and the CPU baseline benchmark all use this one function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from streamrec.cache.history_store import History
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_tiers import KVTiers
from streamrec.pipeline.model_step import ModelStep, UserOutput, UserWork
from streamrec.pipeline.scorer import Scorer
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.pipeline.serving_model import ServingModel


def full_recompute(
    model: ServingModel,
    histories: Mapping[str, History],
    *,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    max_seq_len: int,
    dtype: torch.dtype,
    task_names: Sequence[str],
    scoring: ScoringConfig,
    device: torch.device | str = "cpu",
    block_size: int = 16,
) -> dict[str, UserOutput]:
    """Recommendations computed from scratch, one user at a time, from whole histories."""
    out: dict[str, UserOutput] = {}
    blocks = -(-max_seq_len // block_size)
    config = KVCacheConfig(num_layers, num_heads, head_dim, block_size, dtype)
    with torch.inference_mode():
        for user, history in histories.items():
            if not len(history):
                continue
            cache = KVCache(config, blocks, device)
            tiers = KVTiers(cache, None, max_seq_len)
            scorer = Scorer(model, cache, scoring, task_names)
            step = ModelStep(model, tiers, scorer, torch.device(device))
            work = UserWork.from_history(user, history, scoring.exclude_recent)
            outputs, _ = step.run([work])
            out[user] = outputs[0]
    return out
