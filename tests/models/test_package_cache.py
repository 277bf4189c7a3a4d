"""Package cache: keys, atomic publish, verification (no compiling: fake .pt2 files)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from streamrec.errors import ExportError
from streamrec.models.package_cache import PackageCache, PackageKey, device_kind

KEY = PackageKey("abc123", "2.13.0+cpu", "cpu", "float32", "0f0f0f")


def publish(cache: PackageCache, key: PackageKey, payload: bytes = b"graph") -> Path:
    staging = cache.staging(key)
    (staging / "extend.pt2").write_bytes(payload)
    return cache.publish(key, staging, {"extend": "extend.pt2"}, {"note": 1}).directory


def test_publish_then_open_round_trips(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path)
    directory = publish(cache, KEY)
    opened = cache.open(KEY)
    assert opened.directory == directory == tmp_path / KEY.dirname
    assert opened.files == {"extend": directory / "extend.pt2"}
    assert opened.manifest["key"] == KEY.to_dict() and opened.manifest["note"] == 1
    assert not list(tmp_path.glob(".tmp-*"))  # the staging directory became the package


@pytest.mark.parametrize(
    "field", ["model_version", "torch_version", "device_kind", "dtype", "export_hash"]
)
def test_any_key_change_misses(tmp_path: Path, field: str) -> None:
    cache = PackageCache(tmp_path)
    publish(cache, KEY)
    other = replace(KEY, **{field: "zz9"})
    assert other.dirname != KEY.dirname
    with pytest.raises(ExportError, match="no AOTI package"):
        cache.open(other)


def test_manifest_of_another_key_is_rejected(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path)
    directory = publish(cache, KEY)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["key"]["model_version"] = "other"
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="does not match"):
        cache.open(KEY)


def test_republish_replaces_a_corrupt_package(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path)
    directory = publish(cache, KEY, b"old")
    (directory / "extend.pt2").write_bytes(b"bad")
    with pytest.raises(ExportError, match="sha256"):
        cache.open(KEY)
    publish(cache, KEY, b"new graph")
    assert cache.open(KEY).files["extend"].read_bytes() == b"new graph"
    assert not list(tmp_path.glob(".trash-*"))


def test_lock_serialises_builders(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path)
    events: list[str] = []

    def builder(name: str) -> None:
        with cache.lock(KEY):
            events.append(f"{name}-in")
            time.sleep(0.05)
            events.append(f"{name}-out")

    threads = [threading.Thread(target=builder, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert events[0][0] == events[1][0] and events[2][0] == events[3][0]


def test_bad_key_parts_are_rejected() -> None:
    with pytest.raises(ExportError, match=r"model_version='\.\./x'"):
        PackageKey("../x", "2.13.0", "cpu", "float32", "h")


def test_device_kind_of_cpu() -> None:
    assert device_kind(torch.device("cpu")) == "cpu"
