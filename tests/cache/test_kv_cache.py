import numpy as np
import pytest
import torch

from streamrec.cache.block_pool import NoRoom
from streamrec.cache.kv_cache import KVCache, KVCacheConfig, free_memory_bytes, to_host
from streamrec.errors import CacheError, ConfigError

CFG = KVCacheConfig(num_layers=2, num_heads=2, head_dim=4, block_size=4, dtype=torch.float32)


def _tokens(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = torch.randn(CFG.num_layers, n, CFG.num_heads, CFG.head_dim, generator=gen)
    v = torch.randn(CFG.num_layers, n, CFG.num_heads, CFG.head_dim, generator=gen)
    return k, v, torch.randint(0, 10**12, (n,), generator=gen)


def test_writes_through_block_tables_equal_a_dense_reference() -> None:
    cache = KVCache(CFG, num_blocks=16, device="cpu")
    gen = torch.Generator().manual_seed(0)
    dense: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    # Interleaved appends so tables are not contiguous runs.
    for user, n in [("a", 3), ("b", 6), ("a", 5), ("c", 1), ("b", 2), ("a", 4), ("c", 7)]:
        slots = cache.pool.append(user, n)
        assert not isinstance(slots, NoRoom)
        k, v, ts = _tokens(gen, n)
        cache.write(slots, k, v, ts)
        dense.setdefault(user, []).append((k, v, ts))

    users = ["a", "b", "c"]
    tables, lens = cache.batch_tables(users)
    assert tables.dtype == torch.int32 and lens.dtype == torch.int64
    assert lens.tolist() == [12, 8, 8]
    assert tables.shape == (3, 3)
    assert tables[1, 2].item() == 0 and tables[2, 2].item() == 0  # padding
    for row, user in enumerate(users):
        ref_k = torch.cat([t[0] for t in dense[user]], dim=1)  # [Lyr, L, H, d]
        ref_v = torch.cat([t[1] for t in dense[user]], dim=1)
        ref_ts = torch.cat([t[2] for t in dense[user]])
        k, v, ts = cache.read(user)
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v) and torch.equal(ts, ref_ts)
        # The model's read path: position p lives at block_tables[b, p // BS], p % BS.
        pos = torch.arange(int(lens[row]))
        blocks = tables[row].long()[pos // CFG.block_size]
        paged_k = cache.kv[:, 0, blocks, pos % CFG.block_size]  # [Lyr, L, H, d]
        assert torch.equal(paged_k, ref_k)
        assert torch.equal(cache.ts[blocks, pos % CFG.block_size], ref_ts)


def test_an_fp8_pool_stores_the_models_codes_and_refuses_other_dtypes() -> None:
    fp8 = KVCacheConfig(2, 2, 4, 4, torch.float8_e4m3fn)
    assert fp8.bytes_per_token == 2 * 2 * 2 * 4 * 1 + 8
    cache = KVCache(fp8, num_blocks=8, device="cpu")
    gen = torch.Generator().manual_seed(1)
    scale = torch.tensor([[[0.25, 0.5], [1.0, 2.0]], [[0.125, 1.0], [4.0, 0.5]]])  # [Lyr,2,H]
    values: list[torch.Tensor] = []
    for n in (3, 6):  # a block filled over two appends
        slots = cache.pool.append("a", n)
        assert not isinstance(slots, NoRoom)
        k, v, ts = _tokens(gen, n)
        kq = (k / scale[:, 0, None, :, None]).to(torch.float8_e4m3fn)
        vq = (v / scale[:, 1, None, :, None]).to(torch.float8_e4m3fn)
        cache.write(slots, kq, vq, ts)
        values.append(kq.float() * scale[:, 0, None, :, None])
        with pytest.raises(CacheError, match="float8_e4m3fn pool"):
            cache.write(slots, k, v, ts)  # unquantized values: the cache cannot scale them
    codes, _, _ = cache.read("a")
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (2, 9, 2, 4)
    k_val, _, _ = cache.read("a", scale)
    assert k_val.dtype == torch.float32
    assert torch.equal(k_val, torch.cat(values, dim=1))
    plain = KVCache(CFG, num_blocks=4, device="cpu")
    slots = plain.pool.append("a", 2)
    assert not isinstance(slots, NoRoom)
    k, v, ts = _tokens(gen, 2)
    with pytest.raises(CacheError, match="float32 pool"):
        plain.write(slots, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), ts)


def test_batch_tables_of_empty_users_have_one_column() -> None:
    cache = KVCache(CFG, num_blocks=2, device="cpu")
    cache.pool.append("u", 0)
    tables, lens = cache.batch_tables(["u"])
    assert tables.tolist() == [[0]] and lens.tolist() == [0]
    with pytest.raises(CacheError, match="'nobody'"):
        cache.batch_tables(["nobody"])


def test_write_rejects_mismatched_shapes() -> None:
    cache = KVCache(CFG, num_blocks=2, device="cpu")
    slots = cache.pool.append("u", 2)
    assert not isinstance(slots, NoRoom)
    k, v, ts = _tokens(torch.Generator().manual_seed(1), 3)
    with pytest.raises(CacheError, match=r"\(2, 3, 2, 4\)"):
        cache.write(slots, k, v, ts)


def test_sizing_from_a_budget() -> None:
    # 2 layers * 2 (k, v) * 2 heads * 4 dims * 4 bytes + 8 bytes of timestamp
    assert CFG.bytes_per_token == 136
    assert CFG.bytes_per_block == 544
    cache = KVCache.from_budget(CFG, "cpu", budget_bytes=544 * 10 + 543)
    assert cache.num_blocks == 10
    assert cache.nbytes == 10 * 544
    assert tuple(cache.kv.shape) == (2, 2, 10, 4, 2, 4)
    fraction = 544 * 4.5 / free_memory_bytes(torch.device("cpu"))
    tiny = KVCache.from_budget(CFG, "cpu", free_fraction=fraction)
    assert 3 <= tiny.num_blocks <= 6  # free RAM moves a little between the two reads
    with pytest.raises(ConfigError, match="exactly one"):
        KVCache.from_budget(CFG, "cpu")
    with pytest.raises(ConfigError, match="holds no block"):
        CFG.num_blocks_for(100)
    with pytest.raises(ConfigError, match="heads=0"):
        KVCacheConfig(num_layers=1, num_heads=0, head_dim=4)


def test_bf16_reference_geometry() -> None:
    cfg = KVCacheConfig(num_layers=8, num_heads=4, head_dim=128, block_size=16)
    assert cfg.bytes_per_token == 8 * 2 * 4 * 128 * 2 + 8
    assert np.isclose(cfg.bytes_per_block / 2**10, 256.125)


def test_to_host_gives_the_values_of_every_tensor_in_order() -> None:
    items = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    scores = torch.linspace(0, 1, 6).reshape(2, 3).t()  # not contiguous
    got = to_host(items, scores)
    assert [type(a) for a in got] == [np.ndarray, np.ndarray]
    np.testing.assert_array_equal(got[0], items.numpy())
    np.testing.assert_array_equal(got[1], scores.numpy())
    assert to_host() == []


@pytest.mark.gpu
def test_to_host_waits_for_the_kernels_behind_the_copies() -> None:
    """The copies queue behind the stream's work and one event waits for all: the values
    are the finished kernels', in their dtypes and shapes, from non-contiguous views too."""
    device = torch.device("cuda")
    a = torch.randn(2048, 2048, device=device)
    b = a @ a  # [2048, 2048] still running when the copies queue
    top, idx = torch.topk(b, 5, dim=1)  # [2048, 5] each
    got = to_host(idx, top.t(), b[:3, :7].half())
    np.testing.assert_array_equal(got[0], idx.cpu().numpy())
    np.testing.assert_array_equal(got[1], top.t().cpu().numpy())
    assert got[1].shape == (5, 2048)
    np.testing.assert_array_equal(got[2], b[:3, :7].half().cpu().numpy())
