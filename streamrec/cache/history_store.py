"""The user history store: the source of truth a cache miss is prefilled from.

Kafka delivers at least once, so the same event may arrive again after a crash or a
rebalance. The store turns that into exactly-once state: per user and per source
topic-partition it remembers the highest applied offset (the watermark) and skips any
event at or below it. Watermarks are kept per *user* rather than per partition, so one
partition carrying many users is no problem and a batch may be retried blindly.

Backends are picked by URL (``history_backends.open_history_store``): ``memory://`` keeps
everything in this process (the embedded default, lost on restart);
``redis://host:port/db`` is shared by all workers and survives restarts and rebalances.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from streamrec.cache.stats import HistoryStoreStats
from streamrec.errors import ConfigError

UserId = str
TopicPartition = tuple[str, int]
IntArray = npt.NDArray[np.int64]


class Token(NamedTuple):
    """One history token; ``item`` is already a dense vocabulary index."""

    item: int
    action: int
    ts_ms: int


class HistoryEvent(NamedTuple):
    """A token with the Kafka coordinates it came from (plain tuples work too)."""

    user_id: UserId
    topic: str
    partition: int
    offset: int
    token: Token | tuple[int, int, int]


@dataclass(frozen=True)
class History:
    """A user's last ``max_seq_len`` tokens, oldest first, and its watermarks."""

    items: IntArray  # [L]
    actions: IntArray  # [L]
    ts: IntArray  # [L] ms
    watermarks: dict[TopicPartition, int]
    total_appended: int  # tokens ever applied, including those the window dropped

    def __len__(self) -> int:
        return int(self.items.shape[0])

    @classmethod
    def from_table(
        cls, table: IntArray, watermarks: dict[TopicPartition, int], total: int
    ) -> History:
        """From ``table[L, 3]`` rows of ``(item, action, ts_ms)``."""
        return cls(
            items=table[:, 0].copy(),
            actions=table[:, 1].copy(),
            ts=table[:, 2].copy(),
            watermarks=watermarks,
            total_appended=total,
        )

    @classmethod
    def empty(cls) -> History:
        none = np.zeros(0, dtype=np.int64)
        return cls(none, none.copy(), none.copy(), {}, 0)

    def same_as(self, other: History) -> bool:
        """Equal tokens, watermarks and counts (numpy arrays defeat ``==``)."""
        return (
            np.array_equal(self.items, other.items)
            and np.array_equal(self.actions, other.actions)
            and np.array_equal(self.ts, other.ts)
            and self.watermarks == other.watermarks
            and self.total_appended == other.total_appended
        )


@dataclass(frozen=True)
class AppendResult:
    """What an ``append`` actually changed."""

    applied: dict[UserId, int] = field(default_factory=dict)  # tokens applied per user
    skipped: int = 0  # redelivered events (offset <= watermark)

    @property
    def total_applied(self) -> int:
        return sum(self.applied.values())


class HistoryStore(abc.ABC):
    """Idempotent per-user token histories (async: a backend may be remote)."""

    def __init__(self, max_seq_len: int) -> None:
        if max_seq_len <= 0:
            raise ConfigError(f"max_seq_len must be > 0, got {max_seq_len}")
        self.max_seq_len = max_seq_len
        self._appends = 0
        self._applied = 0
        self._skipped = 0
        self._gets = 0
        self._get_hits = 0

    @abc.abstractmethod
    async def append(self, batch: Sequence[HistoryEvent], scope: str = "") -> AppendResult:
        """Apply events in batch order, skipping redelivered ones; durable on return.

        Watermarks are kept under ``topic + scope`` (``worker.log_scoped_store``: the
        log the offsets belong to), so a caller scopes a batch without copying it."""

    @abc.abstractmethod
    async def get(self, users: Sequence[UserId]) -> dict[UserId, History]:
        """Every requested user's history (``History.empty()`` when none is stored)."""

    @abc.abstractmethod
    async def drop(self, users: Sequence[UserId]) -> None:
        """Release this process's copy of users it no longer owns (a rebalance).

        A shared backend keeps the data: the user's new owner reads it from there.
        """

    @abc.abstractmethod
    async def drop_partitions(self, tps: Collection[TopicPartition]) -> None:
        """``drop`` every user with an applied event from one of ``tps`` (a revoke)."""

    @abc.abstractmethod
    async def delete(self, users: Sequence[UserId]) -> None:
        """Erase users everywhere (data deletion requests, tests)."""

    @abc.abstractmethod
    async def ping(self) -> None:
        """Raise ``StoreError`` when the backend is unreachable (readiness checks)."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    def stats(self) -> HistoryStoreStats: ...

    def _counted(self, result: AppendResult) -> AppendResult:
        self._appends += 1
        self._applied += result.total_applied
        self._skipped += result.skipped
        return result

    def _counted_gets(self, histories: dict[UserId, History]) -> dict[UserId, History]:
        self._gets += len(histories)
        self._get_hits += sum(1 for h in histories.values() if h.total_appended)
        return histories

    def _stats(self, backend: str, users: int, nbytes: int) -> HistoryStoreStats:
        return HistoryStoreStats(
            backend=backend,
            appends=self._appends,
            events_applied=self._applied,
            events_skipped=self._skipped,
            gets=self._gets,
            get_hits=self._get_hits,
            users=users,
            bytes=nbytes,
        )
