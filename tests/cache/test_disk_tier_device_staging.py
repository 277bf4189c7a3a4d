"""Device staging of disk reads (CUDA): chunks copied to a GPU slot as they land, the step
only scatters device -> device. CPU tests: no staging there, the pinned path unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrec.cache.disk_tier import DiskTier, file_bytes
from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_file import CHUNK_BYTES, HEADER_BYTES
from streamrec.cache.kv_tiers import Admission, CacheOutcome, KVTiers
from streamrec.errors import ConfigError
from streamrec.worker.config import CacheConfig

DISK, MISS = CacheOutcome.DISK_HIT, CacheOutcome.MISS
BS = 16
MAX_SEQ = 2048  # 128 blocks
MAX_BLOCKS = MAX_SEQ // BS


def _geometry(dtype: torch.dtype = torch.bfloat16, head_dim: int = 64) -> KVCacheConfig:
    # bf16, head_dim 64: 8,200 bytes a token, so a user of 1,500+ tokens spans 3 chunks
    return KVCacheConfig(num_layers=4, num_heads=8, head_dim=head_dim, block_size=BS, dtype=dtype)


def _tiers(
    directory: Path,
    device: str,
    *,
    device_slots: int,
    staging_users: int = 4,
    geometry: KVCacheConfig | None = None,
) -> KVTiers:
    geo = geometry or _geometry()
    cache = KVCache(geo, num_blocks=4 * MAX_BLOCKS, device=device)  # 4 users at most
    host = HostTier(cache, 2 * MAX_BLOCKS)
    disk = DiskTier(
        cache, directory, 40 * file_bytes(cache, MAX_BLOCKS), "v1", max_blocks=MAX_BLOCKS,
        staging_users=staging_users, device_slots=device_slots,
    )  # fmt: skip
    return KVTiers(cache, host, max_seq_len=MAX_SEQ, disk=disk)


def _step(tiers: KVTiers, user: str, n: int, seed: int) -> Admission:
    """Settle, admit, and write ``n`` random tokens (none: nothing queued on the GPU)."""
    tiers.settle([user])
    admission = tiers.ensure_room({user: n})
    assert isinstance(admission, Admission), admission
    if n:
        cache, cfg = tiers.cache, tiers.cache.config
        start = cache.pool.length(user) if user in cache.pool else 0
        slots = tiers.append(user, n)
        gen = torch.Generator(device=cache.device).manual_seed(seed)
        shape = (cfg.num_layers, n, cfg.num_heads, cfg.head_dim)
        k, v = (torch.randn(shape, generator=gen, device=cache.device).to(cfg.dtype) for _ in "kv")
        ts = torch.arange(start, start + n, device=cache.device) + 10**12 + seed
        cache.write(slots, k, v, ts)
    tiers.unpin([user])
    return admission


def _bytes(tiers: KVTiers, user: str) -> list[torch.Tensor]:
    return [t.contiguous().view(torch.uint8).cpu() for t in tiers.cache.read(user)]


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _fill(tiers: KVTiers, n_users: int) -> dict[str, list[torch.Tensor]]:
    saved = {}
    for i in range(n_users):
        user = f"u{i:02d}"
        _step(tiers, user, 1500 + 37 * i, seed=i)  # 94..118 blocks, the last one partial
        saved[user] = _bytes(tiers, user)
    return saved


def _on_disk(tiers: KVTiers, users: list[str]) -> list[str]:
    return [u for u in users if tiers.resolve([u])[u] is DISK]


def _wait_read(tiers: KVTiers, user: str) -> None:
    """Block until the prefetched read of ``user`` is done (its copies are queued)."""
    assert tiers.disk is not None
    read = tiers.disk._entries[user].read
    assert read is not None
    for future in [read.header, *read.chunks]:
        future.result()


def _to_disk(tiers: KVTiers, user: str) -> None:
    """GPU -> host -> disk, leaving the GPU pool and the host tier without the user."""
    pool, host, disk = tiers.cache.pool, tiers.host, tiers.disk
    assert host is not None and disk is not None
    assert host.offload(user, pool.block_table(user), pool.length(user)) == []
    pool.free(user)
    host.synchronize()
    assert disk.store(user, host.snapshot(user))
    host.evict(user)


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


# ------------------------------------------------------------------ CPU


def test_disk_tier_has_no_device_slots_on_the_cpu(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path, "cpu", device_slots=4, geometry=_geometry(torch.float32, 4))
    saved = _fill(tiers, 8)
    users = _on_disk(tiers, list(saved))
    assert users and tiers.prefetch(users) == min(4, len(users))
    for user in users:
        assert _step(tiers, user, 0, seed=0).outcomes == {user: DISK}
        assert _same(_bytes(tiers, user), saved[user])
    stats = tiers.stats().disk
    assert stats is not None and stats.loads == len(users)
    assert (stats.device_slots, stats.device_staging_bytes) == (0, 0)
    assert (stats.device_staged_loads, stats.device_staging_full) == (0, 0)
    tiers.close()


def test_disk_tier_device_slots_are_validated(tmp_path: Path) -> None:
    cache = KVCache(_geometry(torch.float32, 4), num_blocks=8, device="cpu")
    with pytest.raises(ConfigError, match="device_slots >= 0"):
        DiskTier(cache, tmp_path, 10**8, "v", max_blocks=4, device_slots=-1)
    with pytest.raises(ConfigError, match="disk_tier_device_slots = -1: must be >= 0"):
        CacheConfig(disk_tier_device_slots=-1)
    assert CacheConfig().disk_tier_device_slots == 4


# ------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "head_dim"),
    [(torch.bfloat16, 64), (torch.float8_e4m3fn, 64), (torch.bfloat16, 6)],  # 6: not in words
)
def test_disk_tier_device_staged_round_trip_is_bitwise(
    tmp_path: Path, dtype: torch.dtype, head_dim: int
) -> None:
    """Many users through GPU -> host -> disk -> GPU, each read device-staged, twice over
    (slots reused), one of them trimmed by the window on the way back."""
    _cuda()
    tiers = _tiers(tmp_path, "cuda", device_slots=2, geometry=_geometry(dtype, head_dim))
    saved = _fill(tiers, 12)
    disk = tiers.disk
    assert disk is not None and disk.stats().device_slots == 2
    staged = 0
    for order in (list(saved), list(reversed(saved))):
        for user in order:
            if tiers.prefetch([user]):  # only on disk: the read takes a device slot
                read = disk._entries[user].read
                assert read is not None and read.device is not None
                staged += 1
            _step(tiers, user, 0, seed=0)
            assert _same(_bytes(tiers, user), saved[user]), user
    stats = tiers.stats()
    assert stats.disk is not None and stats.disk_hits == stats.disk.loads == staged
    assert staged >= 6 and stats.disk.device_staged_loads == staged
    assert stats.disk.device_staging_full == 0 and stats.disk.verify_failures == 0
    assert stats.disk.device_staging_bytes == 2 * disk.cache.config.bytes_per_block * MAX_BLOCKS
    # The sliding window on a device-staged onload: the oldest blocks are skipped.
    user = _on_disk(tiers, list(saved))[0]
    length = len(saved[user][2]) // 8  # ts bytes
    assert tiers.prefetch([user]) == 1
    admission = _step(tiers, user, MAX_SEQ - length + 2 * BS, seed=99)
    assert admission.outcomes == {user: DISK} and admission.trimmed_tokens == 2 * BS
    k, v, ts = _bytes(tiers, user)  # k/v [Lyr, L, H, d bytes], ts [L * 8]
    kept = length - 2 * BS
    assert torch.equal(k[:, :kept], saved[user][0][:, 2 * BS :])
    assert torch.equal(v[:, :kept], saved[user][1][:, 2 * BS :])
    assert torch.equal(ts[: kept * 8], saved[user][2][2 * BS * 8 :])
    assert tiers.stats().disk.device_staged_loads == staged + 1  # type: ignore[union-attr]
    tiers.close()


@pytest.mark.gpu
def test_disk_tier_more_reads_in_flight_than_device_slots(tmp_path: Path) -> None:
    """Reads past the free device slots fall back to the pinned-slot onload; the slots
    are reused by the next reads."""
    _cuda()
    tiers = _tiers(tmp_path, "cuda", device_slots=2, staging_users=4)
    saved = _fill(tiers, 12)
    disk = tiers.disk
    assert disk is not None
    first = _on_disk(tiers, list(saved))[:4]
    assert len(first) == 4 and tiers.prefetch(first) == 4
    reads = [disk._entries[u].read for u in first]
    assert [r is not None and r.device is not None for r in reads] == [True, True, False, False]
    for user in first:
        assert _step(tiers, user, 0, seed=0).outcomes == {user: DISK}
        assert _same(_bytes(tiers, user), saved[user]), user
    stats = disk.stats()
    assert (stats.loads, stats.device_staged_loads, stats.device_staging_full) == (4, 2, 2)
    second = _on_disk(tiers, list(saved))[:2]
    assert len(second) == 2 and tiers.prefetch(second) == 2  # both slots free again
    for user in second:
        assert _step(tiers, user, 0, seed=0).outcomes == {user: DISK}
        assert _same(_bytes(tiers, user), saved[user]), user
    stats = disk.stats()
    assert (stats.loads, stats.device_staged_loads, stats.device_staging_full) == (6, 4, 2)
    for user in saved:  # everyone else is intact too, wherever it comes back from
        _step(tiers, user, 0, seed=0)
        assert _same(_bytes(tiers, user), saved[user]), user
    tiers.close()


@pytest.mark.gpu
def test_disk_tier_torn_file_with_a_device_slot_is_a_miss(tmp_path: Path) -> None:
    """A flipped byte in the middle chunk: its neighbours reach the device slot, the read
    fails its check, nothing reaches the pool, and the slot serves the next read."""
    _cuda()
    tiers = _tiers(tmp_path, "cuda", device_slots=1)
    saved = _fill(tiers, 12)
    disk, cache = tiers.disk, tiers.cache
    assert disk is not None
    torn, good = _on_disk(tiers, list(saved))[:2]
    entry = disk._entries[torn]
    assert entry.nbytes > HEADER_BYTES + 2 * CHUNK_BYTES  # three chunks
    with entry.path.open("r+b") as fh:
        fh.seek(HEADER_BYTES + CHUNK_BYTES + 12_345)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x5A]))
    torch.cuda.synchronize()
    pool_before = (cache.kv.view(torch.uint8).clone(), cache.ts.clone())
    assert tiers.prefetch([torn]) == 1
    read = entry.read
    assert read is not None and read.device is not None
    _wait_read(tiers, torn)
    assert tiers.settle([torn]) == {torn: MISS}
    torch.cuda.synchronize()
    assert torch.equal(cache.kv.view(torch.uint8), pool_before[0])
    assert torch.equal(cache.ts, pool_before[1])
    stats = disk.stats()
    assert (stats.verify_failures, stats.loads, stats.device_staged_loads) == (1, 0, 0)
    assert torn not in disk
    assert tiers.prefetch([good]) == 1
    assert disk._entries[good].read.device is read.device  # type: ignore[union-attr]
    assert _step(tiers, good, 0, seed=0).outcomes == {good: DISK}
    assert _same(_bytes(tiers, good), saved[good])
    assert _step(tiers, torn, 1500, seed=7).outcomes == {torn: MISS}  # rebuilt
    assert disk.stats().device_staged_loads == 1
    tiers.close()


@pytest.mark.gpu
def test_disk_tier_device_slot_reused_right_after_a_scatter(tmp_path: Path) -> None:
    """The next read into a device slot is issued at once after an onload whose scatter
    has not run yet (the GPU is asleep before it): its copies must wait for that scatter,
    or the first user's blocks would get the second user's bytes."""
    _cuda()
    tiers = _tiers(tmp_path, "cuda", device_slots=1, staging_users=2)
    saved = _fill(tiers, 2)
    a, b = saved
    for user in (a, b):
        _to_disk(tiers, user)  # the pool then has room: the onload evicts nobody
    disk = tiers.disk
    assert disk is not None
    assert tiers.prefetch([a]) == 1
    _wait_read(tiers, a)
    read_a = disk._entries[a].read
    assert read_a is not None and read_a.device is not None
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time ahead of the scatter
    slept = torch.cuda.Event()
    slept.record()
    assert tiers.settle([a]) == {a: DISK}
    admission = tiers.ensure_room({a: 0})  # queues a's scatter behind the sleep
    assert isinstance(admission, Admission) and admission.outcomes == {a: DISK}
    tiers.unpin([a])
    assert not slept.query(), "the onload waited for the GPU (a synchronous copy?)"
    assert tiers.prefetch([b]) == 1
    read_b = disk._entries[b].read
    assert read_b is not None and read_b.device is read_a.device  # the same device slot
    assert read_b.slot is not read_a.slot  # another pinned slot: no host wait orders it
    _wait_read(tiers, b)  # b's chunks are read and their copies queued
    assert not slept.query(), "the sleep ended before b's copies were queued: no race"
    torch.cuda.synchronize()
    assert _same(_bytes(tiers, a), saved[a])
    assert _step(tiers, b, 0, seed=0).outcomes == {b: DISK}
    assert _same(_bytes(tiers, b), saved[b])
    assert _same(_bytes(tiers, a), saved[a])
    assert disk.stats().device_staged_loads == 2
    tiers.close()
