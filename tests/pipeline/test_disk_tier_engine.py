"""Eviction through GPU, host and disk tiers keeps incremental == full recompute (issue 20)."""

from __future__ import annotations

from pathlib import Path

import torch

from streamrec.cache.disk_tier import DiskTier
from streamrec.cache.history_backends import open_history_store
from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_file import HEADER_BYTES
from streamrec.cache.kv_tiers import KVTiers
from streamrec.models.hstu import HSTU
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.pipeline.engine import Engine, EngineConfig
from streamrec.pipeline.scorer import ScoringConfig
from tests.pipeline.test_engine import (
    BLOCK_SIZE,
    _batches,
    _model,
    _process,
    _stream,
    assert_equals_recompute,
)


def _engine(model: HSTU, vocab: ItemVocabulary, directory: Path, store) -> Engine:
    cfg = model.config
    geometry = KVCacheConfig(cfg.num_layers, cfg.num_heads, cfg.head_dim, BLOCK_SIZE, torch.float32)
    cache = KVCache(geometry, 90, "cpu")
    host = HostTier(cache, 60)
    max_blocks = -(-cfg.max_seq_len // BLOCK_SIZE)
    disk = DiskTier(
        cache, directory, 10**8, "v0", max_blocks=max_blocks, staging_users=4, read_threads=2
    )
    tiers = KVTiers(cache, host, cfg.max_seq_len, disk=disk)
    scoring = ScoringConfig(top_k=10, num_candidates=24, exclude_recent=5)
    return Engine(
        model,
        tiers,
        store,
        vocab,
        cfg.task_names,
        EngineConfig(model_name="test", model_version="v0", scoring=scoring),
    )


async def test_disk_tier_incremental_equals_full_recompute_with_torn_files(
    tmp_path: Path,
) -> None:
    model, vocab = _model(num_known=300)
    store = open_history_store("memory://", model.config.max_seq_len)
    # 150 users x ~25 tokens: ~1,000 blocks; the GPU holds 90 and the host 60, so most
    # returning users come back from disk.
    engine = _engine(model, vocab, tmp_path, store)
    disk = engine.tiers.disk
    assert disk is not None
    last = {}
    for n, batch in enumerate(_batches(_stream(3_000, 150, 300, seed=3), events_per_batch=30)):
        if n % 10 == 5:  # tear a few files: those users must be rebuilt, never misread
            for entry in list(disk._entries.values())[:3]:
                if entry.write is None and entry.path.exists():
                    with entry.path.open("r+b") as fh:
                        fh.seek(HEADER_BYTES + 3)
                        fh.write(b"\xff\xfe")
        last.update(await _process(engine, batch))
    stats = engine.stats()
    tier_stats = engine.tiers.stats()
    assert tier_stats.disk is not None
    assert stats.disk_hits > 100 and stats.host_hits > 20 and stats.gpu_hits > 50
    assert tier_stats.disk.verify_failures > 0 and tier_stats.disk.writes > 100
    assert tier_stats.disk.prefetches > 100

    await assert_equals_recompute(model, vocab, store, last, engine.config.scoring)
    assert len(last) == 150
    await engine.close()
    engine.tiers.close()
    assert not any(tmp_path.iterdir())
