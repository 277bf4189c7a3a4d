import numpy as np
import pytest

from streamrec.cache.block_pool import BlockPool, NoRoom, window_blocks_to_drop
from streamrec.errors import CacheError


def _slots(result: object) -> list[int]:
    assert isinstance(result, np.ndarray), result
    return result.tolist()


def _scripted_pool() -> BlockPool:
    pool = BlockPool(num_blocks=8, block_size=4)
    assert _slots(pool.append("a", 5)) == [0, 1, 2, 3, 4]
    assert _slots(pool.append("b", 3)) == [8, 9, 10]
    assert _slots(pool.append("a", 4)) == [5, 6, 7, 12]
    assert _slots(pool.append("c", 8)) == list(range(16, 24))
    pool.free("b")  # block 2 goes to the tail, behind 6 and 7
    assert _slots(pool.append("d", 12)) == [24, 25, 26, 27, 28, 29, 30, 31, 8, 9, 10, 11]
    return pool


def test_scripted_sequence_gives_exact_block_ids() -> None:
    pool = _scripted_pool()
    assert pool.block_table("a") == [0, 1, 3]
    assert pool.block_table("c") == [4, 5]
    assert pool.block_table("d") == [6, 7, 2]
    assert [pool.length(u) for u in "acd"] == [9, 8, 12]
    assert pool.lru_order() == ["a", "c", "d"]
    stats = pool.stats()
    assert (stats.blocks_used, stats.blocks_free, stats.users, stats.tokens) == (8, 0, 3, 29)
    assert (stats.allocs, stats.frees) == (9, 1)
    assert stats.occupancy == 1.0


def test_full_pool_returns_no_room_and_changes_nothing() -> None:
    pool = _scripted_pool()
    before = pool.stats()
    result = pool.append("e", 1)
    assert result == NoRoom(needed=1, free=0)
    assert "e" not in pool
    result = pool.append("a", 4)  # a has 9 tokens in 3 blocks: 3 fit, the 4th needs a block
    assert isinstance(result, NoRoom) and result.short == 1
    assert pool.length("a") == 9 and pool.block_table("a") == [0, 1, 3]
    after = pool.stats()
    assert after.no_room == before.no_room + 2
    assert after.blocks_free == 0 and after.tokens == before.tokens
    assert _slots(pool.append("a", 3)) == [13, 14, 15]  # still fits in the last block


def test_eviction_follows_lru_order_and_skips_pinned_users() -> None:
    pool = _scripted_pool()
    pool.touch("a")
    assert pool.lru_order() == ["c", "d", "a"]
    pool.pin(["c"])
    seen: list[tuple[object, list[int], int]] = []
    assert pool.evict(2, on_evict=lambda u, b, n: seen.append((u, b, n))) == ["d"]
    assert seen == [("d", [6, 7, 2], 12)]
    assert pool.num_free == 3
    # Impossible even after evicting every unpinned user: nobody is evicted.
    assert pool.evict(10) == []
    assert pool.lru_order() == ["c", "a"]
    pool.unpin(["c"])
    assert pool.evict(5) == ["c"]
    assert pool.evict(5) == []  # already free enough: nothing to do
    stats = pool.stats()
    assert (stats.evictions, stats.evicted_blocks) == (2, 5)
    # Freed blocks are handed out in the order they were returned.
    assert pool.block_table("a") == [0, 1, 3]
    assert pool.restore("z", 20) == [6, 7, 2, 4, 5]


def test_pins_are_refcounted_and_protect_from_free() -> None:
    pool = BlockPool(4, 2)
    pool.append("u", 2)
    pool.pin(["u", "u"])
    pool.unpin(["u"])
    assert pool.is_pinned("u")
    assert pool.evict(4) == []
    with pytest.raises(CacheError, match="pinned"):
        pool.free("u")
    pool.unpin(["u"])
    assert not pool.is_pinned("u")
    with pytest.raises(CacheError, match="not pinned"):
        pool.unpin(["u"])
    assert pool.evict(4) == ["u"]


def test_sliding_window_drops_whole_oldest_blocks() -> None:
    pool = BlockPool(6, 4)
    pool.append("u", 10)  # blocks 0, 1, 2
    assert pool.trim("u", max_len=12, incoming=2) == 0
    assert pool.trim("u", max_len=12, incoming=3) == 4  # 13 > 12: drop one whole block
    assert pool.block_table("u") == [1, 2] and pool.length("u") == 6
    # Positions are re-based: the next token is position 6 -> block 2, offset 2.
    assert _slots(pool.append("u", 3)) == [10, 11, 12]
    assert pool.block_table("u") == [1, 2, 3]
    assert pool.stats().trimmed_blocks == 1
    assert pool.drop_oldest_blocks("u", 3) == 9 and pool.length("u") == 0


def test_window_arithmetic() -> None:
    assert window_blocks_to_drop(100, 0, 100, 16) == 0
    assert window_blocks_to_drop(100, 1, 100, 16) == 1
    assert window_blocks_to_drop(100, 17, 100, 16) == 2
    assert window_blocks_to_drop(10, 100, 100, 16) == 1  # capped at the blocks held
    with pytest.raises(CacheError, match="101 new tokens"):
        window_blocks_to_drop(0, 101, 100, 16)


def test_misuse_raises_cache_error() -> None:
    pool = BlockPool(2, 2)
    with pytest.raises(CacheError, match="'ghost'"):
        pool.block_table("ghost")
    with pytest.raises(CacheError, match="-1"):
        pool.append("u", -1)
    with pytest.raises(CacheError, match="num_blocks=0"):
        BlockPool(0, 2)
    assert _slots(pool.append("u", 0)) == []
    assert "u" in pool and pool.block_table("u") == []
    with pytest.raises(CacheError, match="already"):
        pool.restore("u", 1)
