"""Stats of every cache tier, as plain frozen dataclasses.

The cache layer never talks to Prometheus: ``worker/metrics.py`` reads these snapshots
and turns them into gauges and counters. Counters are cumulative since construction;
gauges (``*_used``, ``users``, ``occupancy``) describe the moment of the snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole > 0 else 0.0


@dataclass(frozen=True)
class BlockPoolStats:
    """GPU KV block pool: block accounting of ``BlockPool``."""

    num_blocks: int
    block_size: int
    blocks_used: int
    blocks_free: int
    users: int
    pinned_users: int
    tokens: int  # cached tokens over all users
    allocs: int  # blocks handed out (cumulative)
    frees: int  # blocks returned by free/evict/trim (cumulative)
    evictions: int  # users evicted in LRU order (cumulative)
    evicted_blocks: int
    trimmed_blocks: int  # oldest blocks dropped by the sliding window
    no_room: int  # appends answered with NoRoom

    @property
    def occupancy(self) -> float:
        return _ratio(self.blocks_used, self.num_blocks)


@dataclass(frozen=True)
class HostTierStats:
    """Host (pinned memory) tier behind the GPU pool."""

    num_blocks: int
    blocks_used: int
    users: int
    offloads: int  # users copied GPU -> host
    onloads: int  # users copied host -> GPU
    drops: int  # users dropped entirely because the host tier was full
    bytes_offloaded: int
    bytes_onloaded: int

    @property
    def occupancy(self) -> float:
        return _ratio(self.blocks_used, self.num_blocks)


@dataclass(frozen=True)
class KVTiersStats:
    """Outcome counters of the GPU + host facade, plus the two tiers' own stats."""

    gpu_hits: int
    host_hits: int
    misses: int
    no_room: int  # ensure_room calls that could not be satisfied
    pool: BlockPoolStats
    host: HostTierStats | None

    @property
    def hit_rate(self) -> float:
        return _ratio(self.gpu_hits + self.host_hits, self.gpu_hits + self.host_hits + self.misses)


@dataclass(frozen=True)
class HistoryStoreStats:
    """History store (source of truth for prefill)."""

    backend: str
    appends: int  # batches appended
    events_applied: int
    events_skipped: int  # redelivered events (offset <= watermark)
    gets: int  # users read
    get_hits: int  # users read that had a stored history
    users: int  # users held locally (-1 when unknown, e.g. a shared Redis)
    bytes: int  # bytes held locally (-1 when unknown)

    @property
    def misses(self) -> int:
        return self.gets - self.get_hits


@dataclass(frozen=True)
class EmbeddingCacheStats:
    """Item-embedding cache: hot rows in device slots, the full table in host memory.

    A lookup is one item row asked for by a model call (a token or a candidate); a miss is
    one distinct row copied host -> device, so ``bytes_copied`` is misses x row bytes.
    """

    num_items: int
    num_slots: int  # rows the device holds (== num_items when fully resident)
    resident: int
    fully_resident: bool
    lookups: int
    misses: int  # distinct rows copied in, per call
    evictions: int
    copies: int  # host -> device copy calls (one per model call with misses, or chunk)
    bytes_copied: int  # host -> device bytes for cold rows
    device_bytes: int

    @property
    def hits(self) -> int:
        return self.lookups - self.misses

    @property
    def occupancy(self) -> float:
        return _ratio(self.resident, self.num_slots)

    @property
    def hit_rate(self) -> float:
        return _ratio(self.hits, self.lookups)


@dataclass(frozen=True)
class RetrievalSetStats:
    """The retrievable set: the items retrieval scores when the catalogue does not fit."""

    size: int
    num_items: int
    events: int  # new events observed
    events_in_set: int  # of those, events whose item was a member at the time
    refreshes: int
    swapped: int  # items that entered the set by refreshes (cumulative)
    last_refresh_s: float
    device_bytes: int

    @property
    def coverage(self) -> float:
        """Share of observed events whose item retrieval could have returned."""
        return _ratio(self.events_in_set, self.events)
