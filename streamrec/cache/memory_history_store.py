"""In-process history store: the embedded default, lost when the process ends."""

from __future__ import annotations

from collections import deque
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


@dataclass
class _UserHistory:
    tokens: deque[tuple[int, int, int]]
    watermarks: dict[TopicPartition, int] = field(default_factory=dict)
    total: int = 0


class MemoryHistoryStore(HistoryStore):
    """Histories in a dict of bounded deques; appends are synchronous under the hood."""

    def __init__(self, max_seq_len: int) -> None:
        super().__init__(max_seq_len)
        self._users: dict[UserId, _UserHistory] = {}

    async def append(self, batch: Sequence[HistoryEvent], scope: str = "") -> AppendResult:
        applied: dict[UserId, int] = {}
        skipped = 0
        keys: dict[tuple[str, int], TopicPartition] = {}
        for user_id, topic, partition, offset, token in batch:
            state = self._users.get(user_id)
            if state is None:
                state = _UserHistory(deque(maxlen=self.max_seq_len))
                self._users[user_id] = state
            tp = keys.get((topic, partition))
            if tp is None:
                tp = keys[(topic, partition)] = (topic + scope, partition)
            if offset <= state.watermarks.get(tp, -1):
                skipped += 1
                continue
            state.watermarks[tp] = offset
            state.tokens.append((int(token[0]), int(token[1]), int(token[2])))
            state.total += 1
            applied[user_id] = applied.get(user_id, 0) + 1
        return self._counted(AppendResult(applied, skipped))

    async def get(self, users: Sequence[UserId]) -> dict[UserId, History]:
        out: dict[UserId, History] = {}
        for user in users:
            state = self._users.get(user)
            if state is None:
                out[user] = History.empty()
                continue
            table = np.array(state.tokens, dtype=np.int64).reshape(-1, 3)  # [L, 3]
            out[user] = History.from_table(table, dict(state.watermarks), state.total)
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
        tokens = sum(len(s.tokens) for s in self._users.values())
        return self._stats("memory", len(self._users), tokens * _TOKEN_BYTES)
