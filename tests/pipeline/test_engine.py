"""Engine equivalence under cache pressure (issue 6, acceptance 2)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from streamrec.cache.history_backends import open_history_store
from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_tiers import KVTiers
from streamrec.errors import StoreError
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.pipeline.delta import Delta, UserDelta
from streamrec.pipeline.engine import Engine, EngineConfig
from streamrec.pipeline.micro_batcher import Batch, ReleaseReason
from streamrec.pipeline.reference import full_recompute
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.schemas.records import Recommendation

MAX_SEQ_LEN = 64
BLOCK_SIZE = 4


def _model(num_known: int, seed: int = 0) -> tuple[HSTU, ItemVocabulary]:
    torch.manual_seed(seed)
    vocab = ItemVocabulary([f"i{n}" for n in range(num_known)], num_oov_buckets=4)
    config = HSTUConfig(
        num_items=vocab.size,
        num_oov_buckets=4,
        d_model=32,
        num_layers=2,
        num_heads=2,
        head_dim=16,
        max_seq_len=MAX_SEQ_LEN,
        num_time_buckets=16,
    )
    return HSTU(config).eval(), vocab


def _stream(n_events: int, n_users: int, n_items: int, seed: int) -> list[Delta]:
    rng = np.random.default_rng(seed)
    ts = {f"u{u}": 1_700_000_000_000 + int(rng.integers(0, 10**6)) for u in range(n_users)}
    next_offset = {("pb", p): 0 for p in range(4)} | {("ia", p): 0 for p in range(4)}
    out = []
    for _ in range(n_events):
        user = f"u{int(rng.integers(0, n_users))}"
        topic = "pb" if rng.random() < 0.7 else "ia"
        partition = int(user[1:]) % 4
        offset = next_offset[(topic, partition)]
        next_offset[(topic, partition)] += 1
        ts[user] += int(rng.integers(1_000, 600_000))
        item = f"i{int(rng.integers(0, n_items + 3))}"  # a few unknown ids -> OOV buckets
        out.append(Delta(user, item, int(rng.integers(1, 12)), ts[user], topic, partition, offset))
    return out


def _batches(stream: list[Delta], events_per_batch: int) -> list[Batch]:
    batches = []
    for seq, start in enumerate(range(0, len(stream), events_per_batch)):
        chunk = stream[start : start + events_per_batch]
        by_user: dict[str, list[Delta]] = {}
        for d in chunk:
            by_user.setdefault(d.user_id, []).append(d)
        users = tuple(UserDelta(u, tuple(ds)) for u, ds in by_user.items())
        batches.append(Batch(seq, users, ReleaseReason.SIZE, 0.0, len(chunk)))
    return batches


def _engine(model: HSTU, vocab: ItemVocabulary, gpu_blocks: int, host_blocks: int, store) -> Engine:
    cfg = model.config
    cache = KVCache(
        KVCacheConfig(cfg.num_layers, cfg.num_heads, cfg.head_dim, BLOCK_SIZE, torch.float32),
        gpu_blocks,
        "cpu",
    )
    host = HostTier(cache, host_blocks) if host_blocks else None
    tiers = KVTiers(cache, host, cfg.max_seq_len)
    scoring = ScoringConfig(top_k=10, num_candidates=24, exclude_recent=5)
    return Engine(
        model,
        tiers,
        store,
        vocab,
        cfg.task_names,
        EngineConfig(model_name="test", model_version="v0", scoring=scoring),
    )


def _recompute(model: HSTU, histories, scoring: ScoringConfig):
    cfg = model.config
    return full_recompute(
        model,
        histories,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        max_seq_len=cfg.max_seq_len,
        dtype=torch.float32,
        task_names=cfg.task_names,
        scoring=scoring,
        block_size=BLOCK_SIZE,
    )


async def _process(engine: Engine, batch: Batch) -> dict[str, Recommendation]:
    """The batch's recommendations as validated records, by user (every user has one)."""
    result = await engine.process(batch)
    records = {rec.user_id: rec for rec in result.output.records()}
    rows = result.recommendation_rows()
    assert [ud.user_id for ud, row in zip(batch.users, rows, strict=True) if row is not None] == [
        result.output.user_ids[row] for row in rows if row is not None
    ]
    return records


async def test_incremental_equals_full_recompute_under_eviction() -> None:
    model, vocab = _model(num_known=300)
    store = open_history_store("memory://", MAX_SEQ_LEN)
    # 200 users x ~25 tokens need ~1,400 blocks; the GPU pool holds 90, the host 160.
    engine = _engine(model, vocab, gpu_blocks=90, host_blocks=160, store=store)
    last = {}
    for batch in _batches(_stream(5_000, 200, 300, seed=1), events_per_batch=40):
        recs = await _process(engine, batch)
        assert set(recs) == {ud.user_id for ud in batch.users}
        last.update(recs)
    stats = engine.stats()
    assert stats.gpu_hits > 100 and stats.host_hits > 100 and stats.misses > 200
    assert stats.tokens_extended > 1_000

    await assert_equals_recompute(model, vocab, store, last, engine.config.scoring)
    assert len(last) == 200
    await engine.close()


async def assert_equals_recompute(model, vocab, store, last, scoring: ScoringConfig) -> None:
    """Each user's last recommendation equals a full recompute of its stored history."""
    histories = await store.get(sorted(last))
    expected = _recompute(model, histories, scoring)
    assert set(expected) == set(last)
    for user, rec in last.items():
        want = expected[user]
        assert rec.version == histories[user].total_appended
        assert [item for item, _ in rec.items] == [vocab.external(int(r)) for r in want.items]
        got_scores = np.array([score for _, score in rec.items])
        np.testing.assert_allclose(got_scores, want.scores, rtol=1e-5, atol=1e-6)


async def test_redelivered_events_rebuild_and_publish_same_state() -> None:
    model, vocab = _model(num_known=50)
    store = open_history_store("memory://", MAX_SEQ_LEN)
    engine = _engine(model, vocab, gpu_blocks=64, host_blocks=0, store=store)
    stream = _stream(120, 6, 50, seed=2)
    batches = _batches(stream, events_per_batch=10)
    first = {}
    for batch in batches:
        first.update(await _process(engine, batch))
    # The whole stream again (a consumer restarting from an old commit): nothing applies,
    # every user is rebuilt from the store and gets the same list at the same version.
    again = {}
    for batch in batches:
        again.update(await _process(engine, batch))
    assert engine.stats().rebuilds_after_redelivery > 0
    for user, rec in first.items():
        assert again[user].version == rec.version
        assert [i for i, _ in again[user].items] == [i for i, _ in rec.items]
    await engine.close()


async def test_a_burst_longer_than_the_window_rebuilds_exactly() -> None:
    model, vocab = _model(num_known=40)
    store = open_history_store("memory://", MAX_SEQ_LEN)
    engine = _engine(model, vocab, gpu_blocks=64, host_blocks=0, store=store)
    stream = _stream(10 + 2 * MAX_SEQ_LEN, 1, 40, seed=4)  # one user
    first, burst = _batches(stream[:10], 10)[0], _batches(stream[10:], 2 * MAX_SEQ_LEN)[0]
    await engine.process(first)
    recs = await _process(
        engine, Batch(1, burst.users, burst.reason, burst.released_at, burst.n_events)
    )
    assert engine.stats().rebuilds_after_burst == 1
    histories = await store.get(["u0"])
    assert len(histories["u0"]) == MAX_SEQ_LEN  # the window
    want = _recompute(model, histories, engine.config.scoring)["u0"]
    rec = recs["u0"]
    assert rec.version == 10 + 2 * MAX_SEQ_LEN
    assert [i for i, _ in rec.items] == [vocab.external(int(r)) for r in want.items]
    await engine.close()


class _FlakyStore:
    """Fault injection: the first ``failures`` appends raise StoreError."""

    def __init__(self, inner, failures: int) -> None:
        self.inner = inner
        self.failures = failures

    async def append(self, batch):
        if self.failures:
            self.failures -= 1
            raise StoreError("redis://fake: connection refused")
        return await self.inner.append(batch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


async def test_store_outage_is_retried_not_skipped() -> None:
    model, vocab = _model(num_known=20)
    store = _FlakyStore(open_history_store("memory://", MAX_SEQ_LEN), failures=3)
    engine = _engine(model, vocab, gpu_blocks=32, host_blocks=0, store=store)
    engine_cfg = engine.config
    assert engine_cfg.store_retry_initial_s < 0.1
    batch = _batches(_stream(8, 2, 20, seed=3), events_per_batch=8)[0]
    result = await engine.process(batch)
    assert engine.stats().store_retries == 3
    assert all(row is not None for row in result.recommendation_rows())
    assert sum(ud.n_events for ud in result.batch.users) == 8
    await engine.close()


def test_engine_config_rejects_bad_backoff() -> None:
    with pytest.raises(Exception, match="backoff"):
        EngineConfig(model_name="m", model_version="v", store_retry_initial_s=0.0)
    with pytest.raises(Exception, match="prefill_call_tokens=0"):
        EngineConfig(model_name="m", model_version="v", prefill_call_tokens=0)


def _user_batch(seq: int, events: dict[str, int], start_offset: int) -> Batch:
    """One batch with ``events[user]`` playback events per user, offsets increasing."""
    users, offset = [], start_offset
    for user, n in events.items():
        deltas = []
        for _ in range(n):
            ts = 1_700_000_000_000 + 1_000 * offset
            deltas.append(Delta(user, f"i{offset % 30}", 1, ts, "pb", 0, offset))
            offset += 1
        users.append(UserDelta(user, tuple(deltas)))
    return Batch(seq, tuple(users), ReleaseReason.SIZE, 0.0, sum(events.values()))


async def test_a_batch_too_big_for_the_pool_is_split_and_a_lost_user_rebuilt() -> None:
    """The split-on-no-room path and the ``lost`` re-read, asserted.

    Nine blocks of four tokens hold a1..a3 (twelve tokens each). The next batch brings one
    token each (a new block each) and a new user b: five blocks, none free, all pinned:
    NoRoom, so the step splits it. The first half (a1, a2) evicts the least recently used
    unpinned user, a3, and with no host tier a3 is gone by its turn: the engine reads its
    history again and rebuilds it. Every list still equals the full recompute."""
    model, vocab = _model(num_known=30)
    store = open_history_store("memory://", MAX_SEQ_LEN)
    engine = _engine(model, vocab, gpu_blocks=9, host_blocks=0, store=store)
    await engine.process(_user_batch(0, {"a1": 12, "a2": 12, "a3": 12}, 0))
    assert engine.cached_users() == {"a1", "a2", "a3"}
    recs = await _process(engine, _user_batch(1, {"a1": 1, "a2": 1, "a3": 1, "b": 4}, 36))
    stats = engine.stats()
    assert stats.batch_splits >= 1
    assert stats.rebuilds_after_loss == 1
    histories = await store.get(sorted(recs))
    want = _recompute(model, histories, engine.config.scoring)
    for user, rec in recs.items():
        assert rec.version == histories[user].total_appended
        assert [i for i, _ in rec.items] == [vocab.external(int(r)) for r in want[user].items]
    await engine.close()


async def test_users_of_names_the_cached_users_of_revoked_partitions() -> None:
    model, vocab = _model(num_known=30)
    store = open_history_store("memory://", MAX_SEQ_LEN)
    engine = _engine(model, vocab, gpu_blocks=32, host_blocks=0, store=store)
    batch = _user_batch(0, {"a": 2, "b": 2}, 0)
    moved = UserDelta("b", tuple(d._replace(partition=1) for d in batch.users[1].deltas))
    await engine.process(Batch(0, (batch.users[0], moved), ReleaseReason.SIZE, 0.0, 4))
    assert engine.users_of([("pb", 1)]) == ["b"]
    assert engine.users_of([("pb", 0), ("pb", 1)]) == ["a", "b"]
    await engine.drop(engine.users_of([("pb", 1)]))
    assert engine.cached_users() == {"a"}
    await engine.close()


@pytest.mark.parametrize("overlapped", [False, True])
async def test_a_user_lost_while_later_batches_are_prepared_is_rebuilt_once(
    overlapped: bool,
) -> None:
    """``prepare`` runs ahead of ``execute``: two batches of ``a`` are prepared (their
    events appended) before the first executes, and an earlier step evicted ``a`` from
    every tier meanwhile. The first batch rebuilds ``a`` from the store's window, which
    already holds the second batch's events, and publishes that newer list; the second
    batch must not add those tokens again: it publishes nothing for ``a``. Every list
    equals the full recompute, and the next extend of ``a`` is a plain cached one."""
    model, vocab = _model(num_known=30)
    store = open_history_store("memory://", MAX_SEQ_LEN)
    engine = _engine(model, vocab, gpu_blocks=32, host_blocks=0, store=store)
    await engine.process(_user_batch(0, {"a": 12, "b": 12}, 0))
    first = await engine.prepare(_user_batch(1, {"a": 1, "b": 1}, 24))
    second = await engine.prepare(_user_batch(2, {"a": 2}, 26))
    engine.tiers.drop(["a"])  # what an earlier step's admission does to a victim
    if overlapped:  # as the serving pipeline hands them over: both steps queued at once
        results = await asyncio.gather(engine.execute(first), engine.execute(second))
    else:
        results = [await engine.execute(first), await engine.execute(second)]
    recs_first, recs_second = ({r.user_id: r for r in x.output.records()} for x in results)
    assert set(recs_first) == {"a", "b"} and not recs_second
    assert engine.stats().rebuilds_after_loss == 1
    histories = await store.get(["a", "b"])
    want = _recompute(model, histories, engine.config.scoring)
    assert recs_first["a"].version == 15  # the second batch's events included
    for user, rec in recs_first.items():
        assert rec.version == histories[user].total_appended == want[user].version
        assert [i for i, _ in rec.items] == [vocab.external(int(r)) for r in want[user].items]
        np.testing.assert_allclose([s for _, s in rec.items], want[user].scores, rtol=1e-5)
    third = await engine.execute(await engine.prepare(_user_batch(3, {"a": 1}, 28)))
    rec = {r.user_id: r for r in third.output.records()}["a"]
    histories = await store.get(["a"])
    want = _recompute(model, histories, engine.config.scoring)
    assert rec.version == 16 and rec.items[0][0] == vocab.external(int(want["a"].items[0]))
    np.testing.assert_allclose([s for _, s in rec.items], want["a"].scores, rtol=1e-5)
    assert engine.stats().gpu_hits >= 1 and engine.stats().rebuilds_after_loss == 1
    await engine.close()


def test_a_steps_token_rows_start_16_byte_aligned_for_any_token_count() -> None:
    """An AOTI package compiled for aligned inputs copies a misaligned one on every call:
    items, actions and ts of an odd number of tokens must still each start aligned."""
    from streamrec.pipeline.model_step import UserWork

    model, vocab = _model(30)
    engine = _engine(model, vocab, 64, 0, open_history_store("memory://", 64))
    rng = np.random.default_rng(0)
    for counts in ([1], [2, 1], [3, 2, 2]):
        work = [
            UserWork(f"u{n}", rng.integers(1, 40, size=(c, 3)), False, np.zeros(0, np.int64), c)
            for n, c in enumerate(counts)
        ]
        items, actions, ts, offsets = engine.step._jagged(work)
        tokens = np.concatenate([w.tokens for w in work])
        for column, tensor in enumerate((items, actions, ts)):
            assert tensor.data_ptr() % 16 == 0 and tensor.is_contiguous()
            assert tensor.tolist() == tokens[:, column].tolist()
        assert offsets.tolist() == [0, *np.cumsum(counts).tolist()]


async def test_a_stored_row_outside_the_vocabulary_is_a_named_error_not_a_device_fault() -> None:
    # A store written under a larger vocabulary: on the GPU the embedding lookup of that
    # row would be a device-side assert that ends the process's CUDA context.
    from streamrec.cache.history_store import HistoryEvent, Token
    from streamrec.errors import PipelineError

    model, vocab = _model(30)
    store = open_history_store("memory://", MAX_SEQ_LEN)
    rows = [vocab.first_item_row, vocab.size + 5, vocab.first_item_row + 1]
    await store.append(
        [
            HistoryEvent("ux", "history", 0, n, Token(row, 1, 1_600_000_000_000 + n))
            for n, row in enumerate(rows)
        ]
    )
    engine = _engine(model, vocab, 64, 0, store)
    with pytest.raises(PipelineError, match=rf"'ux'.*row {vocab.size + 5}.*another vocabulary"):
        await _process(engine, _user_batch(0, {"ux": 1}, 10))
