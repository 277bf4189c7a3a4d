import pytest
import torch

from streamrec.cache.embedding_cache import EmbeddingCache
from streamrec.errors import CacheError, ConfigError


def _table(rows: int = 50, dim: int = 8) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(3))


def test_lookups_equal_the_table_and_evict_least_recently_used() -> None:
    table = _table()
    cache = EmbeddingCache(table, "cpu", num_slots=4)
    assert not cache.fully_resident
    items = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(cache.lookup(items), table[items])
    assert torch.equal(cache.lookup(torch.tensor([1])), table[[1]])  # 1 is now the MRU
    out = cache.lookup(torch.tensor([9, 9, 1]))  # one slot needed: LRU item 2 leaves
    assert torch.equal(out, table[[9, 9, 1]])
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.evictions) == (2, 5, 1)
    assert stats.resident == 4 and stats.occupancy == 1.0
    assert stats.bytes_copied == 5 * 8 * 4
    # 2 was evicted and comes back as a miss; 3 and 4 are still resident.
    assert torch.equal(cache.lookup(torch.tensor([2, 3, 4, 9])), table[[2, 3, 4, 9]])
    assert cache.stats().misses == 6


def test_randomised_lookups_always_return_the_right_rows() -> None:
    table = _table(200, 4)
    cache = EmbeddingCache(table, "cpu", budget_bytes=16 * 4 * 4)
    assert cache.num_slots == 16
    gen = torch.Generator().manual_seed(5)
    for _ in range(50):
        items = torch.randint(0, 200, (12,), generator=gen)
        assert torch.equal(cache.lookup(items), table[items])
    stats = cache.stats()
    assert stats.hits + stats.misses > 0 and stats.evictions > 0


def test_full_residency_when_the_table_fits() -> None:
    table = _table()
    cache = EmbeddingCache(table, "cpu", budget_bytes=table.nbytes)
    assert cache.fully_resident
    items = torch.tensor([0, 49, 7])
    assert torch.equal(cache.lookup(items), table[items])
    stats = cache.stats()
    assert stats.fully_resident and stats.resident == stats.num_items == 50
    assert stats.evictions == 0 and stats.misses == 0


def test_misuse() -> None:
    cache = EmbeddingCache(_table(), "cpu", num_slots=2)
    with pytest.raises(CacheError, match="3 distinct items"):
        cache.lookup(torch.tensor([1, 2, 3]))
    with pytest.raises(CacheError, match="item index 50"):
        cache.lookup(torch.tensor([50]))
    with pytest.raises(ConfigError, match="num_slots=0"):
        EmbeddingCache(_table(), "cpu", num_slots=0)
    with pytest.raises(ConfigError, match="2-D"):
        EmbeddingCache(torch.zeros(3), "cpu")


@pytest.mark.gpu
def test_cold_rows_reach_the_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    table = _table(1000, 64)
    cache = EmbeddingCache(table, "cuda", num_slots=100)
    gen = torch.Generator().manual_seed(9)
    for _ in range(20):
        items = torch.randint(0, 1000, (64,), generator=gen)
        assert torch.equal(cache.lookup(items).cpu(), table[items])
