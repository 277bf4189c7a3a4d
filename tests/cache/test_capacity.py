import pytest
import torch

from streamrec.cache.capacity import capacity_report, catalog_plan
from streamrec.cache.kv_cache import KVCacheConfig
from streamrec.errors import ConfigError

GIB = 2**30


def test_reference_config_rows() -> None:
    kv = KVCacheConfig(num_layers=8, num_heads=4, head_dim=128, block_size=16)
    rows = {r.tier: r for r in capacity_report(kv, 1000, 100 * GIB, 64 * GIB)}
    # 1000 tokens -> 63 blocks of 16 tokens; a block holds 16 * (8*2*4*128*2 + 8) bytes.
    assert rows["gpu_kv"].bytes_per_user == 63 * 16 * 16392
    assert rows["gpu_kv"].users == (100 * GIB // (16 * 16392)) // 63
    assert rows["host_kv"].users == (64 * GIB // (16 * 16392)) // 63
    assert rows["history_store"].bytes_per_user == 1000 * 24 + 256
    assert rows["history_store"].users is None
    assert rows["disk_kv"].bytes_per_user == 4096 + 63 * 16 * 16392


def test_disk_tier_capacity_row() -> None:
    kv = KVCacheConfig(num_layers=8, num_heads=4, head_dim=128, block_size=16)
    rows = {r.tier: r for r in capacity_report(kv, 2048, GIB, disk_budget_bytes=2000 * GIB)}
    # 2,048 tokens: 128 blocks, 32 MiB of K/V + timestamps and a 4 KiB header per file.
    assert rows["disk_kv"].bytes_per_user == 4096 + 128 * 16 * 16392
    assert rows["disk_kv"].users == 2000 * GIB // (4096 + 128 * 16 * 16392)


def test_embedding_cache_catalog_plan() -> None:
    fits = catalog_plan(1_000_000, 512, 2, 4 * GIB)
    assert fits.fits and fits.cache_slots == fits.retrievable == 1_000_000
    big = catalog_plan(20_000_000, 512, 2, 4 * GIB)  # 20 GB of rows, 4 GiB budget
    assert not big.fits and big.table_bytes == 20_000_000 * 1024
    assert big.cache_slots == 2 * GIB // 1024 and big.retrievable == 2 * GIB // 1032
    with pytest.raises(ConfigError, match="slot_share=1"):
        catalog_plan(10, 8, 2, 100, slot_share=1)


def test_an_fp8_pool_holds_twice_the_users() -> None:
    """Issue 18's capacity target (>= 1.9x users at the same history length)."""
    for history in (1000, 2048, 4096):
        users = {}
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            kv = KVCacheConfig(num_layers=8, num_heads=4, head_dim=128, block_size=16, dtype=dtype)
            users[dtype] = capacity_report(kv, history, 100 * GIB, 64 * GIB)[0].users
        ratio = users[torch.float8_e4m3fn] / users[torch.bfloat16]
        assert 1.99 < ratio <= 2.0, (history, users)


def test_partial_blocks_and_bad_input() -> None:
    kv = KVCacheConfig(num_layers=1, num_heads=1, head_dim=2, block_size=4, dtype=torch.float32)
    (gpu, host, disk, store) = capacity_report(kv, 5, 10 * kv.bytes_per_block, None, 1000)
    assert (gpu.users, host.users, store.users) == (5, None, 1000 // (5 * 24 + 256))
    assert disk.users is None and disk.bytes_per_user == 4096 + 2 * kv.bytes_per_block
    with pytest.raises(ConfigError, match="history_len=0"):
        capacity_report(kv, 0, 100)
