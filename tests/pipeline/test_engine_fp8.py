"""The engine at FP8 (issue 18): FP8 KV pool and host tier, FP8 projection weights, under
eviction; its recommendations equal a full recompute that quantizes the same way."""

from __future__ import annotations

import numpy as np

from streamrec.cache.history_backends import open_history_store
from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_tiers import KVTiers
from streamrec.models.fp8 import FP8
from streamrec.models.quantization import apply_precision
from streamrec.models.serving_precision import ServingPrecision
from streamrec.pipeline.engine import Engine, EngineConfig
from streamrec.pipeline.reference import full_recompute
from streamrec.pipeline.scoring_config import ScoringConfig
from tests.pipeline.test_engine import BLOCK_SIZE, MAX_SEQ_LEN, _batches, _model, _process, _stream


async def test_fp8_engine_equals_an_fp8_full_recompute_under_eviction() -> None:
    model, vocab = _model(num_known=200, seed=3)
    apply_precision(model, ServingPrecision(kv_dtype="fp8_e4m3", weight_dtype="fp8"))
    cfg = model.config
    geometry = KVCacheConfig(cfg.num_layers, cfg.num_heads, cfg.head_dim, BLOCK_SIZE, FP8)
    cache = KVCache(geometry, 60, "cpu")
    tiers = KVTiers(cache, HostTier(cache, 100), cfg.max_seq_len)
    store = open_history_store("memory://", MAX_SEQ_LEN)
    scoring = ScoringConfig(top_k=10, num_candidates=24, exclude_recent=5)
    engine = Engine(model, tiers, store, vocab, cfg.task_names,
                    EngineConfig(model_name="t", model_version="v", scoring=scoring))  # fmt: skip
    last = {}
    for batch in _batches(_stream(2_000, 80, 200, seed=4), events_per_batch=40):
        last.update(await _process(engine, batch))
    stats = engine.stats()
    assert stats.gpu_hits > 50 and stats.host_hits > 50 and stats.misses > 80
    histories = await store.get(sorted(last))
    expected = full_recompute(
        model, histories, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        head_dim=cfg.head_dim, max_seq_len=cfg.max_seq_len, dtype=FP8,
        task_names=cfg.task_names, scoring=scoring, block_size=BLOCK_SIZE,
    )  # fmt: skip
    assert set(expected) == set(last)
    for user, rec in last.items():
        want = expected[user]
        assert [item for item, _ in rec.items] == [vocab.external(int(r)) for r in want.items]
        got = np.array([score for _, score in rec.items])
        np.testing.assert_allclose(got, want.scores, rtol=1e-4, atol=1e-5)
    host = tiers.host
    assert host is not None and host.kv.dtype == FP8 and host.stats().onloads > 0
    assert not cache.kv.float().isnan().any()  # every code a cached value, never NaN
    await engine.close()
