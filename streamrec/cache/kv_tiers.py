"""What the engine asks of the KV cache per step: GPU pool + host tier behind one facade.

An engine step over a batch of users goes:

1. ``resolve(users)``: where each user's cache is (GPU / host / nowhere); no side effects.
   The engine reads the history of the misses from the history store.
2. ``ensure_room({user: tokens to add})``: tokens to add are the new tokens of a hit and
   the whole (window-capped) history of a miss. Pins the batch, applies the sliding
   window, evicts unpinned users in LRU order to the host tier when short, and onloads
   the batch's host hits into fresh GPU blocks. Returns ``NoRoom`` (batch unpinned,
   nothing evicted) when even that is not enough, so the engine can split the batch.
3. ``append(user, n)`` → slots; ``cache.write(slots, k, v, ts)`` after ``prefill`` /
   ``extend``; ``cache.batch_tables(users)`` feeds ``extend`` and ``rank``.
4. ``unpin(users)`` when the step is done.

Window trims happen in step 2 even when it then answers NoRoom: they only drop tokens the
user's next append would drop anyway, so a retried step sees the same state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from streamrec.cache.block_pool import NoRoom, Slots, UserKey, window_blocks_to_drop
from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache
from streamrec.cache.stats import KVTiersStats
from streamrec.errors import CacheError, ConfigError
from streamrec.schemas.records import CacheOutcome  # HOST_HIT here: onloaded by ensure_room


@dataclass(frozen=True)
class Admission:
    """A successful ``ensure_room``: every user's outcome and what was displaced for it."""

    outcomes: dict[UserKey, CacheOutcome]
    evicted: list[UserKey] = field(default_factory=list)  # moved GPU -> host, LRU order
    dropped: list[UserKey] = field(default_factory=list)  # gone from every tier
    trimmed_tokens: int = 0  # dropped by the sliding window


class KVTiers:
    """GPU pool plus optional host tier; the cache API of one engine."""

    def __init__(self, cache: KVCache, host: HostTier | None, max_seq_len: int) -> None:
        if max_seq_len <= 0:
            raise ConfigError(f"max_seq_len must be > 0, got {max_seq_len}")
        if host is not None and host.cache is not cache:
            raise ConfigError("the host tier must be built over the same KVCache")
        self.cache = cache
        self.host = host
        self.max_seq_len = max_seq_len
        self._gpu_hits = 0
        self._host_hits = 0
        self._misses = 0
        self._no_room = 0

    def resolve(self, users: Iterable[UserKey]) -> dict[UserKey, CacheOutcome]:
        """Where each user's cache is right now (no LRU touch, no copies)."""
        return {user: self._where(user) for user in users}

    def ensure_room(self, demands: Mapping[UserKey, int]) -> Admission | NoRoom:
        """Pin the batch and make room for ``demands[user]`` more tokens of every user."""
        pool, host, bs = self.cache.pool, self.host, self.cache.block_size
        for user, n in demands.items():
            if n < 0:
                raise CacheError(f"negative token count {n} for user {user!r}")
            window_blocks_to_drop(0, n, self.max_seq_len, bs)  # raises past max_seq_len
        outcomes = self.resolve(demands)
        pool.pin(demands)
        trimmed = 0
        needed = 0
        for user, n in demands.items():
            where = outcomes[user]
            if where is CacheOutcome.GPU_HIT:
                trimmed += pool.trim(user, self.max_seq_len, incoming=n)
                needed += pool.blocks_for(user, n)
            elif where is CacheOutcome.HOST_HIT:
                assert host is not None
                k = window_blocks_to_drop(host.length(user), n, self.max_seq_len, bs)
                trimmed += host.drop_oldest_blocks(user, k)
                needed += max(host.user_blocks(user), math.ceil((host.length(user) + n) / bs))
            else:
                needed += pool.blocks_for(None, n)
        if pool.plan_eviction(needed) is None:
            pool.unpin(demands)
            self._no_room += 1
            return NoRoom(needed=needed, free=pool.num_free)

        keep = {u for u, where in outcomes.items() if where is CacheOutcome.HOST_HIT}
        dropped: list[UserKey] = []

        def offload(user: UserKey, blocks: list[int], length: int) -> None:
            if host is None:
                dropped.append(user)
            else:
                dropped.extend(host.offload(user, blocks, length, keep=keep))

        evicted = pool.evict(needed, on_evict=offload)
        for user in keep:
            assert host is not None
            blocks = pool.restore(user, host.length(user))
            if isinstance(blocks, NoRoom):  # cannot happen: room was planned above
                raise CacheError(f"onload of user {user!r} found {blocks} after eviction")
            host.onload(user, blocks)
        for where in outcomes.values():
            if where is CacheOutcome.GPU_HIT:
                self._gpu_hits += 1
            elif where is CacheOutcome.HOST_HIT:
                self._host_hits += 1
            else:
                self._misses += 1
        for user in outcomes:
            if user in pool:
                pool.touch(user)
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
            if self.host is not None:
                self.host.drop(user)

    def stats(self) -> KVTiersStats:
        return KVTiersStats(
            gpu_hits=self._gpu_hits,
            host_hits=self._host_hits,
            misses=self._misses,
            no_room=self._no_room,
            pool=self.cache.pool.stats(),
            host=None if self.host is None else self.host.stats(),
        )

    def _where(self, user: UserKey) -> CacheOutcome:
        if user in self.cache.pool:
            return CacheOutcome.GPU_HIT
        if self.host is not None and user in self.host:
            return CacheOutcome.HOST_HIT
        return CacheOutcome.MISS
