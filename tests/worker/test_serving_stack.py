"""The worker's wiring of the catalogue past the GPU budget and of the disk tier."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrec.errors import ConfigError, ModelError
from streamrec.models.checkpoint import load_checkpoint
from streamrec.models.hstu import HSTU
from streamrec.pipeline.model_step import PREFILL_CALL_TOKENS
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.worker.config import CacheConfig, ModelConfig, WorkerConfig
from streamrec.worker.model_loader import load_model
from streamrec.worker.serving_stack import build_catalog, build_tiers, engine_config
from tests.models.aoti_fixtures import tiny_model_dir

SCORING = ScoringConfig(top_k=4, num_candidates=8, exclude_recent=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("stack") / "model")


def _cfg(model_dir: Path, tmp_path: Path, **kw: object) -> ModelConfig:
    return ModelConfig(model_dir=model_dir, aoti_cache_dir=tmp_path / "none", device="cpu", **kw)


@pytest.mark.parametrize(("configured", "want"), [(0, PREFILL_CALL_TOKENS), (65_536, 65_536)])
def test_engine_config_takes_the_prefill_cut_from_the_model_section(
    model_dir: Path, tmp_path: Path, configured: int, want: int
) -> None:
    model = _cfg(model_dir, tmp_path, prefill_call_tokens=configured)
    loaded = load_model(model, SCORING)
    engine = engine_config(WorkerConfig(model=model), loaded, SCORING)
    assert engine.prefill_call_tokens == want
    assert (engine.model_name, engine.model_version) == (
        loaded.checkpoint.model_name, loaded.checkpoint.version,
    )  # fmt: skip
    assert engine.jagged_prefill == loaded.jagged_prefill


def test_embedding_cache_keeps_the_item_table_on_the_host(model_dir: Path, tmp_path: Path) -> None:
    loaded = load_model(_cfg(model_dir, tmp_path), SCORING, embedding_cache_rows=20)
    reference = load_checkpoint(model_dir).model
    assert loaded.backend == "eager" and loaded.item_table is not None
    assert torch.equal(loaded.item_table, reference.item_emb.weight)
    model = loaded.model
    assert isinstance(model, HSTU) and model.item_emb.weight.shape[0] == 0  # nothing bound yet
    cache = CacheConfig(embedding_cache_rows=20, retrievable_items=30)
    catalog = build_catalog(cache, loaded, SCORING)
    assert catalog is not None and catalog.size == 30
    assert model.item_emb.weight.data_ptr() == catalog.embeddings.rows.data_ptr()
    items = np.array([4, 40, 7, 4])
    slots = catalog.slots(items)
    assert torch.equal(
        model.item_emb.weight[torch.from_numpy(slots)], reference.item_emb.weight[items]
    )
    catalog.close()


def test_embedding_cache_rows_covering_the_table_change_nothing(
    model_dir: Path, tmp_path: Path
) -> None:
    loaded = load_model(_cfg(model_dir, tmp_path), SCORING, embedding_cache_rows=10_000)
    assert loaded.item_table is None
    assert build_catalog(CacheConfig(embedding_cache_rows=10_000), loaded, SCORING) is None


def test_embedding_cache_misconfiguration_is_a_start_up_error(
    model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ModelError, match=r"model\.backend"):
        load_model(_cfg(model_dir, tmp_path, backend="aoti"), SCORING, embedding_cache_rows=20)
    loaded = load_model(_cfg(model_dir, tmp_path), SCORING, embedding_cache_rows=20)
    small = CacheConfig(embedding_cache_rows=20, retrievable_items=5)
    with pytest.raises(ConfigError, match=r"retrievable_items = 5 .* fewer than the 8"):
        build_catalog(small, loaded, SCORING)


def test_disk_tier_needs_a_host_tier(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ConfigError, match="disk_tier_bytes = 1000: needs a host tier"):
        CacheConfig(disk_tier_bytes=1000, host_tier_bytes=0)
    loaded = load_model(_cfg(model_dir, tmp_path), SCORING)
    cache = CacheConfig(kv_budget_bytes=1 << 20, disk_tier_bytes=1 << 30, disk_tier_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        tiers = build_tiers(cache, loaded)  # on the CPU there is no host tier
    assert tiers.disk is None and any("no disk tier" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
def test_disk_tier_is_built_behind_the_host_tier_on_the_gpu(
    model_dir: Path, tmp_path: Path
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    loaded = load_model(ModelConfig(model_dir=model_dir, aoti_cache_dir=tmp_path, device="cuda"))
    cache = CacheConfig(
        kv_budget_bytes=1 << 24, host_tier_bytes=1 << 24, disk_tier_bytes=1 << 26,
        disk_tier_dir=tmp_path / "kv",
    )  # fmt: skip
    tiers = build_tiers(cache, loaded)
    assert tiers.disk is not None and tiers.disk.directory.parent == tmp_path / "kv"
    assert tiers.disk.model_version == loaded.checkpoint.version
    tiers.close()
