"""The item table past the GPU budget: same recommendations as the all-GPU table (issue 20)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import numpy as np
import pytest
import torch

from streamrec.cache.embedding_cache import EmbeddingCache
from streamrec.cache.history_backends import open_history_store
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_tiers import KVTiers
from streamrec.cache.retrieval_set import RetrievalSet
from streamrec.errors import ConfigError
from streamrec.models.hstu import HSTU
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.pipeline.engine import Engine, EngineConfig
from streamrec.pipeline.item_catalog import MIN_FREE_SLOTS, ItemCatalog
from streamrec.pipeline.micro_batcher import Batch
from streamrec.pipeline.scorer import ScoringConfig
from streamrec.schemas.records import Recommendation
from tests.pipeline.test_engine import _batches, _model, _process, _stream

SCORING = ScoringConfig(top_k=8, num_candidates=16, exclude_recent=4)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _engine(
    model: HSTU, vocab: ItemVocabulary, catalog: ItemCatalog | None, device: str = "cpu"
) -> Engine:
    cfg = model.config
    geometry = KVCacheConfig(cfg.num_layers, cfg.num_heads, cfg.head_dim, 4, torch.float32)
    tiers = KVTiers(KVCache(geometry, 800, device), None, cfg.max_seq_len)
    return Engine(
        model,
        tiers,
        open_history_store("memory://", cfg.max_seq_len),
        vocab,
        cfg.task_names,
        EngineConfig(model_name="t", model_version="v0", scoring=SCORING),
        catalog=catalog,
    )


def _catalog(
    model: HSTU,
    slots: int,
    set_size: int | None = None,
    device: str = "cpu",
    min_free_slots: int = MIN_FREE_SLOTS,
) -> ItemCatalog:
    cfg = model.config
    table = model.item_emb.weight.detach().cpu().clone()  # [V, D] host
    first = cfg.first_item_row
    size = cfg.num_items - first if set_size is None else set_size
    embeddings = EmbeddingCache(table, device, num_slots=slots, staging_rows=64)
    retrievable = RetrievalSet(table, device, size, first, refresh_events=50)
    return ItemCatalog(embeddings, retrievable, min_free_slots)


async def _compare(
    plain: Engine,
    other: Engine,
    batches: Iterable[Batch],
    check: Callable[[Recommendation, Recommendation], None],
) -> int:
    """Run both engines on the same batches; ``check(got, want)`` for every user."""
    compared = 0
    for batch in batches:
        want = await _process(plain, batch)
        got = await _process(other, batch)
        assert want.keys() == got.keys()
        for user, rec in got.items():
            ref = want[user]
            assert rec is not None and ref is not None
            check(rec, ref)
            compared += 1
    return compared


@pytest.mark.parametrize("device", DEVICES)
async def test_embedding_cache_engine_outputs_equal_the_all_gpu_table(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, vocab = _model(num_known=1500)
    model = model.to(device)
    cached_model = copy.deepcopy(model)
    catalog = _catalog(cached_model, slots=600, device=device)
    catalog.bind(cached_model)
    assert cached_model.item_emb.weight.data_ptr() == catalog.embeddings.rows.data_ptr()
    plain = _engine(model, vocab, None, device)
    cached = _engine(cached_model, vocab, catalog, device)

    def close(rec: Recommendation, ref: Recommendation) -> None:
        assert [i for i, _ in rec.items] == [i for i, _ in ref.items]
        np.testing.assert_allclose(
            [s for _, s in rec.items], [s for _, s in ref.items], rtol=1e-5, atol=1e-6
        )
        assert rec.task_scores is not None and ref.task_scores is not None
        for name, scores in rec.task_scores.items():
            np.testing.assert_allclose(scores, ref.task_scores[name], rtol=1e-5, atol=1e-6)

    stream = _stream(1_200, 40, 1500, seed=4)
    compared = await _compare(plain, cached, _batches(stream, events_per_batch=8), close)
    emb, rset = catalog.stats()
    assert compared > 500
    assert emb.misses > 400 and emb.evictions > 0 and 0 < emb.hit_rate < 1
    assert emb.bytes_copied == emb.misses * cached_model.config.d_model * 4
    assert rset.events == 1_200 and 0.99 < rset.coverage < 1.0  # OOV buckets: never members
    assert rset.refreshes > 0
    await plain.close()
    await cached.close()


async def test_embedding_cache_with_a_small_retrievable_set_returns_only_members() -> None:
    model, vocab = _model(num_known=400)
    catalog = _catalog(model, slots=300, set_size=64)
    catalog.bind(model)
    engine = _engine(model, vocab, catalog)
    for batch in _batches(_stream(300, 20, 400, seed=5), events_per_batch=10):
        for rec in (await _process(engine, batch)).values():
            for item, _ in rec.items:
                assert catalog.retrievable._position_of[vocab.index(item)] >= 0
    assert catalog.stats()[1].swapped > 0  # popular items were swapped in while serving
    await engine.close()


@pytest.mark.parametrize("device", DEVICES)
async def test_embedding_cache_pinned_retrievable_set_serves_the_same_lists(device: str) -> None:
    """Members pinned in the cache, candidate slots from the device table: the same lists
    as the host lookups, through set refreshes that swap members in and out."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, vocab = _model(num_known=400)
    model = model.to(device)
    pinned_model = copy.deepcopy(model)
    table = model.item_emb.weight.detach().cpu().clone()  # [V, D]: bind() replaces it
    host = _catalog(model, slots=300, set_size=64, device=device)  # room 236: no pins
    pinned = _catalog(pinned_model, slots=300, set_size=64, device=device, min_free_slots=128)
    assert not host.members_pinned and pinned.members_pinned
    host.bind(model)
    pinned.bind(pinned_model)
    plain, fast = _engine(model, vocab, host, device), _engine(pinned_model, vocab, pinned, device)

    def same(rec: Recommendation, ref: Recommendation) -> None:
        assert rec.items == ref.items and rec.task_scores == ref.task_scores

    batches = _batches(_stream(300, 20, 400, seed=5), events_per_batch=10)
    compared = await _compare(plain, fast, batches, same)
    emb, rset = pinned.stats()
    assert compared > 200 and rset.swapped > 0 and emb.pinned == 64
    members = pinned.retrievable.members
    assert pinned._row_slots is not None
    slots = pinned._row_slots[1:].cpu().numpy()
    assert np.array_equal(pinned.embeddings._slot_of[members], slots)  # map follows swaps
    rows = pinned.embeddings.rows[torch.from_numpy(slots).to(device)].cpu()
    assert torch.equal(rows, table[members])
    assert emb.hit_rate > host.stats()[0].hit_rate  # candidates never miss
    await plain.close()
    await fast.close()


def test_embedding_cache_catalog_smaller_than_the_candidate_pool_is_refused() -> None:
    model, vocab = _model(num_known=100)
    catalog = _catalog(model, slots=300, set_size=8)
    with pytest.raises(ConfigError, match="holds 8 items, fewer than the 16"):
        _engine(model, vocab, catalog)
