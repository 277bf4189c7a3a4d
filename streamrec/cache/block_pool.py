"""Block accounting of the paged KV cache: who owns which block, in which order.

The pool is metadata only (plain Python and NumPy, no tensors), so every decision it
makes is cheap, deterministic and testable on CPU; ``KVCache`` owns the tensors the
block ids index. Running out of blocks is an ordinary outcome of a busy GPU, so it is a
returned ``NoRoom`` value the engine acts on (evict, defer, split the batch), never an
exception; ``CacheError`` is reserved for misuse such as an unknown user.

Determinism: free blocks are handed out from the head of a FIFO queue (ascending ids at
start) and returned to its tail, and users are evicted in least-recently-used order, so
a scripted sequence of calls always yields the same block ids.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from streamrec.cache.stats import BlockPoolStats
from streamrec.errors import CacheError

UserKey = str  # the Kafka record key, as everywhere in streamrec
# Flat slot ids of new tokens: block_id * block_size + offset_in_block.
Slots = npt.NDArray[np.int64]
# Called with (user, block_ids, length) just before an evicted user's blocks are freed.
EvictHook = Callable[[UserKey, list[int], int], None]


@dataclass(frozen=True)
class NoRoom:
    """Not enough free blocks: nothing was changed. ``needed`` vs ``free`` blocks."""

    needed: int
    free: int

    @property
    def short(self) -> int:
        return self.needed - self.free


def window_blocks_to_drop(length: int, n_new: int, max_len: int, block_size: int) -> int:
    """How many oldest whole blocks must go so ``length + n_new <= max_len`` afterwards."""
    if n_new > max_len:
        raise CacheError(f"{n_new} new tokens exceed max_seq_len={max_len}; prefill instead")
    excess = length + n_new - max_len
    if excess <= 0:
        return 0
    return min(math.ceil(excess / block_size), math.ceil(length / block_size))


class BlockPool:
    """Per-user block tables over ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise CacheError(
                f"BlockPool needs num_blocks > 0 and block_size > 0, "
                f"got num_blocks={num_blocks} block_size={block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[UserKey, list[int]] = {}
        self._lens: dict[UserKey, int] = {}
        self._lru: OrderedDict[UserKey, None] = OrderedDict()  # oldest first
        self._pins: dict[UserKey, int] = {}
        self._tokens = 0
        self._allocs = 0
        self._frees = 0
        self._evictions = 0
        self._evicted_blocks = 0
        self._trimmed_blocks = 0
        self._no_room = 0

    # -- queries -----------------------------------------------------------------------

    def __contains__(self, user: object) -> bool:
        return user in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def block_table(self, user: UserKey) -> list[int]:
        """The user's block ids, oldest first (a copy)."""
        return list(self._table(user))

    def length(self, user: UserKey) -> int:
        self._table(user)
        return self._lens[user]

    def lru_order(self) -> list[UserKey]:
        """Users from least to most recently used."""
        return list(self._lru)

    def is_pinned(self, user: UserKey) -> bool:
        return user in self._pins

    def blocks_for(self, user: UserKey | None, n_tokens: int) -> int:
        """Fresh blocks ``append(user, n_tokens)`` would take (``None``: a new user)."""
        if n_tokens < 0:
            raise CacheError(f"n_tokens must be >= 0, got {n_tokens} for user {user!r}")
        if user is None or user not in self._tables:
            return math.ceil(n_tokens / self.block_size)
        capacity = len(self._tables[user]) * self.block_size
        return max(0, math.ceil((self._lens[user] + n_tokens - capacity) / self.block_size))

    # -- allocation --------------------------------------------------------------------

    def append(self, user: UserKey, n_tokens: int) -> Slots | NoRoom:
        """Room for ``n_tokens`` more tokens of ``user``: their slots, or NoRoom (no change).

        A user unknown to the pool is registered (with ``n_tokens == 0`` it gets an empty
        table). The user becomes the most recently used.
        """
        needed = self.blocks_for(user, n_tokens)
        if needed > len(self._free):
            self._no_room += 1
            return NoRoom(needed=needed, free=len(self._free))
        table = self._tables.setdefault(user, [])
        start = self._lens.setdefault(user, 0)
        table.extend(self._free.popleft() for _ in range(needed))
        self._allocs += needed
        self._lens[user] = start + n_tokens
        self._tokens += n_tokens
        self.touch(user)
        bs = self.block_size
        if n_tokens == 1:  # the common step: one new event
            return np.array([table[start // bs] * bs + start % bs], dtype=np.int64)
        first = start // bs  # only the blocks the new tokens land in, not the whole table
        positions = np.arange(start, start + n_tokens, dtype=np.int64)
        blocks = np.asarray(table[first : (start + n_tokens - 1) // bs + 1], dtype=np.int64)
        return blocks[positions // bs - first] * bs + positions % bs

    def restore(self, user: UserKey, length: int) -> list[int] | NoRoom:
        """Fresh blocks for a user coming back from the host tier with ``length`` tokens."""
        if user in self._tables:
            raise CacheError(f"user {user!r} is already in the GPU pool")
        result = self.append(user, length)
        if isinstance(result, NoRoom):
            return result
        return list(self._tables[user])

    def touch(self, user: UserKey) -> None:
        """Mark ``user`` most recently used (a lookup or an append)."""
        self._table(user)
        self._lru[user] = None
        self._lru.move_to_end(user)

    # -- release -----------------------------------------------------------------------

    def free(self, user: UserKey) -> int:
        """Return all of ``user``'s blocks to the free queue; the number freed."""
        if user in self._pins:
            raise CacheError(f"user {user!r} is pinned by the running batch; unpin first")
        return self._release(user)

    def evict(self, n_blocks: int, on_evict: EvictHook | None = None) -> list[UserKey]:
        """Evict unpinned users, least recently used first, until ``n_blocks`` are free.

        All or nothing: when even evicting every unpinned user would leave fewer than
        ``n_blocks`` free, nobody is evicted and ``[]`` is returned. ``on_evict`` sees each
        victim's blocks before they are freed (the host tier copies them out there).
        """
        victims = self.plan_eviction(n_blocks)
        if victims is None:
            return []
        for user in victims:
            blocks = self._tables[user]
            if on_evict is not None:
                on_evict(user, list(blocks), self._lens[user])
            self._evictions += 1
            self._evicted_blocks += len(blocks)
            self._release(user)
        return victims

    def plan_eviction(self, n_blocks: int) -> list[UserKey] | None:
        """Victims ``evict(n_blocks)`` would pick ([] if already free), or None if impossible."""
        if n_blocks < 0:
            raise CacheError(f"n_blocks must be >= 0, got {n_blocks}")
        free = len(self._free)
        victims: list[UserKey] = []
        for user in self._lru:
            if free >= n_blocks:
                break
            if user in self._pins or not self._tables[user]:
                continue
            victims.append(user)
            free += len(self._tables[user])
        return victims if free >= n_blocks else None

    def drop_oldest_blocks(self, user: UserKey, n: int) -> int:
        """Drop the user's ``n`` oldest blocks (sliding window); tokens removed.

        Positions are re-based: the first kept token becomes position 0. Relative
        positions between kept tokens do not change, which is all the model's attention
        bias sees, so the cached keys and values stay valid.
        """
        table = self._table(user)
        if not 0 <= n <= len(table):
            raise CacheError(f"cannot drop {n} of the {len(table)} blocks of user {user!r}")
        removed = min(self._lens[user], n * self.block_size)
        self._free.extend(table[:n])
        del table[:n]
        self._lens[user] -= removed
        self._tokens -= removed
        self._frees += n
        self._trimmed_blocks += n
        return removed

    def trim(self, user: UserKey, max_len: int, incoming: int = 0) -> int:
        """Drop oldest whole blocks so ``length + incoming <= max_len``; tokens removed."""
        n = window_blocks_to_drop(self.length(user), incoming, max_len, self.block_size)
        return self.drop_oldest_blocks(user, n) if n else 0

    # -- pins --------------------------------------------------------------------------

    def pin(self, users: Iterable[UserKey]) -> None:
        """Protect users of the running batch from eviction (refcounted; may be absent)."""
        for user in users:
            self._pins[user] = self._pins.get(user, 0) + 1

    def unpin(self, users: Iterable[UserKey]) -> None:
        for user in users:
            count = self._pins.get(user)
            if count is None:
                raise CacheError(f"unpin of user {user!r}, which is not pinned")
            if count == 1:
                del self._pins[user]
            else:
                self._pins[user] = count - 1

    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            blocks_used=self.num_blocks - len(self._free),
            blocks_free=len(self._free),
            users=len(self._tables),
            pinned_users=len(self._pins),
            tokens=self._tokens,
            allocs=self._allocs,
            frees=self._frees,
            evictions=self._evictions,
            evicted_blocks=self._evicted_blocks,
            trimmed_blocks=self._trimmed_blocks,
            no_room=self._no_room,
        )

    # -- internals ---------------------------------------------------------------------

    def _table(self, user: UserKey) -> list[int]:
        table = self._tables.get(user)
        if table is None:
            raise CacheError(f"user {user!r} is not in the block pool")
        return table

    def _release(self, user: UserKey) -> int:
        table = self._table(user)
        n = len(table)
        self._free.extend(table)
        self._frees += n
        self._tokens -= self._lens.pop(user)
        del self._tables[user]
        del self._lru[user]
        return n
