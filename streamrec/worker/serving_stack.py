"""What the engine serves with, built from the configuration and the loaded model.

- ``build_tiers``: the KV pool sized from ``[cache]`` (bytes, or a fraction of the free
  device memory, capped on the CPU where the RAM is shared) and the pinned host tier;
- ``serving_model``: the loaded backend, replayed from CUDA graphs where that applies
  (``model_loader.graphed_serving_model``);
- ``serving_scoring``: the configured sizes clamped to the model's catalogue.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Final

from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_tiers import KVTiers
from streamrec.models.config import HSTUConfig
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.pipeline.serving_model import ServingModel
from streamrec.worker.config import CacheConfig, WorkerConfig
from streamrec.worker.model_loader import LoadedModel, graphed_serving_model

log = logging.getLogger(__name__)

_CPU_KV_BUDGET_CAP: Final = 256 << 20  # auto-sized KV pool on the CPU: RAM is shared


def serving_model(
    config: WorkerConfig, loaded: LoadedModel, cache: KVCache, scoring: ScoringConfig
) -> ServingModel:
    """The loaded backend (eager or AOTI), inside CUDA graphs on a GPU with
    ``model.cuda_graphs`` (blocking: the captures take seconds)."""
    graphed = graphed_serving_model(
        loaded, cache, config.model, config.batching.max_batch_users, scoring.num_candidates
    )
    return loaded.model if graphed is None else graphed


def build_tiers(c: CacheConfig, loaded: LoadedModel) -> KVTiers:
    """The GPU pool (allocated once, here) and the host tier behind it."""
    hstu = loaded.checkpoint.config
    geometry = KVCacheConfig(
        hstu.num_layers, hstu.num_heads, hstu.head_dim, c.block_size, hstu.torch_dtype
    )
    if c.kv_budget_bytes:
        cache = KVCache.from_budget(geometry, loaded.device, budget_bytes=c.kv_budget_bytes)
    elif loaded.device.type == "cpu":  # RAM is shared with everything else: cap it
        cache = KVCache.from_budget(
            geometry,
            loaded.device,
            free_fraction=c.kv_budget_fraction,
            cap_bytes=_CPU_KV_BUDGET_CAP,
        )
    else:
        cache = KVCache.from_budget(geometry, loaded.device, free_fraction=c.kv_budget_fraction)
    # A host tier only pays off behind a GPU pool; on the CPU it would copy RAM to RAM.
    host = None
    if c.host_tier_bytes > 0 and loaded.device.type == "cuda":
        host = HostTier.from_budget(cache, c.host_tier_bytes)
    return KVTiers(cache, host, hstu.max_seq_len)


def serving_scoring(scoring: ScoringConfig, hstu: HSTUConfig) -> ScoringConfig:
    """The scoring the worker serves with: the configured sizes, clamped to the catalogue
    (a small model may have fewer items than ``num_candidates``), and the task weights
    restricted to the model's tasks. The offline recompute must use the same."""
    retrievable = hstu.num_items - hstu.first_item_row
    exclude = min(scoring.exclude_recent, max(retrievable - 1, 0))
    pool = max(1, min(scoring.num_candidates, retrievable - exclude))
    return dataclasses.replace(
        scoring,
        top_k=min(scoring.top_k, pool),
        num_candidates=pool if scoring.num_candidates else 0,
        exclude_recent=exclude,
        task_weights={k: v for k, v in scoring.task_weights.items() if k in hstu.task_names},
    )
