"""The exactness contract under FP8 (issue 18): incremental == full recompute when both
quantize the same way, to the tolerance in docs/contracts.md, on the CPU in fp32.

Both paths see every key and value in its cached (quantized) form, and a token's codes
depend on that token alone, so the two differ only where a float rounding difference of
the order of the fp32 exactness error (~1e-7) moves a value across an e4m3 rounding
boundary: rare codes one step apart.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.errors import ConfigError, ExportError, ModelError
from streamrec.models.aoti_export import ExportConfig, package_key
from streamrec.models.aoti_runtime import open_aoti_model
from streamrec.models.checkpoint import load_checkpoint
from streamrec.models.fp8 import FP8
from streamrec.models.fp8_linear import FP8Linear
from streamrec.models.hstu import HSTU
from streamrec.models.quantization import apply_precision, kv_storage_dtype, model_precision
from streamrec.models.serving_precision import ServingPrecision
from tests.models.aoti_fixtures import CACHE_DIR, FP8_BOTH, FP8_EXPORT, tiny_model_dir
from tests.models.test_hstu import jagged, random_history, random_model, rel_err

PRECISIONS = [
    ServingPrecision(kv_dtype="fp8_e4m3"),
    ServingPrecision(weight_dtype="fp8"),
    ServingPrecision(kv_dtype="fp8_e4m3", weight_dtype="fp8"),
]
# Documented in docs/contracts.md ("FP8 serving"): incremental vs recompute, fp32 model.
EMB_TOL = 1e-4
CODE_MISMATCH_TOL = 1e-3  # share of cached codes one e4m3 step apart


def quantized_model(seed: int, precision: ServingPrecision) -> HSTU:
    return apply_precision(random_model(seed), precision)


def new_cache(model: HSTU, block_size: int, num_blocks: int, users: int) -> KVCache:
    """An empty pool in the model's KV dtype with users 0 .. users-1 registered."""
    cfg = model.config
    dtype = kv_storage_dtype(model_precision(model), torch.float32)
    geometry = KVCacheConfig(cfg.num_layers, cfg.num_heads, cfg.head_dim, block_size, dtype)
    cache = KVCache(geometry, num_blocks, "cpu")
    for user in range(users):
        cache.pool.append(user, 0)
    return cache


def append(cache: KVCache, lens: list[int], k: torch.Tensor, v: torch.Tensor, ts) -> None:
    slots = [np.asarray(cache.pool.append(u, n), dtype=np.int64) for u, n in enumerate(lens)]
    cache.write(np.concatenate(slots), k, v, ts)


def cached_kv(cache: KVCache, model: HSTU, users: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = None if model.kv_quant is None else model.kv_quant.scale
    parts = [cache.read(u, scale)[:2] for u in range(users)]
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


def code_mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.view(torch.uint8) != b.view(torch.uint8)).double().mean())


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("seed", range(4))
@torch.no_grad()
def test_extend_equals_prefill(seed: int, precision: ServingPrecision) -> None:
    model = quantized_model(seed, precision)
    cfg = model.config
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    block_size = rng.choice([1, 3, 4, 8])
    users = rng.randint(2, 5)
    full = [rng.randint(1, cfg.max_seq_len) for _ in range(users)]
    full[0] = cfg.max_seq_len
    hist = [random_history(cfg, n, gen) for n in full]
    prefix = [rng.randint(0, n) for n in full]
    prefix[-1] = 0  # nothing cached
    cache = new_cache(model, block_size, users * (cfg.max_seq_len // block_size + 2), users)
    items, actions, ts, offsets = jagged(hist, prefix, [0] * users)
    if items.numel():
        k, v, _ = model.prefill(items, actions, ts, offsets)
        append(cache, prefix, k, v, ts)
    done = list(prefix)
    while done != full:
        step = [min(n - d, rng.choice([0, 1, 1, 2, 5])) for d, n in zip(done, full)]
        if not any(step):
            continue
        items, actions, ts, offsets = jagged(hist, step, done)
        tables, lens = cache.batch_tables(range(users))
        k_new, v_new, emb = model.extend(items, actions, ts, offsets, cache.kv, cache.ts,
                                         tables, lens)  # fmt: skip
        assert k_new.dtype == cache.config.dtype
        append(cache, step, k_new, v_new, ts)
        done = [d + s for d, s in zip(done, step)]
        moved = [b for b in range(users) if step[b]]
        ref = model.prefill(*jagged([hist[b] for b in moved], [done[b] for b in moved],
                                    [0] * len(moved)))[2]  # fmt: skip
        assert rel_err(emb[moved], ref) < EMB_TOL

    k_ref, v_ref, _ = model.prefill(*jagged(hist, full, [0] * users))
    k_inc = torch.cat([cache.read(u)[0] for u in range(users)], 1)
    v_inc = torch.cat([cache.read(u)[1] for u in range(users)], 1)
    if precision.fp8_kv:
        assert k_inc.dtype == k_ref.dtype == FP8
        assert code_mismatch(k_inc, k_ref) <= CODE_MISMATCH_TOL
        assert code_mismatch(v_inc, v_ref) <= CODE_MISMATCH_TOL
    deq_k, deq_v = cached_kv(cache, model, users)
    scale = None if model.kv_quant is None else model.kv_quant.scale
    ref_k = k_ref if scale is None else k_ref.float() * scale[:, 0, None, :, None]
    ref_v = v_ref if scale is None else v_ref.float() * scale[:, 1, None, :, None]
    assert rel_err(deq_k, ref_k) < EMB_TOL and rel_err(deq_v, ref_v) < EMB_TOL


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("seed", range(3))
@torch.no_grad()
def test_rank_over_an_incremental_cache_equals_rank_over_a_recompute(
    seed: int, precision: ServingPrecision
) -> None:
    model = quantized_model(100 + seed, precision)
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    lens = [cfg.max_seq_len - 1, 5, 1, 12]
    hist = [random_history(cfg, n, gen) for n in lens]
    inc = new_cache(model, 3, 4 * cfg.max_seq_len, len(lens))
    for p in range(max(lens)):  # one token per user per step
        step = [1 if p < n else 0 for n in lens]
        items, actions, ts, offsets = jagged(hist, step, [p] * len(lens))
        tables, cl = inc.batch_tables(range(len(lens)))
        k, v, _ = model.extend(items, actions, ts, offsets, inc.kv, inc.ts, tables, cl)
        append(inc, step, k, v, ts)
    full = new_cache(model, 4, 4 * cfg.max_seq_len, len(lens))
    items, actions, ts, offsets = jagged(hist, lens, [0] * len(lens))
    k, v, _ = model.prefill(items, actions, ts, offsets)
    append(full, lens, k, v, ts)
    cand = torch.randint(cfg.first_item_row, cfg.num_items, (len(lens), 4), generator=gen)
    query_ts = torch.stack([h[2][-1] for h in hist])
    before = inc.kv.view(torch.uint8).clone() if precision.fp8_kv else inc.kv.clone()
    got = model.rank(cand, query_ts, inc.kv, inc.ts, *inc.batch_tables(range(len(lens))))
    want = model.rank(cand, query_ts, full.kv, full.ts, *full.batch_tables(range(len(lens))))
    assert rel_err(got, want) < EMB_TOL
    after = inc.kv.view(torch.uint8) if precision.fp8_kv else inc.kv
    assert torch.equal(after, before)  # rank writes nothing


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@torch.no_grad()
def test_quantization_error_against_the_unquantized_model(precision: ServingPrecision) -> None:
    """What FP8 costs in the outputs: a few percent of the user embedding at most."""
    base = random_model(7)
    model = quantized_model(7, precision)
    gen = torch.Generator().manual_seed(7)
    lens = [base.config.max_seq_len, 9, 3]
    batch = jagged([random_history(base.config, n, gen) for n in lens], lens, [0] * 3)
    err = rel_err(model.prefill(*batch)[2], base.prefill(*batch)[2])
    assert 0 < err < 0.05


def test_apply_precision_is_idempotent_and_one_way() -> None:
    model = random_model(1)
    assert model_precision(model) == ServingPrecision()
    both = ServingPrecision(kv_dtype="fp8_e4m3", weight_dtype="fp8")
    apply_precision(model, both)
    layer = model.layers[0]
    assert isinstance(layer.uvqk, FP8Linear) and isinstance(layer.proj, FP8Linear)
    assert model_precision(model) == both
    assert model.kv_quant is not None
    scale = model.kv_quant.scale.clone()
    apply_precision(model, both)
    assert torch.equal(model.kv_quant.scale, scale)
    assert isinstance(model.layers[0].uvqk, FP8Linear)
    with pytest.raises(ConfigError, match="fresh load"):
        apply_precision(model, ServingPrecision(kv_dtype="fp8_e4m3"))


def test_serving_precision_is_validated_and_keys_only_what_changed() -> None:
    with pytest.raises(ConfigError, match="kv_dtype='int8'"):
        ServingPrecision(kv_dtype="int8")
    with pytest.raises(ConfigError, match="weight_dtype='fp16'"):
        ServingPrecision(weight_dtype="fp16")
    assert ServingPrecision().key_settings() == {}
    assert ServingPrecision("fp8_e4m3", "fp8").key_settings() == {
        "kv_dtype": "fp8_e4m3",
        "weight_dtype": "fp8",
    }
    assert kv_storage_dtype(ServingPrecision("fp8_e4m3"), torch.bfloat16) == FP8
    assert kv_storage_dtype(ServingPrecision(), torch.bfloat16) == torch.bfloat16


@pytest.mark.slow
@pytest.mark.usefixtures("fp8_prebuilt")
def test_an_fp8_model_exports_and_its_package_equals_eager(tmp_path: Path) -> None:
    """The fallback path (CPU) in an AOTI package: FP8 weights, FP8 pool read and written;
    the package is keyed by the precision and checks the pool's dtype. It was compiled in
    the background beside the worker tests, which this module runs after (aoti_prebuild.py),
    else it compiles here."""
    both, config = FP8_BOTH, FP8_EXPORT
    model_dir = tiny_model_dir(tmp_path / "m")
    checkpoint = load_checkpoint(model_dir)
    apply_precision(checkpoint.model, both)
    model = checkpoint.model
    key = package_key(model.config, "float32", checkpoint.version, torch.device("cpu"), config)
    plain = package_key(model.config, "float32", checkpoint.version, torch.device("cpu"),
                        ExportConfig(entry_points=("extend",)))  # fmt: skip
    assert key.export_hash != plain.export_hash
    aoti = open_aoti_model(model_dir, "cpu", CACHE_DIR, compile_if_missing=True,
                           checkpoint=checkpoint, config=config, progress=print)  # fmt: skip
    assert aoti.kv_dtype == FP8
    cfg = model.config
    gen = torch.Generator().manual_seed(5)
    lens, new = [7, 0, 13], [1, 3, 2]
    hist = [random_history(cfg, n + m, gen) for n, m in zip(lens, new)]
    cache = new_cache(model, 4, 32, 3)
    with torch.no_grad():
        k, v, _ = model.prefill(*jagged(hist, lens, [0, 0, 0]))
    append(cache, lens, k, v, jagged(hist, lens, [0, 0, 0])[2])
    batch = jagged(hist, new, lens)
    tables, cached = cache.batch_tables(range(3))
    args = (*batch, cache.kv, cache.ts, tables, cached)
    with torch.no_grad():
        got, want = aoti.extend(*args), model.extend(*args)
    assert got[0].dtype == FP8 and code_mismatch(got[0], want[0]) <= CODE_MISMATCH_TOL
    assert code_mismatch(got[1], want[1]) <= CODE_MISMATCH_TOL
    assert rel_err(got[2], want[2]) < EMB_TOL
    with pytest.raises(ModelError, match=r"kv_pool must be torch\.float8_e4m3fn"):
        aoti.extend(*batch, cache.kv.float(), cache.ts, tables, cached)
    with pytest.raises(ExportError, match="export config asks for"):
        open_aoti_model(model_dir, "cpu", CACHE_DIR, compile_if_missing=False,
                        checkpoint=load_checkpoint(model_dir), config=config)  # fmt: skip
