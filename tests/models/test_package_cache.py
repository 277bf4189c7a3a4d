"""Package cache: keys, atomic publish, verification (no compiling: fake .pt2 files)."""

from __future__ import annotations

import json
import os
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


# ------------------------------------------------------------------ eviction


def keyed(n: int) -> PackageKey:
    return replace(KEY, model_version=f"v{n}")


def fill(cache: PackageCache, count: int, size: int) -> list[Path]:
    """``count`` packages of ``size`` bytes, used in that order (oldest first)."""
    dirs = []
    for n in range(count):
        dirs.append(publish(cache, keyed(n), bytes(size)))
        cache.lease(keyed(n)).release()  # "used now": n is newer than n - 1
        time.sleep(0.01)
    return dirs


def test_evict_removes_the_least_recently_used_first(tmp_path: Path) -> None:
    big = PackageCache(tmp_path)  # default bound: nothing is evicted while filling
    dirs = fill(big, 4, 10_000)
    big.lease(keyed(0)).release()  # v0 used again: now v1 is the oldest
    small = PackageCache(tmp_path, max_bytes=25_000)
    removed = small.evict()
    assert removed == [dirs[1], dirs[2]]
    assert [d.name for d in small.packages()] == [dirs[3].name, dirs[0].name]


def test_evict_never_removes_a_leased_or_kept_package(tmp_path: Path) -> None:
    dirs = fill(PackageCache(tmp_path), 3, 10_000)
    cache = PackageCache(tmp_path, max_bytes=1)  # everything is over the bound
    lease = cache.lease(keyed(0))  # in use (by this process: flock is per open file)
    removed = cache.evict(keep=(dirs[2],))
    assert removed == [dirs[1]]
    assert dirs[0].is_dir() and dirs[2].is_dir()
    lease.release()
    assert cache.evict(keep=(dirs[2],)) == [dirs[0]]


def test_publish_evicts_older_packages_but_not_the_new_one(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path, max_bytes=15_000)
    first = publish(cache, keyed(0), bytes(10_000))
    time.sleep(0.01)
    second = publish(cache, keyed(1), bytes(10_000))
    assert not first.exists() and second.is_dir()
    alone = publish(cache, keyed(2), bytes(20_000))  # larger than the bound by itself
    assert alone.is_dir() and not second.exists()


def test_evict_clears_staging_left_by_dead_processes(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path)
    stale, fresh = cache.staging(KEY), cache.staging(keyed(1))
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    cache.evict()
    assert not stale.exists() and fresh.is_dir()


def test_carry_over_links_the_files_of_the_old_package(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path)
    publish(cache, KEY, b"extend graph")
    old = cache.open(KEY)
    staging = cache.staging(KEY)
    assert cache.carry_over(old, staging) == {"extend": "extend.pt2"}
    (staging / "rank.pt2").write_bytes(b"rank graph")
    new = cache.publish(KEY, staging, {"extend": "extend.pt2", "rank": "rank.pt2"}, {})
    assert sorted(new.files) == ["extend", "rank"]
    assert new.files["extend"].read_bytes() == b"extend graph"


def test_bound_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="max_bytes=0"):
        PackageCache(tmp_path, max_bytes=0)


def test_a_read_only_cache_still_leases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = PackageCache(tmp_path)
    publish(cache, KEY)

    def read_only(path: object, *args: object, **kwargs: object) -> int:
        raise OSError(30, "Read-only file system", str(path))

    with monkeypatch.context() as patch:
        patch.setattr(os, "open", read_only)
        lease = cache.lease(KEY)  # cannot create the use file: an empty lease
    assert lease.directory == cache.directory(KEY)
    lease.release()
    assert not list(tmp_path.glob(".*.use"))
