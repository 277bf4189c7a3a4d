"""Offset watermarks scoped to the log the offsets belong to.

The history store deduplicates redeliveries by offset: per user and topic-partition it
skips any event at or below the highest offset already applied. That is right only while
offsets keep counting up in *one* log. A broker that lost its data (the dev broker keeps
everything in memory; a Kafka cluster rebuilt from scratch) starts every partition at
offset 0 again, and unscoped watermarks would silently skip the new log's first events.

The rule: a log is identified by the broker's cluster id (Metadata v2+). A Kafka cluster
keeps its id for its whole life, restarts included, so there the scope never changes and
the watermarks behave as before; Tansu gets a fresh id on every start (``DevBroker`` sets
a unique ``--cluster-id``). Every event is stored under ``"<topic>@<cluster id>"``, so the
offsets of a new log start from fresh watermarks and those of the old log are kept (one
hash field per partition and cluster, a few bytes per user) but never consulted again.

The worker binds the scope once at start and checks the cluster id before every store
append and every commit; on a change it stops (``App``) rather than re-scope mid-flight:
records fetched around the switch cannot be told apart, and a restarted process binds
the new log cleanly. Duplicates *across* logs (a producer re-sending what the old log
already had) cannot be recognised by offset at all; they would need event ids.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from streamrec.cache.history_store import (
    AppendResult,
    History,
    HistoryEvent,
    HistoryStore,
    TopicPartition,
    UserId,
)
from streamrec.cache.stats import HistoryStoreStats
from streamrec.errors import BrokerError

SCOPE_SEPARATOR = "@"


class LogScopedStore(HistoryStore):
    """Wraps a store so that watermarks are kept per (topic @ cluster id, partition)."""

    def __init__(self, inner: HistoryStore, log_id: str = "") -> None:
        super().__init__(inner.max_seq_len)
        self.inner = inner
        self._log_id = log_id

    @property
    def log_id(self) -> str:
        return self._log_id

    def bind(self, log_id: str) -> None:
        """Set the log the following appends come from (once, when the worker connects)."""
        if SCOPE_SEPARATOR in log_id or ":" in log_id:
            raise BrokerError(
                f"cluster id {log_id!r} contains {SCOPE_SEPARATOR!r} or ':', "
                "which the watermark keys use as separators"
            )
        self._log_id = log_id

    def scoped(self, topic: str) -> str:
        return f"{topic}{SCOPE_SEPARATOR}{self._log_id}"

    async def append(self, batch: Sequence[HistoryEvent], scope: str = "") -> AppendResult:
        return await self.inner.append(batch, scope=self.scoped("") + scope)

    async def drop_partitions(self, tps: Collection[TopicPartition]) -> None:
        await self.inner.drop_partitions([(self.scoped(t), p) for t, p in tps])

    async def get(self, users: Sequence[UserId]) -> dict[UserId, History]:
        return await self.inner.get(users)

    async def drop(self, users: Sequence[UserId]) -> None:
        await self.inner.drop(users)

    async def delete(self, users: Sequence[UserId]) -> None:
        await self.inner.delete(users)

    async def ping(self) -> None:
        await self.inner.ping()

    async def close(self) -> None:
        """The inner store belongs to whoever made it (the ``App`` or a test)."""

    def stats(self) -> HistoryStoreStats:
        return self.inner.stats()
