"""Export: a key mismatch compiles a new package instead of loading the old one.

Only ``retrieve`` is compiled here (a few seconds); the four-graph package and its
equality with eager are covered by test_aoti_runtime.py.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from streamrec.errors import ExportError
from streamrec.models.aoti_export import ExportConfig, build_package, package_key
from streamrec.models.checkpoint import load_checkpoint
from streamrec.models.package_cache import PackageCache
from tests.models.aoti_fixtures import CACHE_DIR, rel_err, tiny_model_dir

pytestmark = pytest.mark.slow
RETRIEVE_ONLY = ExportConfig(entry_points=("retrieve",), retrieve_k=8)


def test_new_model_version_compiles_new_package(tmp_path: Path) -> None:
    model = load_checkpoint(tiny_model_dir(tmp_path / "m")).model
    cache = PackageCache(CACHE_DIR)
    versions = [f"test-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    lines: list[str] = []
    try:
        first = build_package(model, versions[0], CACHE_DIR, RETRIEVE_ONLY, progress=lines.append)
        assert any("compiled retrieve" in line for line in lines)
        lines.clear()
        again = build_package(model, versions[0], CACHE_DIR, RETRIEVE_ONLY, progress=lines.append)
        assert again.directory == first.directory and lines == []  # a hit: nothing compiled
        second = build_package(model, versions[1], CACHE_DIR, RETRIEVE_ONLY, progress=lines.append)
        assert second.directory != first.directory
        assert any("compiled retrieve" in line for line in lines)
        runner = torch._inductor.aoti_load_package(str(second.files["retrieve"]))
        emb = torch.nn.functional.normalize(torch.randn(3, model.config.d_model), dim=-1)
        exclude = torch.full((3, 2), -1, dtype=torch.int64)
        with torch.no_grad():
            got = runner(emb, exclude)
            want = model.retrieve(emb, 8, exclude)
        assert rel_err(got[0], want[0]) < 1e-5 and torch.equal(got[1], want[1])
    finally:
        for version in versions:
            key = package_key(model.config, "float32", version, torch.device("cpu"), RETRIEVE_ONLY)
            if cache.directory(key).exists():
                cache.discard(cache.directory(key))


def test_export_config_is_validated() -> None:
    with pytest.raises(ExportError, match="entry_points=\\('decode',\\)"):
        ExportConfig(entry_points=("decode",))
    with pytest.raises(ExportError, match="retrieve_k=0"):
        ExportConfig(retrieve_k=0)


def test_export_config_changes_the_key(tmp_path: Path) -> None:
    model = load_checkpoint(tiny_model_dir(tmp_path / "m")).model
    cpu = torch.device("cpu")
    keys = {
        package_key(model.config, "float32", "v", cpu, cfg).export_hash
        for cfg in (ExportConfig(), ExportConfig(retrieve_k=8), RETRIEVE_ONLY)
    }
    assert len(keys) == 3
