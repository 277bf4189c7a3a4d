"""Which offset each partition may commit, given records that finish out of order.

Kafka's committed offset is "the next record to read", so after a crash everything from it
on is redelivered. Committing an offset therefore claims that every record *before* it has
had its effect made durable and published. Records finish out of order (a batch holds many
partitions; a dead-letter ack may come before a recommendation's), so the committable
position of a partition is its lowest tracked offset that is not yet done, or one past the
highest tracked offset when all are done. Offsets may jump (compacted topics, transaction
markers): positions are derived from the offsets actually tracked, never from ``+1``.

Per partition the tracked offsets arrive in increasing order (Kafka delivers a partition in
order), so they are kept in a deque and the set of unfinished ones in a set: ``track`` and
``done`` are O(1) amortised, each offset is pushed and popped once, and memory is bounded
by the unfinished span. A record re-delivered within a generation (the consumer sought
back) is not tracked twice: its first tracking already governs the position.

Generations: ``revoke`` forgets partitions, and when a partition is tracked again it starts
a new generation. ``track`` returns the generation a record belongs to and ``done`` must
quote it, so results computed before a rebalance can never complete a record that was
re-delivered after it; such calls are ignored and counted as stale.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

TopicPartition = tuple[str, int]  # aiokafka's TopicPartition is a NamedTuple of this shape


@dataclass
class _Partition:
    generation: int
    committed: int  # position last marked committed (or the first tracked offset)
    last_tracked: int
    tracked: deque[int] = field(default_factory=deque)  # increasing; done ones popped lazily
    unfinished: set[int] = field(default_factory=set)
    marked: bool = False  # ``committed`` was accepted by the broker (not just the start)

    def position(self) -> int:
        return self.tracked[0] if self.tracked else self.last_tracked + 1

    def complete(self, offset: int) -> None:
        self.unfinished.remove(offset)
        tracked = self.tracked
        while tracked and tracked[0] not in self.unfinished:
            tracked.popleft()


@dataclass(frozen=True)
class OffsetTrackerStats:
    """Counters since construction plus the current unfinished count per partition."""

    tracked: int
    completed: int
    duplicate_tracks: int  # offsets at or below a partition's last tracked one
    duplicate_dones: int  # done() for an offset not (or no longer) unfinished
    stale: int  # done() quoting another generation, or for a revoked partition
    revoked: int  # partitions forgotten
    pending: dict[TopicPartition, int]

    @property
    def pending_total(self) -> int:
        return sum(self.pending.values())


class OffsetTracker:
    """Per-partition commit positions under out-of-order completion. No Kafka import."""

    def __init__(self) -> None:
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._generations = itertools.count(1)
        self._tracked = 0
        self._completed = 0
        self._duplicate_tracks = 0
        self._duplicate_dones = 0
        self._stale = 0
        self._revoked = 0

    @property
    def partitions(self) -> list[TopicPartition]:
        return list(self._partitions)

    def generation(self, tp: TopicPartition) -> int | None:
        """The partition's current generation, or None if it is not tracked."""
        state = self._partitions.get(tp)
        return state.generation if state is not None else None

    def track(self, tp: TopicPartition, offset: int) -> int:
        """Record that ``offset`` was read from ``tp``; returns the generation to quote in done.

        The first offset tracked for a partition is taken as its already-committed position
        (the consumer started there), so it is not reported by ``committable`` until it
        moves.
        """
        state = self._partitions.get(tp)
        if state is None:
            state = _Partition(
                generation=next(self._generations), committed=offset, last_tracked=offset - 1
            )
            self._partitions[tp] = state
        if offset <= state.last_tracked:
            self._duplicate_tracks += 1
            return state.generation
        state.last_tracked = offset
        state.tracked.append(offset)
        state.unfinished.add(offset)
        self._tracked += 1
        return state.generation

    def track_many(self, tp: TopicPartition, offsets: Iterable[int]) -> int:
        """``track`` for one fetched chunk of a partition (offsets increasing)."""
        generation = 0
        state = self._partitions.get(tp)
        for offset in offsets:
            if state is None or offset <= state.last_tracked:
                generation = self.track(tp, offset)
                state = self._partitions[tp]
                continue
            state.last_tracked = offset
            state.tracked.append(offset)
            state.unfinished.add(offset)
            self._tracked += 1
            generation = state.generation
        return generation

    def done_many(self, tp: TopicPartition, offsets: Iterable[int], generation: int) -> int:
        """``done`` for several offsets of one partition; returns how many counted."""
        return sum(self.done(tp, offset, generation) for offset in offsets)

    def done(self, tp: TopicPartition, offset: int, generation: int) -> bool:
        """Mark a record's effect durable and published; False when ignored (stale/duplicate)."""
        state = self._partitions.get(tp)
        if state is None or state.generation != generation:
            self._stale += 1
            return False
        if offset not in state.unfinished:
            self._duplicate_dones += 1
            return False
        state.complete(offset)
        self._completed += 1
        return True

    def position(self, tp: TopicPartition) -> int | None:
        """The partition's committable position now (advanced or not), None if untracked."""
        state = self._partitions.get(tp)
        return state.position() if state is not None else None

    def committable(self) -> dict[TopicPartition, int]:
        """``{tp: offset to commit}`` for partitions whose position moved since last commit."""
        result: dict[TopicPartition, int] = {}
        for tp, state in self._partitions.items():
            pos = state.position()
            if pos != state.committed:
                result[tp] = pos
        return result

    def mark_committed(self, positions: Mapping[TopicPartition, int]) -> None:
        """Record that the broker accepted these positions (partitions since revoked are
        ignored)."""
        for tp, pos in positions.items():
            state = self._partitions.get(tp)
            if state is not None:
                state.committed = pos
                state.marked = True

    def committed(self) -> dict[TopicPartition, int]:
        """Positions this tracker's owner committed, per partition it still tracks."""
        return {tp: s.committed for tp, s in self._partitions.items() if s.marked}

    def revoke(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """Forget partitions; returns the final committable position of each one known.

        Every position is returned, moved or not, so the caller can commit them all on the
        way out; late ``done`` calls for these partitions then count as stale.
        """
        final: dict[TopicPartition, int] = {}
        for tp in tps:
            state = self._partitions.pop(tp, None)
            if state is not None:
                final[tp] = state.position()
                self._revoked += 1
        return final

    def stats(self) -> OffsetTrackerStats:
        return OffsetTrackerStats(
            tracked=self._tracked,
            completed=self._completed,
            duplicate_tracks=self._duplicate_tracks,
            duplicate_dones=self._duplicate_dones,
            stale=self._stale,
            revoked=self._revoked,
            pending={tp: len(s.unfinished) for tp, s in self._partitions.items()},
        )
