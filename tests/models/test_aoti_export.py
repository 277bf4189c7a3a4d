"""Export: packages accumulate entry points, a cache hit compiles nothing, keys differ.

One small graph is compiled here (``retrieve``, in a child process through the parallel
path); how a build adds entry points is checked with a stand-in compiler. The four-graph
package and its equality with eager are covered by test_aoti_runtime.py. The child's
package has a key of its own (``retrieve_k=7``): the packages that other modules load are
built in the background while the worker tests run, and those modules run last
(aoti_prebuild.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from streamrec.errors import ExportError
from streamrec.models import aoti_export
from streamrec.models.aoti_export import (
    RETRIEVAL_TABLE,
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
# No other test's key (the generation package is retrieve_k=8): compiled afresh every run.
CHILD_EXPORT = ExportConfig(entry_points=("retrieve",), retrieve_k=7)


def test_parallel_export_compiles_in_a_child_process(tmp_path: Path) -> None:
    model_dir = tiny_model_dir(tmp_path / "m")
    model = load_checkpoint(model_dir).model
    cache = PackageCache(CACHE_DIR)
    key = package_key(
        model.config, "float32", model_version(model_dir), torch.device("cpu"), CHILD_EXPORT
    )
    if cache.directory(key).exists():  # left by an earlier run: compile it afresh
        cache.discard(cache.directory(key))
    lines: list[str] = []
    # a spawned process loads the model directory and compiles
    first = export_model(model_dir, "cpu", CACHE_DIR, config=CHILD_EXPORT, jobs=2)
    assert first.directory == cache.directory(key) and list(first.files) == ["retrieve"]
    version = model_version(model_dir)
    again = build_package(model, version, CACHE_DIR, CHILD_EXPORT, progress=lines.append)
    assert again.directory == first.directory and lines == []  # a hit: nothing compiled
    aoti = load_package(first, torch.device("cpu"), model)
    emb = torch.nn.functional.normalize(torch.randn(3, model.config.d_model), dim=-1)
    exclude = torch.full((3, 2), -1, dtype=torch.int64)
    with torch.no_grad():
        got, want = aoti.retrieve(emb, 7, exclude), model.retrieve(emb, 7, exclude)
    assert rel_err(got[0], want[0]) < 1e-5 and torch.equal(got[1], want[1])
    # The normalised table is a constant bound to the model's cached copy, not computed in
    # the graph: flipping the cached copy in place flips the package's scores too.
    assert RETRIEVAL_TABLE in aoti._runner("retrieve").get_constant_fqns()
    assert first.manifest["constants"][RETRIEVAL_TABLE]["shape"] == list(
        model.item_emb.weight.shape
    )
    with torch.no_grad():
        model.retrieval_table.get(model.item_emb.weight).neg_()
        flipped, want = aoti.retrieve(emb, 7, exclude), model.retrieve(emb, 7, exclude)
    assert rel_err(flipped[0], want[0]) < 1e-5 and torch.equal(flipped[1], want[1])
    assert not torch.equal(flipped[1], got[1])  # the flip changed the answer
    with pytest.raises(ExportError, match="no 'extend' entry point"):
        aoti.extend(*make_batch(model, [2], [1], seed=1).extend_args())


def test_a_build_adds_missing_entry_points_and_carries_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled: list[str] = []

    def fake_compile(model: Any, name: str, config: Any, device: Any, path: Path,
                     progress: Any = None) -> dict[str, float]:  # fmt: skip
        compiled.append(name)
        path.write_bytes(f"graph of {name}".encode())
        return {"export_s": 0.0, "compile_s": 0.0}

    monkeypatch.setattr(aoti_export, "compile_entry_point", fake_compile)
    model = load_checkpoint(tiny_model_dir(tmp_path / "m")).model
    first = build_package(model, "v1", tmp_path / "cache", RETRIEVE_ONLY)
    both = ExportConfig(entry_points=("retrieve", "prefill"), retrieve_k=8)
    grown = build_package(model, "v1", tmp_path / "cache", both)
    assert compiled == ["retrieve", "prefill"]  # retrieve was not compiled twice
    assert grown.directory == first.directory and sorted(grown.files) == ["prefill", "retrieve"]
    assert grown.files["retrieve"].read_bytes() == b"graph of retrieve"
    assert set(grown.manifest["timings"]) == {"prefill", "retrieve"}
    assert grown.manifest["constants"]["model.item_emb.weight"] == {
        "shape": [model.config.num_items, model.config.d_model],
        "dtype": "float32",
    }
    build_package(model, "v1", tmp_path / "cache", RETRIEVE_ONLY)  # a subset: a hit
    assert compiled == ["retrieve", "prefill"]
    build_package(model, "v1", tmp_path / "cache", RETRIEVE_ONLY, force=True)
    assert compiled == ["retrieve", "prefill", "retrieve"]


def test_export_config_is_validated() -> None:
    with pytest.raises(ExportError, match="entry_points=\\('decode',\\)"):
        ExportConfig(entry_points=("decode",))
    with pytest.raises(ExportError, match="retrieve_k=0"):
        ExportConfig(retrieve_k=0)
    with pytest.raises(ExportError, match="jobs=0"):
        export_model("unused", "cpu", "unused", jobs=0)


def test_retrieve_k_changes_the_key_and_entry_points_do_not(tmp_path: Path) -> None:
    model = load_checkpoint(tiny_model_dir(tmp_path / "m")).model
    cpu = torch.device("cpu")
    keys = {
        cfg: package_key(model.config, "float32", "v", cpu, cfg).export_hash
        for cfg in (ExportConfig(), ExportConfig(retrieve_k=8), RETRIEVE_ONLY)
    }
    assert keys[ExportConfig()] != keys[RETRIEVE_ONLY]
    assert keys[ExportConfig(retrieve_k=8)] == keys[RETRIEVE_ONLY]


def test_model_code_covers_every_model_module_it_imports() -> None:
    """A package's key hashes MODEL_CODE: a module the traced code imports but the tuple
    leaves out could change and still load an old graph (row_quantizer was such a module:
    fp8_linear traces its scales)."""
    import ast

    import streamrec

    root = Path(streamrec.__file__).parent.parent

    def source(name: str) -> Path:
        return root / (name.replace(".", "/") + ".py")

    seen, todo, missing = set(aoti_export.MODEL_CODE), list(aoti_export.MODEL_CODE), []
    while todo:
        for node in ast.walk(ast.parse(source(todo.pop()).read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            for name in (node.module, *(f"{node.module}.{a.name}" for a in node.names)):
                model_module = name.startswith("streamrec.models.") and source(name).exists()
                if model_module and name not in seen:
                    seen.add(name)
                    missing.append(name)
                    todo.append(name)
    assert not missing, f"modules traced into packages but not in MODEL_CODE: {missing}"
