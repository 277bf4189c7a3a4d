"""Watermarks scoped by the broker's cluster id: a new log's offsets restart at 0."""

from __future__ import annotations

import pytest

from streamrec.cache.history_store import HistoryEvent, Token
from streamrec.cache.memory_history_store import MemoryHistoryStore
from streamrec.errors import BrokerError
from streamrec.worker.log_scoped_store import LogScopedStore


def events(offsets: range, item: int) -> list[HistoryEvent]:
    return [HistoryEvent("u1", "pb", 0, o, Token(item, 1, 1_000 + o)) for o in offsets]


async def test_a_new_log_is_applied_although_its_offsets_restart() -> None:
    inner = MemoryHistoryStore(16)
    store = LogScopedStore(inner, "cluster-a")
    assert (await store.append(events(range(3), 1))).total_applied == 3
    assert (await store.append(events(range(3), 1))).skipped == 3  # redelivery: deduplicated
    store.bind("cluster-b")
    assert (await store.append(events(range(2), 2))).total_applied == 2  # offsets 0, 1 again
    assert (await store.append(events(range(2), 2))).skipped == 2
    history = (await store.get(["u1"]))["u1"]
    assert history.items.tolist() == [1, 1, 1, 2, 2]
    assert history.total_appended == 5
    assert history.watermarks == {("pb@cluster-a", 0): 2, ("pb@cluster-b", 0): 1}
    assert store.stats() == inner.stats()


async def test_plain_tuples_are_scoped_too() -> None:
    store = LogScopedStore(MemoryHistoryStore(16), "c")
    await store.append([("u1", "ia", 3, 7, (4, 2, 9))])  # type: ignore[list-item]
    assert (await store.get(["u1"]))["u1"].watermarks == {("ia@c", 3): 7}


@pytest.mark.parametrize("bad", ["a:b", "a@b"])
def test_a_cluster_id_with_a_separator_is_refused(bad: str) -> None:
    store = LogScopedStore(MemoryHistoryStore(16))
    with pytest.raises(BrokerError, match=bad):
        store.bind(bad)


async def test_close_leaves_the_inner_store_to_its_owner() -> None:
    inner = MemoryHistoryStore(16)
    store = LogScopedStore(inner, "c")
    await store.append(events(range(1), 1))
    await store.close()
    assert (await inner.get(["u1"]))["u1"].total_appended == 1
