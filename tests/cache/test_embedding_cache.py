import numpy as np
import pytest
import torch

from streamrec.cache.embedding_cache import EmbeddingCache
from streamrec.errors import CacheError, ConfigError


def _table(rows: int = 50, dim: int = 8) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(3))


def test_embedding_cache_lookups_equal_the_table_and_count_copied_rows() -> None:
    table = _table()
    cache = EmbeddingCache(table, "cpu", num_slots=4)
    assert not cache.fully_resident
    items = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(cache.lookup(items), table[items])
    assert torch.equal(cache.lookup(torch.tensor([1])), table[[1]])
    out = cache.lookup(torch.tensor([9, 9, 1]))  # one row copied, one slot evicted
    assert torch.equal(out, table[[9, 9, 1]])
    stats = cache.stats()
    assert (stats.lookups, stats.misses, stats.hits, stats.evictions) == (8, 5, 3, 1)
    assert stats.resident == 4 and stats.occupancy == 1.0
    assert stats.bytes_copied == 5 * 8 * 4 and stats.copies == 2
    assert torch.equal(cache.lookup(torch.tensor([2, 3, 4, 9])), table[[2, 3, 4, 9]])


def test_embedding_cache_second_chance_keeps_rows_used_since_the_last_sweep() -> None:
    cache = EmbeddingCache(_table(), "cpu", num_slots=4, staging_rows=3)
    cache.slots(np.array([1, 2, 3, 4]))  # fills slots 0..3; the hand is back at slot 0
    cache.slots(np.array([5]))  # sweep clears every bit, takes slot 0 (item 1)
    cache.slots(np.array([2]))  # item 2 is referenced again
    cache.slots(np.array([6]))  # hand at slot 1 (item 2, referenced): skipped; 3 goes
    resident = {int(i) for i in cache._item_of}
    assert resident == {2, 4, 5, 6}


def test_embedding_cache_randomised_lookups_always_return_the_right_rows() -> None:
    table = _table(200, 4)
    cache = EmbeddingCache(table, "cpu", budget_bytes=16 * 4 * 4, staging_rows=5)
    assert cache.num_slots == 16
    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        items = torch.randint(0, 200, (12,), generator=gen)
        assert torch.equal(cache.lookup(items), table[items])
    stats = cache.stats()
    assert stats.misses > 0 and stats.evictions > 0 and stats.resident == 16
    slots = cache.slots(np.arange(16))
    assert sorted(slots.tolist()) == list(range(16))  # 16 distinct items fill every slot


def test_embedding_cache_pinned_rows_survive_every_sweep_until_unpinned() -> None:
    table = _table(rows=60)
    cache = EmbeddingCache(table, "cpu", num_slots=12)
    pinned = np.array([3, 7, 11, 20])
    slots = cache.pin(pinned)
    for start in range(30, 60, 6):  # 5 calls of 6 other rows: every unpinned slot reused
        cache.slots(np.arange(start, start + 6))
    assert np.array_equal(cache.slots(pinned), slots)  # still resident, same slots
    assert torch.equal(cache.rows[torch.from_numpy(slots)], table[pinned])
    assert cache.stats().pinned == 4
    with pytest.raises(CacheError, match="cannot pin 9 rows: 8 of the 12"):
        cache.pin(np.arange(40, 49))
    with pytest.raises(CacheError, match="4 of 12 pinned"):
        cache.slots(np.arange(40, 49))  # one call needs more than the 8 unpinned slots
    cache.unpin(pinned[:2])
    cache.slots(np.arange(40, 50))  # 10 rows: the two released slots are taken too
    assert cache.stats().pinned == 2 and cache.stats().evictions > 0
    assert np.array_equal(cache.slots(pinned[2:]), slots[2:])


def test_embedding_cache_is_the_identity_when_the_table_fits() -> None:
    table = _table()
    cache = EmbeddingCache(table, "cpu", budget_bytes=table.nbytes)
    assert cache.fully_resident
    items = np.array([0, 49, 7])
    assert cache.slots(items).tolist() == [0, 49, 7]
    assert torch.equal(cache.rows, table)
    stats = cache.stats()
    assert stats.fully_resident and stats.resident == stats.num_items == 50
    assert stats.evictions == 0 and stats.misses == 0 and stats.hit_rate == 1.0


def test_embedding_cache_misuse() -> None:
    cache = EmbeddingCache(_table(), "cpu", num_slots=2)
    with pytest.raises(CacheError, match="embedding_cache_rows"):
        cache.slots(np.array([1, 2, 3]))
    with pytest.raises(CacheError, match="item index 50"):
        cache.slots(np.array([50]))
    with pytest.raises(ConfigError, match="num_slots=0"):
        EmbeddingCache(_table(), "cpu", num_slots=0)
    with pytest.raises(ConfigError, match="2-D"):
        EmbeddingCache(torch.zeros(3), "cpu")


@pytest.mark.gpu
def test_embedding_cache_cold_rows_reach_the_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    table = _table(1000, 64).to(torch.bfloat16)
    cache = EmbeddingCache(table, "cuda", num_slots=100, staging_rows=16)
    gen = torch.Generator().manual_seed(9)
    for _ in range(50):
        items = torch.randint(0, 1000, (64,), generator=gen)
        assert torch.equal(cache.lookup(items).cpu(), table[items])
    assert cache.stats().copies > 50  # chunked through both staging buffers
