"""The bench's reference model directory, built by several workers at once."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench import aoti_packages
from bench.h200_common import build_model
from bench.reference_config import ReferenceWorkload
from streamrec.models.checkpoint import META, load_checkpoint

TINY = ReferenceWorkload(
    name="tiny", num_layers=1, d_model=32, num_heads=2, head_dim=16, max_seq_len=64,
    num_items=512, history_median=8, dtype="float32",
)  # fmt: skip


def test_concurrent_builds_leave_one_complete_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aoti_packages, "build_model", functools.partial(build_model, device="cpu"))
    with ThreadPoolExecutor(max_workers=4) as pool:
        paths = list(
            pool.map(lambda _: aoti_packages.reference_model_dir(TINY, tmp_path), range(4))
        )
    assert paths == [tmp_path / "tiny"] * 4
    assert (tmp_path / "tiny" / META).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no .tmp-* left behind
    assert load_checkpoint(tmp_path / "tiny").model.config.num_items == 512
