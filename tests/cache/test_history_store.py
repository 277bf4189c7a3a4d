import random
from collections.abc import Sequence

import pytest

from streamrec.cache.history_backends import open_history_store
from streamrec.cache.history_store import (
    History,
    HistoryEvent,
    HistoryStore,
    Token,
)
from streamrec.cache.memory_history_store import MemoryHistoryStore
from streamrec.errors import ConfigError

MAX_SEQ_LEN = 40
TOPICS = ("playback-events", "interaction-events")
PARTITIONS = 3


def _stream(n_events: int, n_users: int, seed: int) -> list[HistoryEvent]:
    """Co-partitioned, keyed by user: many users share each topic-partition."""
    rng = random.Random(seed)
    next_offset = {(t, p): rng.randrange(0, 1000) for t in TOPICS for p in range(PARTITIONS)}
    events = []
    for i in range(n_events):
        user = f"user-{rng.randrange(n_users)}"
        topic, partition = rng.choice(TOPICS), int(user.split("-")[1]) % PARTITIONS
        offset = next_offset[(topic, partition)]
        next_offset[(topic, partition)] += rng.choice((1, 1, 2))  # compaction/tx gaps
        token = Token(rng.randrange(1, 10_000), rng.randrange(1, 12), 1_700_000_000_000 + i)
        events.append(HistoryEvent(user, topic, partition, offset, token))
    return events


def _with_redeliveries(events: list[HistoryEvent], seed: int) -> list[HistoryEvent]:
    """A random 30% delivered again, shuffled, each copy somewhere after its original."""
    rng = random.Random(seed)
    out: list[HistoryEvent | None] = list(events)
    slots: list[list[HistoryEvent]] = [[] for _ in range(len(events) + 1)]
    for i in rng.sample(range(len(events)), k=int(0.3 * len(events))):
        slots[rng.randrange(i + 1, len(events) + 1)].append(events[i])
    merged: list[HistoryEvent] = []
    for i in range(len(events) + 1):
        rng.shuffle(slots[i])
        merged.extend(slots[i])
        if i < len(events):
            event = out[i]
            assert event is not None
            merged.append(event)
    return merged


async def _deliver(store: HistoryStore, events: Sequence[HistoryEvent], seed: int) -> int:
    rng = random.Random(seed)
    applied, i = 0, 0
    while i < len(events):
        size = rng.randrange(1, 200)
        result = await store.append(events[i : i + size])
        applied += result.total_applied
        i += size
    return applied


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def store_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    return str(request.getfixturevalue("redis_url"))


async def test_redelivery_leaves_every_history_as_after_one_delivery(store_url: str) -> None:
    events = _stream(n_events=2500, n_users=30, seed=1)
    users = sorted({e.user_id for e in events})
    once = MemoryHistoryStore(MAX_SEQ_LEN)
    assert await _deliver(once, events, seed=2) == len(events)
    expected = await once.get(users)

    store = open_history_store(store_url, MAX_SEQ_LEN)
    redelivered = _with_redeliveries(events, seed=3)
    assert len(redelivered) == len(events) + 750
    assert await _deliver(store, redelivered, seed=4) == len(events)
    got = await store.get(users)
    stats = store.stats()
    assert (stats.events_applied, stats.events_skipped) == (len(events), 750)
    await store.close()
    for user in users:
        assert got[user].same_as(expected[user]), user
        assert len(got[user]) == min(MAX_SEQ_LEN, got[user].total_appended)
    assert max(len(h) for h in got.values()) == MAX_SEQ_LEN  # the window was exercised


async def test_append_result_counts_per_user_and_keeps_the_last_tokens(store_url: str) -> None:
    store = open_history_store(store_url, 3)
    batch = [
        ("u1", "t", 0, 5, (1, 2, 3)),
        ("u1", "t", 0, 5, (1, 2, 3)),  # redelivered inside the same batch
        ("u1", "t", 1, 0, (4, 5, 6)),
        ("u2", "t", 0, 6, (7, 8, 9)),  # same partition, other user: own watermark
        ("u1", "t", 0, 7, (10, 11, 12)),
        ("u1", "t", 0, 8, (13, 14, 15)),
    ]
    result = await store.append([HistoryEvent(*e) for e in batch])
    assert (result.applied, result.skipped) == ({"u1": 4, "u2": 1}, 1)
    result = await store.append([HistoryEvent("u2", "t", 0, 3, Token(0, 0, 0))])
    assert (result.applied, result.skipped) == ({}, 1)
    got = await store.get(["u1", "u2", "nobody"])
    u1 = got["u1"]
    assert u1.items.tolist() == [4, 10, 13] and u1.ts.tolist() == [6, 12, 15]
    assert u1.actions.tolist() == [5, 11, 14]
    assert u1.watermarks == {("t", 0): 8, ("t", 1): 0} and u1.total_appended == 4
    assert got["u2"].watermarks == {("t", 0): 6}
    assert got["nobody"].same_as(History.empty())
    stats = store.stats()
    assert (stats.gets, stats.get_hits, stats.misses) == (3, 2, 1)
    await store.delete(["u1", "u2"])
    assert all(len(h) == 0 for h in (await store.get(["u1", "u2"])).values())
    await store.close()


async def test_memory_store_reads_between_appends_equal_the_last_tokens() -> None:
    """Reads interleaved with appends: each read is the last ``max_seq_len`` tokens, and a
    History already returned never changes under later appends."""
    store = MemoryHistoryStore(MAX_SEQ_LEN)
    rng = random.Random(7)
    sent: dict[str, list[tuple[int, int, int]]] = {"a": [], "b": []}
    held = []
    offset = 0
    for step in range(120):
        batch = []
        for _ in range(rng.randrange(0, 9)):
            user = rng.choice("ab")
            token = (rng.randrange(1, 99), rng.randrange(1, 5), step * 100 + offset)
            batch.append(HistoryEvent(user, "t", 0, offset, Token(*token)))
            sent[user].append(token)
            offset += 1
        await store.append(batch)
        if step % 3 == 0:
            got = await store.get(["a", "b"])
            for user, history in got.items():
                want = sent[user][-MAX_SEQ_LEN:]
                rows = list(zip(history.items, history.actions, history.ts, strict=True))
                assert [tuple(map(int, r)) for r in rows] == want
                held.append((history, [t[0] for t in want]))
    for history, items in held:
        assert history.items.tolist() == items
    assert store.stats().bytes == 24 * 2 * MAX_SEQ_LEN


def test_unknown_scheme_is_a_config_error_naming_the_url() -> None:
    with pytest.raises(ConfigError, match="kafka://x"):
        open_history_store("kafka://x", 10)
    with pytest.raises(ConfigError, match="max_seq_len"):
        open_history_store("memory://", 0)


async def test_memory_store_holds_a_window_as_one_array_not_one_object_per_token() -> None:
    """A full collection visits every referent of every tracked object: a window kept as
    a deque of tuples added one visit per stored token (100-200 ms pauses with 2,000 users
    of ~1,000 tokens). The window is one array, whatever its length."""
    import gc

    def visits() -> int:  # the referents a full collection would traverse
        gc.collect()
        return sum(len(gc.get_referents(o)) for o in gc.get_objects())

    store = MemoryHistoryStore(4_096)
    await store.append(_stream(100, 1, seed=3))  # one user: its state exists
    before = visits()
    await store.append(
        [HistoryEvent("user-0", TOPICS[0], 0, 10_000 + i, Token(i, 1, i)) for i in range(4_000)]
    )
    assert visits() - before < 1_000  # a deque of tuples: ~4,000 (one per token)
    history = (await store.get(["user-0"]))["user-0"]
    assert len(history) == 4_096 and history.items[-1] == 3_999
