"""Backend choice: the AOTI package when one matches the model, else eager (or an error)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.errors import ConfigError, ModelError
from streamrec.models.aoti_runtime import AOTIModel, open_aoti_model
from streamrec.models.checkpoint import load_checkpoint
from streamrec.models.hstu import HSTU
from streamrec.models.quantization import model_precision
from streamrec.models.serving_precision import ServingPrecision
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.worker.config import CacheConfig, ModelConfig
from streamrec.worker.model_loader import (
    export_config_for,
    graphed_serving_model,
    load_model,
    prefill_is_jagged,
    set_host_threads,
)
from streamrec.worker.serving_stack import build_tiers
from tests.models.aoti_fixtures import CACHE_DIR, EXPORT, tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("loader") / "model")


def test_worker_and_tests_share_one_export_config() -> None:
    assert export_config_for(ScoringConfig()) == EXPORT


@pytest.mark.usefixtures("serving_prebuilt")
def test_serves_aoti_when_the_package_exists(model_dir: Path) -> None:
    # Built in the background for the session (same deterministic model), else here.
    open_aoti_model(model_dir, "cpu", CACHE_DIR, compile_if_missing=True, config=EXPORT)

    cfg = ModelConfig(model_dir=model_dir, aoti_cache_dir=CACHE_DIR, device="cpu", backend="aoti")
    loaded = load_model(cfg)
    assert loaded.backend == "aoti"
    assert isinstance(loaded.model, AOTIModel)
    assert loaded.model.weights is loaded.checkpoint.model  # one copy of the weights
    # metadata checks only: the value check's host copy would sync before every replay
    assert not loaded.model.check_values
    eager = load_checkpoint(model_dir).model
    user_emb = torch.nn.functional.normalize(torch.randn(2, eager.config.d_model), dim=-1)
    none = torch.full((2, 1), -1, dtype=torch.int64)
    with torch.inference_mode():
        assert torch.equal(
            loaded.model.retrieve(user_emb, 5, none)[1], eager.retrieve(user_emb, 5, none)[1]
        )


def test_falls_back_to_eager_with_a_warning(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = ModelConfig(model_dir=model_dir, aoti_cache_dir=tmp_path / "empty", device="cpu")
    with caplog.at_level(logging.WARNING):
        loaded = load_model(cfg)
    assert loaded.backend == "eager_fallback"  # the metric that the fallback alert reads
    assert any("serving the eager model" in r.getMessage() for r in caplog.records)


@pytest.mark.usefixtures("serving_prebuilt")
def test_backend_eager_opens_no_package(model_dir: Path, tmp_path: Path) -> None:
    """With an AOTI package in the cache, ``backend = "eager"`` still serves the module."""
    open_aoti_model(model_dir, "cpu", CACHE_DIR, compile_if_missing=True, config=EXPORT)
    cfg = ModelConfig(model_dir=model_dir, aoti_cache_dir=CACHE_DIR, device="cpu")
    assert load_model(dataclasses.replace(cfg, backend="aoti")).backend == "aoti"
    loaded = load_model(dataclasses.replace(cfg, backend="eager"))
    assert loaded.backend == "eager" and isinstance(loaded.model, HSTU)


def test_backend_aoti_without_a_package_is_a_start_up_error(
    model_dir: Path, tmp_path: Path
) -> None:
    cfg = ModelConfig(
        model_dir=model_dir, aoti_cache_dir=tmp_path / "empty", device="cpu", backend="aoti"
    )
    with pytest.raises(ModelError, match=r"model\.backend is 'aoti'"):
        load_model(cfg)


def test_graphs_apply_on_cuda_only(model_dir: Path, tmp_path: Path) -> None:
    cfg = ModelConfig(model_dir=model_dir, aoti_cache_dir=tmp_path / "empty", device="cpu")
    loaded = load_model(cfg)
    cache = KVCache(KVCacheConfig(2, 2, 4, 4), 8, "cpu")
    assert graphed_serving_model(loaded, cache, cfg, max_batch_users=4, num_candidates=3) is None


def test_the_configured_precision_reaches_the_model_and_the_pool(
    model_dir: Path, tmp_path: Path
) -> None:
    cfg = ModelConfig(
        model_dir=model_dir, aoti_cache_dir=tmp_path / "empty", device="cpu", weight_dtype="fp8"
    )
    loaded = load_model(cfg, kv_dtype="fp8_e4m3")
    assert model_precision(loaded.checkpoint.model) == ServingPrecision("fp8_e4m3", "fp8")
    tiers = build_tiers(CacheConfig(kv_dtype="fp8_e4m3", kv_budget_bytes=1 << 20), loaded)
    assert tiers.cache.kv.dtype == torch.float8_e4m3fn
    with pytest.raises(ConfigError, match=r"cache\.kv_dtype = 'model'"):
        build_tiers(CacheConfig(kv_budget_bytes=1 << 20), loaded)


def test_host_threads_are_one_on_cuda_unless_configured() -> None:
    before = torch.get_num_threads()
    try:
        assert set_host_threads(ModelConfig(), torch.device("cpu")) == before  # untouched
        assert set_host_threads(ModelConfig(), torch.device("cuda")) == 1
        assert set_host_threads(ModelConfig(host_threads=2), torch.device("cuda")) == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="host_threads"):
        ModelConfig(host_threads=-1)


def test_prefill_is_jagged_only_where_the_fused_op_runs(model_dir: Path) -> None:
    """The CPU prefill is the dense recompute: the engine keeps its length classes there
    (on CUDA with Triton the fused op pads nothing: one call, test_model_step.py)."""
    cfg = load_checkpoint(model_dir).config
    assert not prefill_is_jagged(cfg, torch.device("cpu"))
