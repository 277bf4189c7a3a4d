"""The disk tier behind the host tier: round trips, torn and stale files, bounded size."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from streamrec.cache.disk_tier import DiskTier, file_bytes
from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_file import HEADER_BYTES, SUFFIX
from streamrec.cache.kv_tiers import Admission, CacheOutcome, KVTiers
from streamrec.errors import ConfigError

CFG = KVCacheConfig(num_layers=2, num_heads=1, head_dim=4, block_size=4, dtype=torch.float32)
GPU, HOST, DISK, MISS = (
    CacheOutcome.GPU_HIT,
    CacheOutcome.HOST_HIT,
    CacheOutcome.DISK_HIT,
    CacheOutcome.MISS,
)
MAX_BLOCKS = 4  # max_seq_len 16 / block size 4


def _tiers(
    directory: Path, disk_users: int = 8, version: str = "v1", device: str = "cpu"
) -> KVTiers:
    cache = KVCache(CFG, num_blocks=6, device=device)
    host = HostTier(cache, 4)  # two users of 2 blocks
    budget = disk_users * file_bytes(cache, 2)
    disk = DiskTier(cache, directory, budget, version, max_blocks=MAX_BLOCKS, staging_users=2)
    return KVTiers(cache, host, max_seq_len=16, disk=disk)


def _step(tiers: KVTiers, user: str, n: int) -> Admission:
    """One step of ``n`` tokens; K/V values say whose they are and where."""
    tiers.settle([user])
    admission = tiers.ensure_room({user: n})
    assert isinstance(admission, Admission), admission
    start = tiers.cache.pool.length(user) if user in tiers.cache.pool else 0
    slots = tiers.append(user, n)
    base = float(sum(map(ord, user)) * 100)
    k = (base + torch.arange(start, start + n, dtype=torch.float32)).view(1, n, 1, 1)
    k = k.expand(CFG.num_layers, n, 1, CFG.head_dim).contiguous()
    tiers.cache.write(slots, k, -k, torch.arange(start, start + n) + 10**12)
    tiers.unpin([user])
    return admission


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*" + SUFFIX))


def _wait_written(tiers: KVTiers) -> None:
    assert tiers.disk is not None
    for user in list(tiers.disk._writing):
        tiers.disk.store(user, tiers.host.snapshot(user)) if tiers.host else None


def test_disk_tier_round_trip_through_all_three_tiers(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path)
    saved = {}
    for user in "abcdef":
        _step(tiers, user, 8)  # 2 blocks each: GPU holds 3, host 2
        saved[user] = tiers.cache.read(user)
    where = {"a": DISK, "b": HOST, "c": HOST, "d": GPU, "e": GPU, "f": GPU}
    assert tiers.resolve("abcdef") == where
    assert tiers.settle(["a"]) == {"a": DISK}
    admission = _step(tiers, "a", 1)  # disk -> GPU; the GPU's LRU (d) goes to the host
    assert admission.outcomes == {"a": DISK} and admission.dropped == []
    k, v, ts = tiers.cache.read("a")
    assert torch.equal(k[:, :8], saved["a"][0]) and torch.equal(v[:, :8], saved["a"][1])
    assert torch.equal(ts[:8], saved["a"][2]) and float(k[0, 8, 0, 0]) == 97 * 100 + 8
    assert "a" not in tiers.disk  # type: ignore[operator]  # the file went with the onload
    stats = tiers.stats()
    assert stats.disk_hits == 1 and stats.disk is not None
    assert stats.disk.loads == 1 and stats.disk.bytes_read == 2 * CFG.bytes_per_block
    assert stats.disk.verify_failures == 0
    for user in ("b", "c"):  # every other user comes back intact, from wherever it is
        _step(tiers, user, 0)
        for got, want in zip(tiers.cache.read(user), saved[user], strict=True):
            assert torch.equal(got, want)
    tiers.close()
    assert _files(tmp_path) == []


def test_an_fp8_pool_round_trips_its_codes_through_disk(tmp_path: Path) -> None:
    """FP8 codes (cache.kv_dtype = fp8_e4m3) go to the host and to disk as their bytes
    (half a bf16 file) and come back unchanged."""
    fp8 = KVCacheConfig(num_layers=2, num_heads=1, head_dim=4, block_size=4,
                        dtype=torch.float8_e4m3fn)  # fmt: skip
    cache = KVCache(fp8, num_blocks=6, device="cpu")
    disk = DiskTier(cache, tmp_path, 8 * file_bytes(cache, 2), "v1", max_blocks=MAX_BLOCKS,
                    staging_users=2)  # fmt: skip
    tiers = KVTiers(cache, HostTier(cache, 4), max_seq_len=16, disk=disk)
    gen = torch.Generator().manual_seed(0)
    saved = {}
    for user in "abcdef":
        tiers.settle([user])
        assert isinstance(tiers.ensure_room({user: 8}), Admission)
        slots = tiers.append(user, 8)
        k, v = ((torch.randn(2, 8, 1, 4, generator=gen) * 50).to(fp8.dtype) for _ in "kv")
        tiers.cache.write(slots, k, v, torch.arange(8) + 10**12)
        tiers.unpin([user])
        saved[user] = [t.view(torch.uint8).clone() for t in cache.read(user)[:2]]
    assert tiers.resolve("a") == {"a": DISK}
    assert tiers.settle(["a"]) == {"a": DISK}
    assert tiers.ensure_room({"a": 0}).outcomes == {"a": DISK}  # type: ignore[union-attr]
    tiers.unpin(["a"])
    for got, want in zip(cache.read("a")[:2], saved["a"], strict=True):
        assert got.dtype == fp8.dtype and torch.equal(got.view(torch.uint8), want)
    assert file_bytes(cache, 2) < file_bytes(KVCache(CFG, 6, "cpu"), 2)
    tiers.close()


def test_disk_tier_window_trim_on_the_way_back(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path)
    for user in "abcdef":
        _step(tiers, user, 8)
    before = tiers.cache.read("d")
    for user in "ghi":  # d falls to disk
        _step(tiers, user, 8)
    assert tiers.resolve(["d"]) == {"d": DISK}
    admission = _step(tiers, "d", 12)  # 8 + 12 > 16: the oldest block goes
    assert admission.trimmed_tokens == 4 and tiers.cache.pool.length("d") == 16
    k, _, ts = tiers.cache.read("d")
    assert torch.equal(k[:, :4], before[0][:, 4:8]) and torch.equal(ts[:4], before[2][4:8])
    tiers.close()


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "delete", "stale"])
def test_disk_tier_torn_or_stale_file_is_a_miss(tmp_path: Path, damage: str) -> None:
    tiers = _tiers(tmp_path)
    for user in "abcdef":
        _step(tiers, user, 8)
    assert tiers.resolve(["a"]) == {"a": DISK}
    entry = tiers.disk._entries["a"]  # type: ignore[union-attr]
    path = entry.path
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[: len(data) - 7])
    elif damage == "flip_payload":
        data[HEADER_BYTES + 5] ^= 0xFF
        path.write_bytes(data)
    elif damage == "flip_header":
        data[12] ^= 0x01  # the sequence number; the header CRC no longer matches
        path.write_bytes(data)
    elif damage == "delete":
        path.unlink()
    else:  # a well-formed file of an older write of the user
        entry.seq += 1
    assert tiers.settle(["a"]) == {"a": MISS}
    stats = tiers.stats().disk
    assert stats is not None and stats.verify_failures == 1 and stats.loads == 0
    assert "a" not in tiers.disk  # type: ignore[operator]
    assert _step(tiers, "a", 8).outcomes == {"a": MISS}  # rebuilt from scratch
    tiers.close()


def test_disk_tier_refuses_a_file_of_another_model_version(tmp_path: Path) -> None:
    old = _tiers(tmp_path / "x", version="v1")
    for user in "abcdef":
        _step(old, user, 8)
    old_file = old.disk._entries["a"].path  # type: ignore[union-attr]
    new = _tiers(tmp_path / "y", version="v2")
    for user in "abcdef":
        _step(new, user, 8)
    new_entry = new.disk._entries["a"]  # type: ignore[union-attr]
    # Same geometry, user, sequence and length: only the model version differs.
    assert old.disk._entries["a"].seq == new_entry.seq  # type: ignore[union-attr]
    new_entry.path.write_bytes(old_file.read_bytes())
    assert new.settle(["a"]) == {"a": MISS}
    old.close()
    new.close()


def test_disk_tier_is_bounded_and_evicts_the_oldest_file(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path, disk_users=2)
    for user in "abcdefg":
        _step(tiers, user, 8)
    _wait_written(tiers)
    stats = tiers.stats().disk
    assert stats is not None and stats.bytes_used <= stats.budget_bytes
    assert stats.users == 2 and stats.evictions + stats.rejects > 0
    on_disk = [u for u in "abcdefg" if tiers.resolve([u])[u] is DISK]
    assert on_disk and "a" not in on_disk  # the oldest went first
    assert tiers.resolve(["a"]) == {"a": MISS}
    assert len(_files(tmp_path)) <= 2
    tiers.close()


def test_disk_tier_start_removes_files_of_an_earlier_process(tmp_path: Path) -> None:
    (tmp_path / f"{1:016x}{SUFFIX}").write_bytes(b"old")
    (tmp_path / f".{2:016x}{SUFFIX}.tmp").write_bytes(b"torn")
    (tmp_path / "unrelated.txt").write_text("kept")
    tiers = _tiers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated.txt"]
    tiers.close()


def test_disk_tier_prefetch_from_another_thread(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path)
    for user in "abcdef":
        _step(tiers, user, 8)
    started = []
    thread = threading.Thread(target=lambda: started.append(tiers.prefetch(["a", "b", "zz"])))
    thread.start()
    thread.join()
    assert started == [1]  # a only: b is on the host, zz nowhere
    disk = tiers.disk
    assert disk is not None
    read = disk._entries["a"].read
    assert read is not None
    for future in [read.header, *read.chunks]:
        future.result()  # the step comes after the read finished
    assert tiers.settle(["a"]) == {"a": DISK}
    stats = disk.stats()
    assert stats.prefetches == 1 and stats.waited_reads == 0
    tiers.close()


def test_disk_tier_misuse(tmp_path: Path) -> None:
    cache = KVCache(CFG, num_blocks=6, device="cpu")
    with pytest.raises(ConfigError, match="holds no user"):
        DiskTier(cache, tmp_path, 100, "v", max_blocks=4)
    with pytest.raises(ConfigError, match="needs a host tier"):
        disk = DiskTier(cache, tmp_path, 10**6, "v", max_blocks=4)
        KVTiers(cache, None, 16, disk=disk)
    disk.close()


@pytest.mark.gpu
def test_disk_tier_round_trip_on_the_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _round_trip_through_the_tiers(tmp_path, "cuda")


def test_disk_tier_round_trip_stepping_users_back_in_lru_order(tmp_path: Path) -> None:
    _round_trip_through_the_tiers(tmp_path, "cpu")


def _round_trip_through_the_tiers(tmp_path: Path, device: str) -> None:
    tiers = _tiers(tmp_path, device=device)
    saved = {}
    for user in "abcdef":
        _step(tiers, user, 8)
        saved[user] = [t.cpu() for t in tiers.cache.read(user)]
    assert tiers.disk is not None and tiers.disk.cache.device.type == device
    assert tiers.prefetch(["a"]) == 1
    for user in ("a", "b", "c"):
        # a comes from disk; its onload sends the GPU's LRU (d) to the host, whose LRU (b)
        # goes to disk, and so on: each of a, b, c is read back from disk in its turn
        assert _step(tiers, user, 0).outcomes == {user: DISK}
        for got, want in zip(tiers.cache.read(user), saved[user], strict=True):
            assert torch.equal(got.cpu(), want)
    assert tiers.stats().disk_hits == 3
    tiers.close()
