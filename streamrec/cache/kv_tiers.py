"""What the engine asks of the KV cache per step: GPU pool, host tier and disk tier behind
one facade.

An engine step over a batch of users goes:

0. ``prefetch(users)`` (thread-safe, any time before the step: the engine calls it when it
   plans a batch): start reading the users that are only on disk.
1. ``settle(users)``: where each user's cache is (GPU / host / disk / nowhere), waiting for
   the disk reads of this batch and verifying them: a torn or stale file answers MISS.
   ``resolve`` is the same answer without waiting (no side effects).
   The engine reads the history of the misses from the history store.
2. ``ensure_room({user: tokens to add})``: tokens to add are the new tokens of a hit and
   the whole (window-capped) history of a miss. Pins the batch, applies the sliding
   window, evicts unpinned users in LRU order to the host tier when short (the host tier
   makes room by moving its own LRU users to disk), and onloads the batch's host and disk
   hits into fresh GPU blocks. Returns ``NoRoom`` (batch unpinned, nothing evicted) when
   even that is not enough, so the engine can split the batch. Afterwards the host tier's
   LRU tail is written to disk in the background, so the next spill finds it written.
3. ``append(user, n)`` → slots; ``cache.write(slots, k, v, ts)`` after ``prefill`` /
   ``extend``; ``cache.batch_tables(users)`` feeds ``extend`` and ``rank``.
4. ``unpin(users)`` when the step is done.

Window trims happen in step 2 even when it then answers NoRoom: they only drop tokens the
user's next append would drop anyway, so a retried step sees the same state.

A user is on the disk tier either as the clean copy of a host entry (written ahead) or
only there; a file is dropped the moment its user goes back to the GPU, whose cache then
moves on, so a file never describes anything but the user's current state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from streamrec.cache.block_pool import NoRoom, Slots, UserKey, window_blocks_to_drop
from streamrec.cache.disk_tier import DiskTier
from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache
from streamrec.cache.stats import KVTiersStats
from streamrec.errors import CacheError, ConfigError
from streamrec.schemas.records import CacheOutcome  # HOST/DISK_HIT: onloaded by ensure_room

GPU_HIT, HOST_HIT, DISK_HIT, MISS = (
    CacheOutcome.GPU_HIT,
    CacheOutcome.HOST_HIT,
    CacheOutcome.DISK_HIT,
    CacheOutcome.MISS,
)
# Background writes keep this share of the host tier's oldest blocks on disk already.
WRITE_AHEAD_FRACTION = 0.25
MAX_WRITES_IN_FLIGHT = 4


@dataclass(frozen=True)
class Admission:
    """A successful ``ensure_room``: every user's outcome and what was displaced for it."""

    outcomes: dict[UserKey, CacheOutcome]
    evicted: list[UserKey] = field(default_factory=list)  # moved GPU -> host, LRU order
    dropped: list[UserKey] = field(default_factory=list)  # gone from every tier
    trimmed_tokens: int = 0  # dropped by the sliding window


class KVTiers:
    """GPU pool plus optional host and disk tiers; the cache API of one engine."""

    def __init__(
        self,
        cache: KVCache,
        host: HostTier | None,
        max_seq_len: int,
        disk: DiskTier | None = None,
    ) -> None:
        if max_seq_len <= 0:
            raise ConfigError(f"max_seq_len must be > 0, got {max_seq_len}")
        if host is not None and host.cache is not cache:
            raise ConfigError("the host tier must be built over the same KVCache")
        if disk is not None and (host is None or disk.cache is not cache):
            raise ConfigError("a disk tier needs a host tier in front of it, over the same KVCache")
        self.cache = cache
        self.host = host
        self.disk = disk
        self.max_seq_len = max_seq_len
        self._write_ahead = 0 if host is None else int(host.num_blocks * WRITE_AHEAD_FRACTION)
        self._gpu_hits = 0
        self._host_hits = 0
        self._disk_hits = 0
        self._misses = 0
        self._no_room = 0

    def resolve(self, users: Iterable[UserKey]) -> dict[UserKey, CacheOutcome]:
        """Where each user's cache is right now (no LRU touch, no copies, no waiting)."""
        return {user: self._where(user) for user in users}

    def prefetch(self, users: Iterable[UserKey]) -> int:
        """Start reading the users that are only on disk; how many reads started."""
        disk = self.disk
        if disk is None:
            return 0
        return sum(disk.prefetch(u) for u in users if self._where(u) is DISK_HIT)

    def settle(self, users: Iterable[UserKey]) -> dict[UserKey, CacheOutcome]:
        """``resolve``, after waiting for the users' disk reads: a file that fails its
        checks is forgotten and its user answers MISS (the engine rebuilds it)."""
        outcomes = self.resolve(users)
        if self.disk is not None:
            for user, where in outcomes.items():
                if where is DISK_HIT and not self.disk.load(user):
                    outcomes[user] = MISS
        return outcomes

    def ensure_room(self, demands: Mapping[UserKey, int]) -> Admission | NoRoom:
        """Pin the batch and make room for ``demands[user]`` more tokens of every user."""
        pool, host, disk, bs = self.cache.pool, self.host, self.disk, self.cache.block_size
        for user, n in demands.items():
            if n < 0:
                raise CacheError(f"negative token count {n} for user {user!r}")
            window_blocks_to_drop(0, n, self.max_seq_len, bs)  # raises past max_seq_len
        outcomes = self.resolve(demands)
        for user, where in outcomes.items():
            if where is DISK_HIT and disk is not None and not disk.load(user):
                raise CacheError(
                    f"the disk copy of user {user!r} failed its checks: settle() first"
                )
        pool.pin(demands)
        trimmed = 0
        needed = 0
        skip: dict[UserKey, int] = {}  # disk hits: oldest blocks the window drops
        for user, n in demands.items():
            where = outcomes[user]
            if where is GPU_HIT:
                trimmed += pool.trim(user, self.max_seq_len, incoming=n)
                needed += pool.blocks_for(user, n)
            elif where is HOST_HIT:
                assert host is not None
                k = window_blocks_to_drop(host.length(user), n, self.max_seq_len, bs)
                if k:
                    self._release_disk_copy(user)  # the host blocks are about to change
                    trimmed += host.drop_oldest_blocks(user, k)
                needed += max(host.user_blocks(user), math.ceil((host.length(user) + n) / bs))
            elif where is DISK_HIT:
                assert disk is not None
                length = disk.length(user)
                k = skip[user] = window_blocks_to_drop(length, n, self.max_seq_len, bs)
                kept = max(0, length - k * bs)
                trimmed += length - kept
                needed += max(disk.user_blocks(user) - k, math.ceil((kept + n) / bs))
            else:
                needed += pool.blocks_for(None, n)
        if pool.plan_eviction(needed) is None:
            pool.unpin(demands)
            self._no_room += 1
            return NoRoom(needed=needed, free=pool.num_free)

        keep = {u for u, where in outcomes.items() if where is HOST_HIT}
        dropped: list[UserKey] = []

        def offload(user: UserKey, blocks: list[int], length: int) -> None:
            if host is None:
                dropped.append(user)
                return
            victims = host.plan_room(len(blocks), keep)
            if victims is None:  # the user alone is larger than the host tier can free
                dropped.append(user)
                return
            for victim in victims:
                self._spill(victim, dropped)
            dropped.extend(host.offload(user, blocks, length, keep=keep))

        evicted = pool.evict(needed, on_evict=offload)
        for user in keep:
            assert host is not None
            self._release_disk_copy(user)
            blocks = pool.restore(user, host.length(user))
            if isinstance(blocks, NoRoom):  # cannot happen: room was planned above
                raise CacheError(f"onload of user {user!r} found {blocks} after eviction")
            host.onload(user, blocks)
        for user, k in skip.items():
            assert disk is not None
            kept = max(0, disk.length(user) - k * bs)
            blocks = pool.restore(user, kept)
            if isinstance(blocks, NoRoom):
                raise CacheError(f"onload of user {user!r} found {blocks} after eviction")
            disk.onload(user, blocks, skip_blocks=k)
        for where in outcomes.values():
            if where is GPU_HIT:
                self._gpu_hits += 1
            elif where is HOST_HIT:
                self._host_hits += 1
            elif where is DISK_HIT:
                self._disk_hits += 1
            else:
                self._misses += 1
        for user in outcomes:
            if user in pool:
                pool.touch(user)
        self._write_ahead_tail()
        return Admission(outcomes, evicted, dropped, trimmed)

    def append(self, user: UserKey, n_tokens: int) -> Slots:
        """Slots for ``n_tokens`` new tokens; room must have been ensured for them."""
        slots = self.cache.pool.append(user, n_tokens)
        if isinstance(slots, NoRoom):
            raise CacheError(
                f"append of {n_tokens} tokens for user {user!r} found {slots}; "
                "call ensure_room with the step's token counts first"
            )
        return slots

    def unpin(self, users: Iterable[UserKey]) -> None:
        self.cache.pool.unpin(users)

    def drop(self, users: Sequence[UserKey]) -> None:
        """Forget users on every tier (partition revoked, model version changed)."""
        for user in users:
            if user in self.cache.pool:
                self.cache.pool.free(user)
            self._release_disk_copy(user)
            if self.host is not None:
                self.host.drop(user)

    def close(self) -> None:
        """Stop the disk tier's threads and delete its files."""
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> KVTiersStats:
        return KVTiersStats(
            gpu_hits=self._gpu_hits,
            host_hits=self._host_hits,
            misses=self._misses,
            no_room=self._no_room,
            pool=self.cache.pool.stats(),
            host=None if self.host is None else self.host.stats(),
            disk_hits=self._disk_hits,
            disk=None if self.disk is None else self.disk.stats(),
        )

    # ------------------------------------------------------------------ internals

    def _where(self, user: UserKey) -> CacheOutcome:
        if user in self.cache.pool:
            return GPU_HIT
        if self.host is not None and user in self.host:
            return HOST_HIT
        if self.disk is not None and user in self.disk:
            return DISK_HIT
        return MISS

    def _release_disk_copy(self, user: UserKey) -> None:
        """Before a host entry changes or leaves for the GPU: its file would be stale (and
        a running write of it must finish before the host blocks are reused)."""
        if self.disk is not None:
            self.disk.discard(user)

    def _spill(self, user: UserKey, dropped: list[UserKey]) -> None:
        """Host tier makes room: the user goes to disk if it can, else it is gone."""
        host = self.host
        assert host is not None
        kept = self.disk is not None and self.disk.store(user, host.snapshot(user))
        host.evict(user)
        if not kept:
            dropped.append(user)

    def _write_ahead_tail(self) -> None:
        """Write the host tier's oldest users to disk in the background."""
        host, disk = self.host, self.disk
        if host is None or disk is None:
            return
        disk.reap()
        covered = 0
        for user, blocks in host.lru_tail():
            if covered >= self._write_ahead or disk.writes_in_flight >= MAX_WRITES_IN_FLIGHT:
                break
            covered += blocks
            if user not in disk and not disk.write(user, host.snapshot(user)):
                break  # the disk is full of files in use: try again next step
