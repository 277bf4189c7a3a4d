import pytest
import torch

from streamrec.cache.block_pool import NoRoom
from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_tiers import Admission, CacheOutcome, KVTiers
from streamrec.errors import CacheError

CFG = KVCacheConfig(num_layers=1, num_heads=1, head_dim=2, block_size=4, dtype=torch.float32)
GPU, HOST, MISS = CacheOutcome.GPU_HIT, CacheOutcome.HOST_HIT, CacheOutcome.MISS


def _tiers(host_blocks: int | None = 8) -> KVTiers:
    cache = KVCache(CFG, num_blocks=6, device="cpu")
    host = None if host_blocks is None else HostTier(cache, host_blocks)
    return KVTiers(cache, host, max_seq_len=12)


def _step(tiers: KVTiers, user: str, n: int) -> Admission:
    admission = tiers.ensure_room({user: n})
    assert isinstance(admission, Admission), admission
    slots = tiers.append(user, n)
    k = torch.full((1, n, 1, 2), float(len(user) * 100 + tiers.cache.pool.length(user)))
    tiers.cache.write(slots, k, -k, torch.arange(n))
    tiers.unpin([user])
    return admission


def test_engine_steps_spill_to_host_and_come_back() -> None:
    tiers = _tiers()
    for user in ("a", "b", "c"):
        assert _step(tiers, user, 8).outcomes == {user: MISS}
    assert tiers.resolve(["a", "b", "z"]) == {"a": GPU, "b": GPU, "z": MISS}
    saved_a = tiers.cache.read("a")
    admission = _step(tiers, "d", 4)
    assert (admission.outcomes, admission.evicted, admission.dropped) == ({"d": MISS}, ["a"], [])
    assert tiers.resolve(["a"]) == {"a": HOST}
    # a comes back: 2 blocks to onload + 1 for growth; 1 is free, so b (LRU) spills.
    back = tiers.ensure_room({"a": 1})
    assert isinstance(back, Admission)
    assert (back.outcomes, back.evicted) == ({"a": HOST}, ["b"])
    for got, want in zip(tiers.cache.read("a"), saved_a):
        assert torch.equal(got, want)
    tiers.append("a", 1)
    tiers.unpin(["a"])
    stats = tiers.stats()
    assert (stats.gpu_hits, stats.host_hits, stats.misses) == (0, 1, 4)
    assert stats.host is not None and stats.host.users == 1
    assert stats.pool.pinned_users == 0


def test_sliding_window_applies_before_room_is_counted() -> None:
    tiers = _tiers()
    _step(tiers, "u", 10)
    admission = _step(tiers, "u", 4)  # 14 > 12: the oldest block goes first
    assert admission.trimmed_tokens == 4 and admission.outcomes == {"u": GPU}
    assert tiers.cache.pool.length("u") == 10
    with pytest.raises(CacheError, match="13 new tokens"):
        tiers.ensure_room({"u": 13})
    with pytest.raises(CacheError, match="-1 for user 'v'"):
        tiers.ensure_room({"u": 1, "v": -1})
    assert tiers.stats().pool.pinned_users == 0  # misuse pins nobody


def test_no_room_unpins_the_batch_and_evicts_nobody() -> None:
    tiers = _tiers()
    _step(tiers, "a", 8)
    _step(tiers, "b", 8)
    result = tiers.ensure_room({"c": 12, "d": 12, "e": 1})  # 7 blocks > 4 evictable + 2 free
    assert result == NoRoom(needed=7, free=2)
    stats = tiers.stats()
    assert stats.pool.pinned_users == 0 and stats.pool.evictions == 0 and stats.no_room == 1
    assert tiers.resolve(["a", "b"]) == {"a": GPU, "b": GPU}
    # The LRU user a is in the batch, hence pinned: b is evicted instead.
    result = tiers.ensure_room({"a": 0, "c": 12, "d": 4})
    assert isinstance(result, Admission) and result.evicted == ["b"]
    assert tiers.stats().pool.pinned_users == 3


def test_without_host_tier_evicted_users_are_dropped() -> None:
    tiers = _tiers(host_blocks=None)
    _step(tiers, "a", 12)
    _step(tiers, "b", 12)
    admission = _step(tiers, "c", 12)
    assert admission.dropped == ["a"] and admission.evicted == ["a"]
    assert tiers.resolve(["a"]) == {"a": MISS}
    tiers.drop(["b", "c"])
    assert tiers.resolve(["b", "c"]) == {"b": MISS, "c": MISS}
    with pytest.raises(CacheError, match="ensure_room"):
        tiers.append("b", 100)


def _churn(device: str) -> None:
    """Random steps over more users than the GPU holds: every cached byte must survive."""
    cfg = KVCacheConfig(num_layers=2, num_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)
    cache = KVCache(cfg, num_blocks=24, device=device)
    tiers = KVTiers(cache, HostTier(cache, num_blocks=40), max_seq_len=16)
    gen = torch.Generator().manual_seed(11)
    shadow: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # user -> (k, ts) on the CPU
    for step in range(120):
        batch = {f"u{int(i)}": int(n) for i, n in torch.randint(0, 16, (3, 2), generator=gen)}
        batch = {u: max(1, n % 6) for u, n in batch.items()}
        admission = tiers.ensure_room(batch)
        assert isinstance(admission, Admission), (step, admission)
        for user in admission.dropped:
            shadow.pop(user, None)
        for user, n in batch.items():
            if admission.outcomes[user] is MISS:
                shadow.pop(user, None)
            else:  # what is left after the window must be the newest tokens
                k, _, ts = cache.read(user)
                want_k, want_ts = shadow[user]
                assert torch.equal(k.cpu(), want_k[:, want_k.shape[1] - k.shape[1] :])
                assert torch.equal(ts.cpu(), want_ts[want_ts.shape[0] - ts.shape[0] :])
            new_k = torch.randn(2, n, 2, 8, generator=gen).to(torch.bfloat16)
            new_ts = torch.randint(0, 2**40, (n,), generator=gen)
            cache.write(tiers.append(user, n), new_k, -new_k, new_ts)
            k_all, _, ts_all = cache.read(user)
            shadow[user] = (k_all.cpu(), ts_all.cpu())
        tiers.unpin(batch)
    stats = tiers.stats()
    assert stats.host is not None and stats.host.offloads > 10 and stats.host.onloads > 10


def test_churn_keeps_every_byte_on_cpu() -> None:
    _churn("cpu")


@pytest.mark.gpu
def test_churn_keeps_every_byte_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _churn("cuda")
