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
class DiskTierStats:
    """Disk (file-backed) tier behind the host tier."""

    budget_bytes: int
    bytes_used: int
    users: int  # files held (users only on disk plus written host users)
    writes: int  # files completely written
    bytes_written: int
    write_failures: int  # I/O errors while writing: the user is forgotten, never half-read
    sync_writes: int  # host drops that had to wait for (or do) the write themselves
    evictions: int  # files deleted to make room (a user only on disk is then gone)
    rejects: int  # writes refused: nothing idle left to delete
    prefetches: int  # reads started ahead of the step
    late_reads: int  # reads the step itself had to start (no prefetch, or no free slot)
    waited_reads: int  # loads that found their read unfinished or not started
    loads: int  # users copied disk -> GPU
    bytes_read: int
    read_seconds: float  # from read start to its last chunk, summed over loads
    verify_failures: int  # torn, truncated, foreign or stale files: answered as misses
    staging_full: int  # prefetches refused for want of a staging slot
    # Device staging (CUDA): reads copied on to GPU buffers as they land, so the step's
    # onload is a device->device scatter. The buffers come on top of the KV budget.
    device_slots: int = 0
    device_staging_bytes: int = 0  # GPU memory the device slots hold
    device_staged_loads: int = 0  # loads scattered from a device slot (no copy in the step)
    device_staging_full: int = 0  # reads that found no device slot free (pinned-slot onload)

    @property
    def occupancy(self) -> float:
        return _ratio(self.bytes_used, self.budget_bytes)

    @property
    def read_gb_s(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0


@dataclass(frozen=True)
class KVTiersStats:
    """Outcome counters of the GPU + host + disk facade, plus each tier's own stats."""

    gpu_hits: int
    host_hits: int
    misses: int
    no_room: int  # ensure_room calls that could not be satisfied
    pool: BlockPoolStats
    host: HostTierStats | None
    disk_hits: int = 0
    disk: DiskTierStats | None = None

    @property
    def hit_rate(self) -> float:
        hits = self.gpu_hits + self.host_hits + self.disk_hits
        return _ratio(hits, hits + self.misses)


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
    pinned: int = 0  # rows the sweep may not evict (the retrievable set's members)

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
