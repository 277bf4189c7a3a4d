"""Host-memory tier behind the GPU KV pool: evicted users wait here instead of vanishing.

Re-encoding a 2,000-token history costs a full prefill; copying its blocks back over
PCIe/NVLink-C2C costs a fraction of that, so the GPU pool spills its least recently
used users here and only a full host tier drops a user for good (its next event is then
a prefill from the history store).

Layout and streams. The host buffer is block-major ``kv[NBh, Lyr, 2, BS, H, d]`` so a
run of consecutive host blocks is one contiguous DMA. Offload gathers the victim's GPU
blocks into a staging tensor *on the caller's (engine) stream*, so the GPU blocks may be
reused by any later work on that stream at once; the device→host copy of the staging
tensor then runs on a side stream (``record_stream`` keeps the staging memory alive until
it is done) and records an event. Onload waits for that event on the engine stream before
copying host→device, and host blocks are only rewritten by later offloads on the side
stream, which first waits for the engine stream, so no copy can read half-written bytes.
On the CPU the same code runs with plain memory and no streams. An FP8 pool is mirrored
byte for byte (codes, no scales: those belong to the model), so a host block costs what a
GPU block does: half of a bf16 one.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import torch

from streamrec.cache.block_pool import UserKey
from streamrec.cache.kv_cache import KVCache, raw
from streamrec.cache.stats import HostTierStats
from streamrec.errors import CacheError, ConfigError


@dataclass
class _HostEntry:
    blocks: list[int]  # host block ids, oldest first
    length: int
    ready: torch.cuda.Event | None  # set on CUDA: the device->host copy has finished


@dataclass(frozen=True)
class HostCopy:
    """Where one user's host copy lives: the tier's tensors and the user's block ids.

    Valid until the user leaves the host tier; the disk tier writes files from it.
    """

    kv: torch.Tensor  # the tier's whole kv[NBh, Lyr, 2, BS, H, d]
    ts: torch.Tensor  # the tier's whole ts[NBh, BS]
    blocks: tuple[int, ...]
    length: int
    ready: torch.cuda.Event | None  # wait on it before reading (the device->host copy)


def block_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``(index in ids, first id, count)`` for each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((i, block, 1))
    return runs


class HostTier:
    """Block-granular host copy of evicted users, with its own LRU and capacity."""

    def __init__(self, cache: KVCache, num_blocks: int, *, pin_memory: bool | None = None) -> None:
        if num_blocks <= 0:
            raise ConfigError(f"HostTier needs num_blocks > 0, got {num_blocks}")
        cfg = cache.config
        self.cache = cache
        self.num_blocks = num_blocks
        on_cuda = cache.device.type == "cuda"
        pin = on_cuda if pin_memory is None else pin_memory
        block_shape = (cfg.num_layers, 2, cfg.block_size, cfg.num_heads, cfg.head_dim)
        self.kv = torch.empty((num_blocks, *block_shape), dtype=cfg.dtype, pin_memory=pin)
        # [NBh, Lyr, 2, BS, H, d]
        self.ts = torch.empty((num_blocks, cfg.block_size), dtype=torch.int64, pin_memory=pin)
        # [NBh, BS]
        self._stream = torch.cuda.Stream(cache.device) if on_cuda else None
        self._free: deque[int] = deque(range(num_blocks))  # head handed out first
        self._entries: OrderedDict[UserKey, _HostEntry] = OrderedDict()  # oldest first
        self._offloads = 0
        self._onloads = 0
        self._drops = 0
        self._bytes_out = 0
        self._bytes_in = 0

    @classmethod
    def from_budget(
        cls, cache: KVCache, budget_bytes: int, *, pin_memory: bool | None = None
    ) -> HostTier:
        n = budget_bytes // cache.config.bytes_per_block
        if n <= 0:
            raise ConfigError(
                f"host budget of {budget_bytes} bytes holds no block of "
                f"{cache.config.bytes_per_block} bytes"
            )
        return cls(cache, int(n), pin_memory=pin_memory)

    def __contains__(self, user: object) -> bool:
        return user in self._entries

    @property
    def pinned(self) -> bool:
        return bool(self.kv.is_pinned())

    def length(self, user: UserKey) -> int:
        return self._entry(user).length

    def user_blocks(self, user: UserKey) -> int:
        return len(self._entry(user).blocks)

    def lru_order(self) -> list[UserKey]:
        return list(self._entries)

    def offload(
        self,
        user: UserKey,
        gpu_blocks: list[int],
        length: int,
        keep: Collection[UserKey] = (),
    ) -> list[UserKey]:
        """Copy a user's GPU blocks to the host; returns users dropped for lack of room.

        Room is made by dropping host users in LRU order, never one in ``keep`` (users
        about to be onloaded). The returned list contains ``user`` itself when it cannot
        fit even so; then nothing else is dropped.
        """
        if user in self._entries:
            self.drop(user)
        n = len(gpu_blocks)
        dropped = self.plan_room(n, keep)
        if dropped is None:
            self._drops += 1
            return [user]
        for victim in dropped:
            self.evict(victim)
        host_blocks = [self._free.popleft() for _ in range(n)]
        ready = self._copy_out(gpu_blocks, host_blocks) if n else None
        self._entries[user] = _HostEntry(host_blocks, length, ready)
        self._offloads += 1
        self._bytes_out += n * self.cache.config.bytes_per_block
        return dropped

    def plan_room(self, n_blocks: int, keep: Collection[UserKey] = ()) -> list[UserKey] | None:
        """Users to evict, oldest first, so ``n_blocks`` are free; None if impossible."""
        free = len(self._free)
        victims: list[UserKey] = []
        for user, entry in self._entries.items():
            if free >= n_blocks:
                break
            if user not in keep:
                victims.append(user)
                free += len(entry.blocks)
        return victims if free >= n_blocks else None

    def evict(self, user: UserKey) -> None:
        """Leave the tier to make room (counted in ``drops``; the disk tier may keep it)."""
        self._entry(user)
        self.drop(user)
        self._drops += 1

    def snapshot(self, user: UserKey) -> HostCopy:
        entry = self._entry(user)
        return HostCopy(self.kv, self.ts, tuple(entry.blocks), entry.length, entry.ready)

    def lru_tail(self) -> Iterator[tuple[UserKey, int]]:
        """``(user, blocks)`` from the least recently offloaded on (lazily: stop early)."""
        for user, entry in self._entries.items():
            yield user, len(entry.blocks)

    def onload(self, user: UserKey, gpu_blocks: list[int]) -> int:
        """Copy a user's blocks back into ``gpu_blocks`` and forget it here; its length."""
        entry = self._entry(user)
        if len(gpu_blocks) != len(entry.blocks):
            raise CacheError(
                f"onload of user {user!r} needs {len(entry.blocks)} GPU blocks, "
                f"got {len(gpu_blocks)}"
            )
        if entry.blocks:
            self._copy_in(entry, gpu_blocks)
        del self._entries[user]
        self._release(entry.blocks)
        self._onloads += 1
        self._bytes_in += len(gpu_blocks) * self.cache.config.bytes_per_block
        return entry.length

    def drop_oldest_blocks(self, user: UserKey, n: int) -> int:
        """Sliding window on the host copy (same re-basing as ``BlockPool``); tokens removed."""
        entry = self._entry(user)
        if not 0 <= n <= len(entry.blocks):
            raise CacheError(f"cannot drop {n} of the {len(entry.blocks)} host blocks of {user!r}")
        removed = min(entry.length, n * self.cache.block_size)
        self._release(entry.blocks[:n])
        del entry.blocks[:n]
        entry.length -= removed
        return removed

    def drop(self, user: UserKey) -> None:
        """Forget a user (rebalance, or room for others); its blocks become free."""
        entry = self._entries.pop(user, None)
        if entry is not None:
            self._release(entry.blocks)

    def synchronize(self) -> None:
        """Wait until every offload copy has landed (benchmarks, shutdown)."""
        if self._stream is not None:
            self._stream.synchronize()

    def stats(self) -> HostTierStats:
        return HostTierStats(
            num_blocks=self.num_blocks,
            blocks_used=self.num_blocks - len(self._free),
            users=len(self._entries),
            offloads=self._offloads,
            onloads=self._onloads,
            drops=self._drops,
            bytes_offloaded=self._bytes_out,
            bytes_onloaded=self._bytes_in,
        )

    # -- copies ------------------------------------------------------------------------

    def _copy_out(self, gpu_blocks: list[int], host_blocks: list[int]) -> torch.cuda.Event | None:
        cache = self.cache
        ids = torch.tensor(gpu_blocks, dtype=torch.int64, device=cache.device)
        kv = raw(cache.kv).movedim(2, 0)[ids]  # [n, Lyr, 2, BS, H, d] on the engine stream
        ts = cache.ts[ids]  # [n, BS]
        if self._stream is None:
            self._scatter_runs(host_blocks, kv, ts)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(self._stream):
            self._scatter_runs(host_blocks, kv, ts)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        kv.record_stream(self._stream)
        ts.record_stream(self._stream)
        return ready

    def _scatter_runs(self, host_blocks: list[int], kv: torch.Tensor, ts: torch.Tensor) -> None:
        for i, first, count in block_runs(host_blocks):
            raw(self.kv)[first : first + count].copy_(kv[i : i + count], non_blocking=True)
            self.ts[first : first + count].copy_(ts[i : i + count], non_blocking=True)

    def _copy_in(self, entry: _HostEntry, gpu_blocks: list[int]) -> None:
        cache = self.cache
        if entry.ready is not None:
            torch.cuda.current_stream(cache.device).wait_event(entry.ready)
        n = len(entry.blocks)
        host = raw(self.kv)
        kv = torch.empty((n, *host.shape[1:]), dtype=host.dtype, device=cache.device)
        ts = torch.empty((n, cache.block_size), dtype=torch.int64, device=cache.device)
        for i, first, count in block_runs(entry.blocks):
            kv[i : i + count].copy_(host[first : first + count], non_blocking=True)
            ts[i : i + count].copy_(self.ts[first : first + count], non_blocking=True)
        ids = torch.tensor(gpu_blocks, dtype=torch.int64, device=cache.device)
        raw(cache.kv).index_copy_(2, ids, kv.movedim(0, 2))  # kv[Lyr, 2, NB, BS, H, d]
        cache.ts.index_copy_(0, ids, ts)

    def _release(self, blocks: list[int]) -> None:
        # Freed blocks go behind the ones still free, keeping hand-out order deterministic.
        self._free.extend(blocks)

    def _entry(self, user: UserKey) -> _HostEntry:
        entry = self._entries.get(user)
        if entry is None:
            raise CacheError(f"user {user!r} is not in the host tier")
        return entry
