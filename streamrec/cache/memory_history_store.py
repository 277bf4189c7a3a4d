"""In-process history store: the embedded default, lost when the process ends.

Each user's window is one ``[L, 3]`` int64 array (item, action, ts_ms), not a deque of
tuples: the garbage collector traverses every element of a container it tracks, and two
thousand users' deques of a thousand tuples made each full collection a 100-200 ms pause
of the whole worker (CPU machine, ``worker_bench --host-ceiling``), about every 500,000
appended events. A NumPy array is one object with nothing to traverse.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from streamrec.cache.history_store import (
    AppendResult,
    History,
    HistoryEvent,
    HistoryStore,
    TopicPartition,
    UserId,
)
from streamrec.cache.stats import HistoryStoreStats

_TOKEN_BYTES = 24  # three int64, as the Redis backend packs them


_EMPTY = np.zeros((0, 3), dtype=np.int64)


@dataclass
class _UserHistory:
    table: np.ndarray = field(default_factory=lambda: _EMPTY)  # [L, 3] int64, oldest first
    watermarks: dict[TopicPartition, int] = field(default_factory=dict)
    total: int = 0


class MemoryHistoryStore(HistoryStore):
    """Histories in a dict of per-user arrays; appends are synchronous under the hood."""

    def __init__(self, max_seq_len: int) -> None:
        super().__init__(max_seq_len)
        self._users: dict[UserId, _UserHistory] = {}

    async def append(self, batch: Sequence[HistoryEvent], scope: str = "") -> AppendResult:
        applied: dict[UserId, int] = {}
        skipped = 0
        keys: dict[tuple[str, int], TopicPartition] = {}
        rows: dict[UserId, list[tuple[int, int, int]]] = {}
        for user_id, topic, partition, offset, token in batch:
            state = self._users.get(user_id)
            if state is None:
                state = self._users[user_id] = _UserHistory()
            tp = keys.get((topic, partition))
            if tp is None:
                tp = keys[(topic, partition)] = (topic + scope, partition)
            if offset <= state.watermarks.get(tp, -1):
                skipped += 1
                continue
            state.watermarks[tp] = offset
            new = rows.get(user_id)
            if new is None:
                new = rows[user_id] = []
            new.append((int(token[0]), int(token[1]), int(token[2])))
        for user_id, new in rows.items():
            state = self._users[user_id]
            added = np.array(new, dtype=np.int64)  # [n, 3]
            state.table = np.concatenate([state.table, added])[-self.max_seq_len :]
            state.total += len(new)
            applied[user_id] = len(new)
        return self._counted(AppendResult(applied, skipped))

    async def get(self, users: Sequence[UserId]) -> dict[UserId, History]:
        out: dict[UserId, History] = {}
        for user in users:
            state = self._users.get(user)
            if state is None:
                out[user] = History.empty()
                continue
            out[user] = History.from_table(state.table, dict(state.watermarks), state.total)
        return self._counted_gets(out)

    async def drop(self, users: Sequence[UserId]) -> None:
        for user in users:
            self._users.pop(user, None)

    async def drop_partitions(self, tps: Collection[TopicPartition]) -> None:
        wanted = set(tps)
        gone = [u for u, s in self._users.items() if not wanted.isdisjoint(s.watermarks)]
        await self.drop(gone)

    async def delete(self, users: Sequence[UserId]) -> None:
        await self.drop(users)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._users.clear()

    def stats(self) -> HistoryStoreStats:
        tokens = sum(len(s.table) for s in self._users.values())
        return self._stats("memory", len(self._users), tokens * _TOKEN_BYTES)
