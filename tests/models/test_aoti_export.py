"""Export: packages accumulate entry points, a cache hit compiles nothing, keys differ.

Two small graphs are compiled here (``retrieve`` in a child process through the parallel
path, then ``prefill`` added in this process); the four-graph package and its equality
with eager are covered by test_aoti_runtime.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrec.errors import ExportError
from streamrec.models.aoti_export import (
    ExportConfig,
    build_package,
    export_model,
    package_key,
)
from streamrec.models.aoti_runtime import load_package
from streamrec.models.checkpoint import load_checkpoint, model_version
from streamrec.models.package_cache import PackageCache
from tests.models.aoti_fixtures import CACHE_DIR, make_batch, rel_err, tiny_model_dir

pytestmark = pytest.mark.slow
RETRIEVE_ONLY = ExportConfig(entry_points=("retrieve",), retrieve_k=8)


def test_entry_points_accumulate_in_one_package(tmp_path: Path) -> None:
    model_dir = tiny_model_dir(tmp_path / "m")
    model = load_checkpoint(model_dir).model
    version = model_version(model_dir)
    cache = PackageCache(CACHE_DIR)
    key = package_key(model.config, "float32", version, torch.device("cpu"), RETRIEVE_ONLY)
    both = ExportConfig(entry_points=("retrieve", "prefill"), retrieve_k=8)
    lines: list[str] = []
    if cache.directory(key).exists():  # left by an interrupted run
        cache.discard(cache.directory(key))
    try:
        # the parallel path: a spawned process loads the model directory and compiles
        first = export_model(model_dir, "cpu", CACHE_DIR, config=RETRIEVE_ONLY, jobs=2)
        assert first.directory == cache.directory(key)
        again = build_package(model, version, CACHE_DIR, RETRIEVE_ONLY, progress=lines.append)
        assert again.directory == first.directory and lines == []  # a hit: nothing compiled
        grown = build_package(model, version, CACHE_DIR, both, progress=lines.append)
        assert sorted(grown.files) == ["prefill", "retrieve"]
        assert any("compiled prefill" in line for line in lines)
        assert not any("compiled retrieve" in line for line in lines)  # carried over
        assert grown.files["retrieve"].stat().st_ino == first.files["retrieve"].stat().st_ino
        assert set(grown.manifest["timings"]) == {"prefill", "retrieve"}
        aoti = load_package(grown, torch.device("cpu"), model)
        emb = torch.nn.functional.normalize(torch.randn(3, model.config.d_model), dim=-1)
        exclude = torch.full((3, 2), -1, dtype=torch.int64)
        batch = make_batch(model, [0, 0], [5, 2], seed=3)
        with torch.no_grad():
            got, want = aoti.retrieve(emb, 8, exclude), model.retrieve(emb, 8, exclude)
            assert rel_err(got[0], want[0]) < 1e-5 and torch.equal(got[1], want[1])
            args = batch.extend_args()[:4]
            for g, w in zip(aoti.prefill(*args), model.prefill(*args), strict=True):
                assert rel_err(g, w) < 1e-5
        with pytest.raises(ExportError, match="no 'extend' entry point"):
            aoti.extend(*batch.extend_args())
    finally:
        if cache.directory(key).exists():
            cache.discard(cache.directory(key))


def test_export_config_is_validated() -> None:
    with pytest.raises(ExportError, match="entry_points=\\('decode',\\)"):
        ExportConfig(entry_points=("decode",))
    with pytest.raises(ExportError, match="retrieve_k=0"):
        ExportConfig(retrieve_k=0)


def test_retrieve_k_changes_the_key_and_entry_points_do_not(tmp_path: Path) -> None:
    model = load_checkpoint(tiny_model_dir(tmp_path / "m")).model
    cpu = torch.device("cpu")
    keys = {
        cfg: package_key(model.config, "float32", "v", cpu, cfg).export_hash
        for cfg in (ExportConfig(), ExportConfig(retrieve_k=8), RETRIEVE_ONLY)
    }
    assert keys[ExportConfig()] != keys[RETRIEVE_ONLY]
    assert keys[ExportConfig(retrieve_k=8)] == keys[RETRIEVE_ONLY]
