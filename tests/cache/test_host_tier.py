import pytest
import torch

from streamrec.cache.block_pool import NoRoom
from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.errors import CacheError, ConfigError


def _filled_cache(device: str, dtype: torch.dtype, users: dict[str, int]) -> KVCache:
    cfg = KVCacheConfig(num_layers=2, num_heads=2, head_dim=8, block_size=4, dtype=dtype)
    cache = KVCache(cfg, num_blocks=12, device=device)
    gen = torch.Generator(device=device).manual_seed(7)
    for user, n in users.items():
        slots = cache.pool.append(user, n)
        assert not isinstance(slots, NoRoom)
        shape = (cfg.num_layers, n, cfg.num_heads, cfg.head_dim)
        k = torch.randn(shape, generator=gen, device=device).to(dtype)
        v = torch.randn(shape, generator=gen, device=device).to(dtype)
        ts = torch.randint(0, 2**62, (n,), generator=gen, device=device)
        cache.write(slots, k, v, ts)
    return cache


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _round_trip(device: str, dtype: torch.dtype) -> HostTier:
    cache = _filled_cache(device, dtype, {"a": 9, "b": 5})
    host = HostTier(cache, num_blocks=8)
    before = [_as_bytes(t) for t in cache.read("a")]
    assert host.offload("a", cache.pool.block_table("a"), cache.pool.length("a")) == []
    cache.pool.free("a")
    # Reuse a's GPU blocks with other data before the onload.
    intruder = cache.pool.append("c", 12)
    assert not isinstance(intruder, NoRoom)
    cache.kv.fill_(3.0)
    cache.ts.fill_(-1)
    blocks = cache.pool.restore("a", host.length("a"))
    assert not isinstance(blocks, NoRoom)
    assert host.onload("a", blocks) == 9
    assert [_as_bytes(t) for t in cache.read("a")] == before
    assert "a" not in host
    return host


def test_offload_then_onload_returns_identical_bytes_on_cpu() -> None:
    host = _round_trip("cpu", torch.bfloat16)
    assert not host.pinned
    stats = host.stats()
    assert (stats.offloads, stats.onloads, stats.users, stats.blocks_used) == (1, 1, 0, 0)
    assert stats.bytes_offloaded == stats.bytes_onloaded == 3 * host.cache.config.bytes_per_block


def test_an_fp8_pool_round_trips_its_codes_at_half_the_bytes() -> None:
    host = _round_trip("cpu", torch.float8_e4m3fn)
    assert host.kv.dtype == torch.float8_e4m3fn
    bf16 = KVCacheConfig(num_layers=2, num_heads=2, head_dim=8, block_size=4)
    fp8 = host.cache.config
    assert host.stats().bytes_offloaded == 3 * fp8.bytes_per_block
    # K/V bytes halve; the int64 timestamps stay
    assert fp8.bytes_per_block == (bf16.bytes_per_block - 4 * 8) // 2 + 4 * 8


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_offload_then_onload_returns_identical_bytes_on_cuda(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    host = _round_trip("cuda", dtype)
    assert host.pinned
    torch.cuda.synchronize()


def test_full_host_tier_drops_its_lru_user_entirely() -> None:
    cache = _filled_cache("cpu", torch.float32, {"x": 8, "y": 5, "z": 4, "big": 20})
    host = HostTier(cache, num_blocks=4)
    pool = cache.pool
    assert host.offload("x", pool.block_table("x"), 8) == []
    assert host.offload("z", pool.block_table("z"), 4) == []
    assert host.lru_order() == ["x", "z"]
    # y needs 2 blocks, 1 is free: x (LRU) goes, z stays.
    assert host.offload("y", pool.block_table("y"), 5) == ["x"]
    assert host.lru_order() == ["z", "y"]
    # A user larger than the whole tier is itself dropped; nothing else is.
    assert host.offload("big", pool.block_table("big"), 20) == ["big"]
    # Users about to be onloaded are kept even when they are the LRU ones.
    assert host.offload("x", pool.block_table("x"), 8, keep={"z", "y"}) == ["x"]
    assert host.lru_order() == ["z", "y"]
    assert host.stats().drops == 3


def test_host_window_and_misuse() -> None:
    cache = _filled_cache("cpu", torch.float32, {"u": 10})
    host = HostTier(cache, num_blocks=4)
    host.offload("u", cache.pool.block_table("u"), 10)
    assert host.drop_oldest_blocks("u", 1) == 4
    assert (host.length("u"), host.user_blocks("u")) == (6, 2)
    with pytest.raises(CacheError, match="needs 2 GPU blocks"):
        host.onload("u", [0])
    with pytest.raises(CacheError, match="'ghost'"):
        host.length("ghost")
    with pytest.raises(ConfigError, match="holds no block"):
        HostTier.from_budget(cache, 10)
    host.drop("u")
    assert host.stats().blocks_used == 0
