"""What the engine serves with, built from the configuration and the loaded model.

- ``build_catalog``: for an item table past ``cache.embedding_cache_rows``, the embedding
  cache (hot rows on the device) and the retrievable set, bound to the eager model;
- ``build_tiers``: the KV pool sized from ``[cache]`` (bytes, or a fraction of the free
  device memory, capped on the CPU where the RAM is shared), the pinned host tier and the
  disk tier behind it;
- ``serving_model``: the loaded backend, replayed from CUDA graphs where that applies
  (``model_loader.graphed_serving_model``);
- ``serving_scoring``: the configured sizes clamped to the model's catalogue;
- ``serving_generation``: the next-k generator (and its draft) when ``[generation]`` asks.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Final

from streamrec.cache.disk_tier import DiskTier
from streamrec.cache.embedding_cache import EmbeddingCache
from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_tiers import KVTiers
from streamrec.cache.retrieval_set import RetrievalSet
from streamrec.errors import ConfigError
from streamrec.models.aoti_runtime import AOTIModel
from streamrec.models.config import HSTUConfig
from streamrec.models.draft import load_draft
from streamrec.models.hstu import HSTU
from streamrec.models.quantization import kv_storage_dtype, model_precision
from streamrec.pipeline.draft_catalog import DraftCatalog, load_draft_items
from streamrec.pipeline.engine import EngineConfig
from streamrec.pipeline.generation_workspace import ModelGeometry
from streamrec.pipeline.generator import ROW_BUCKETS, Generator, GenModel
from streamrec.pipeline.item_catalog import ItemCatalog
from streamrec.pipeline.model_step import PREFILL_CALL_TOKENS
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.pipeline.serving_model import GeneratingModel, ServingModel
from streamrec.pipeline.step_generation import StepGeneration
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
    """The GPU pool (allocated once, here) and the host tier behind it, in the dtype of
    the K/V the loaded model returns (``cache.kv_dtype``, applied by ``load_model``)."""
    hstu = loaded.checkpoint.config
    precision = model_precision(loaded.checkpoint.model)
    if precision.kv_dtype != c.kv_dtype:
        raise ConfigError(
            f"cache.kv_dtype = {c.kv_dtype!r} but the model was loaded with "
            f"kv_dtype={precision.kv_dtype!r} (pass cache.kv_dtype to load_model)"
        )
    dtype = kv_storage_dtype(precision, hstu.torch_dtype)
    geometry = KVCacheConfig(hstu.num_layers, hstu.num_heads, hstu.head_dim, c.block_size, dtype)
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
    disk = None
    if c.disk_tier_bytes > 0 and host is not None:
        index = loaded.device.index if loaded.device.index is not None else 0
        disk = DiskTier(
            cache,
            c.disk_tier_dir / f"cuda{index}",  # one worker per GPU: its own files
            c.disk_tier_bytes,
            loaded.checkpoint.version,
            max_blocks=-(-hstu.max_seq_len // c.block_size),
            fsync=c.disk_tier_fsync,
            device_slots=c.disk_tier_device_slots,  # GPU memory on top of the KV budget
        )
    elif c.disk_tier_bytes > 0:
        log.warning("cache.disk_tier_bytes is set but there is no host tier (CPU): no disk tier")
    return KVTiers(cache, host, hstu.max_seq_len, disk=disk)


def build_catalog(
    c: CacheConfig, loaded: LoadedModel, scoring: ScoringConfig
) -> ItemCatalog | None:
    """The embedding cache and retrievable set of a table kept on the host, bound to the
    model (before any CUDA-graph capture); None when the table lives on the device."""
    table = loaded.item_table
    if table is None:
        return None
    hstu = loaded.checkpoint.config
    model = loaded.model
    if not isinstance(model, HSTU):
        raise ConfigError(f"the embedding cache needs the eager model, got {type(model).__name__}")
    size = min(c.retrievable_items, hstu.num_items - hstu.first_item_row)
    pool = scoring.num_candidates or scoring.top_k
    if size < pool:
        raise ConfigError(
            f"cache.retrievable_items = {c.retrievable_items} gives a retrievable set of {size} "
            f"items, fewer than the {pool} candidates scoring retrieves"
        )
    catalog = ItemCatalog(
        EmbeddingCache(table, loaded.device, num_slots=c.embedding_cache_rows),
        RetrievalSet(
            table,
            loaded.device,
            size,
            hstu.first_item_row,
            half_life_events=c.popularity_half_life_events,
            refresh_events=c.retrievable_refresh_events,
        ),
    )
    catalog.bind(model)
    log.info(
        "item table on the host",
        extra={"items": hstu.num_items, "gpu_rows": c.embedding_cache_rows, "retrievable": size},
    )
    return catalog


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


def engine_config(
    config: WorkerConfig, loaded: LoadedModel, scoring: ScoringConfig
) -> EngineConfig:
    """The engine's settings from the worker's: what it reports, how it prefills."""
    ck = loaded.checkpoint
    call_tokens = config.model.prefill_call_tokens or PREFILL_CALL_TOKENS  # 0: the default
    return EngineConfig(
        ck.model_name, ck.version, loaded.backend, scoring, loaded.jagged_prefill, call_tokens
    )


def serving_generation(
    config: WorkerConfig, loaded: LoadedModel, cache: KVCache, scoring: ScoringConfig
) -> StepGeneration | None:
    """The step's generator (blocking: loads the draft and captures its graphs).

    The target generates through the serving backend when that has ``extend_scratch``
    (eager, or an AOTI package exported with it: its unchecked twin, since the generator
    builds every input itself), else through the eager module; the draft is always eager.
    Rounds replay as CUDA graphs on a GPU with ``model.cuda_graphs``.
    """
    gen = config.generation
    if gen.k == 0:
        return None
    if loaded.item_table is not None:
        raise ConfigError(
            f"generation.k = {gen.k}: generation needs the item table on the device "
            f"(cache.embedding_cache_rows = {config.cache.embedding_cache_rows} keeps it on "
            "the host); set one of them to 0"
        )
    hstu = loaded.checkpoint.config
    target: GeneratingModel = loaded.checkpoint.model
    if isinstance(loaded.model, AOTIModel) and loaded.model.has("extend_scratch"):
        target = loaded.model.unchecked()
    dtype = hstu.torch_dtype
    draft = None
    catalog = None
    if gen.draft_model is not None:
        draft_ckpt = load_draft(gen.draft_model, loaded.checkpoint, device=loaded.device)
        draft = GenModel(draft_ckpt.model, ModelGeometry(draft_ckpt.config, dtype))
        if gen.draft_catalog:
            items = load_draft_items(gen.draft_model, gen.draft_catalog)
            catalog = DraftCatalog(draft_ckpt.model, items)
        log.info(
            "speculative generation",
            extra={
                "draft": str(gen.draft_model),
                "draft_version": draft_ckpt.version,
                "draft_catalog": 0 if catalog is None else catalog.size,
            },
        )
    max_users = config.batching.max_batch_users
    rows = [b for b in ROW_BUCKETS if b < 2 * max_users] or [ROW_BUCKETS[0]]
    capture = config.model.cuda_graphs
    generator = Generator(
        GenModel(target, ModelGeometry(hstu, dtype)), cache.kv, cache.ts, gen, draft,
        capture=capture, max_rows=rows[-1],
        max_blocks=-(-hstu.max_seq_len // cache.config.block_size) + 1,
        max_consumed=max(1, scoring.exclude_recent), draft_catalog=catalog,
    )  # fmt: skip
    if generator.capture:
        generator.warm_up(rows)
    return StepGeneration(generator, cache)
