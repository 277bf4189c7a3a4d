"""Item embeddings: the full table in host memory, the hot rows on the device.

A catalogue of tens of millions of items does not fit next to the KV pool, but request
traffic is heavily skewed, so a fixed slot buffer of hot rows on the device, refreshed in
least-recently-used order, serves almost every lookup; the cold rows of one lookup are
gathered on the host and moved in ONE host→device copy. When the whole table fits the
budget it simply lives on the device and no cache bookkeeping runs.

Bookkeeping is NumPy on the host (``slot_of[V]``, ``item_of[S]``, ``last_used[S]``): the
item indices of a batch are built on the host anyway, so nothing here waits on the GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from streamrec.cache.stats import EmbeddingCacheStats
from streamrec.errors import CacheError, ConfigError


class EmbeddingCache:
    """``lookup(items[N]) -> rows[N, D]`` on the device, over a host ``table[V, D]``."""

    def __init__(
        self,
        table: torch.Tensor,
        device: torch.device | str,
        *,
        budget_bytes: int | None = None,
        num_slots: int | None = None,
    ) -> None:
        if table.dim() != 2 or table.device.type != "cpu":
            raise ConfigError(
                f"embedding table must be a 2-D host tensor, got shape {tuple(table.shape)} "
                f"on {table.device}"
            )
        if budget_bytes is not None and num_slots is not None:
            raise ConfigError(
                f"give budget_bytes={budget_bytes} or num_slots={num_slots}, not both"
            )
        self.device = torch.device(device)
        num_items, dim = table.shape
        row_bytes = dim * table.element_size()
        if budget_bytes is not None:
            num_slots = budget_bytes // row_bytes
        slots = num_items if num_slots is None else min(int(num_slots), num_items)
        if slots <= 0:
            raise ConfigError(
                f"embedding cache holds no row: num_slots={num_slots} budget={budget_bytes} "
                f"row_bytes={row_bytes}"
            )
        self.num_items, self.dim, self.num_slots = num_items, dim, slots
        self.fully_resident = slots == num_items
        on_cuda = self.device.type == "cuda"
        self._hits = self._misses = self._evictions = self._bytes_copied = 0
        self._clock = 0
        self._copy_done: torch.cuda.Event | None = None
        if self.fully_resident:
            self.rows = table.to(self.device)  # [V, D]
            self._host = table
            self._staging = table[:0]
            self._bytes_copied = table.nbytes
            return
        self._host = table.pin_memory() if on_cuda else table  # [V, D]
        self.rows = torch.zeros((slots, dim), dtype=table.dtype, device=self.device)  # [S, D]
        self._staging = torch.empty((slots, dim), dtype=table.dtype, pin_memory=on_cuda)
        self._slot_of = np.full(num_items, -1, dtype=np.int64)  # item -> slot
        self._item_of = np.full(slots, -1, dtype=np.int64)  # slot -> item
        self._last_used = np.full(slots, -1, dtype=np.int64)  # slot -> clock of last use

    def lookup(self, items: torch.Tensor) -> torch.Tensor:
        """Rows of ``items[N]`` (int64 indices) as ``[N, D]`` on the device."""
        flat = items.reshape(-1)
        if self.fully_resident:
            self._hits += flat.numel()  # every row is a hit; counting distinct would sync
            return self.rows.index_select(0, flat.to(self.device)).reshape(*items.shape, self.dim)
        idx = flat.cpu().numpy().astype(np.int64, copy=False)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_items):
            bad = idx[(idx < 0) | (idx >= self.num_items)][0]
            raise CacheError(f"item index {bad} outside the table of {self.num_items} rows")
        uniq, inverse = np.unique(idx, return_inverse=True)
        if uniq.size > self.num_slots:
            raise CacheError(
                f"lookup of {uniq.size} distinct items exceeds the {self.num_slots} device slots"
            )
        self._clock += 1
        slots = self._slot_of[uniq]  # [U]
        hit = slots >= 0
        self._last_used[slots[hit]] = self._clock
        missing = uniq[~hit]
        self._hits += int(hit.sum())
        self._misses += int(missing.size)
        if missing.size:
            slots[~hit] = self._fill(missing)
        index = torch.from_numpy(slots[inverse]).to(self.device)  # [N]
        return self.rows.index_select(0, index).reshape(*items.shape, self.dim)

    def _fill(self, missing: np.ndarray) -> np.ndarray:
        """Load ``missing`` items into the least recently used slots; their slots."""
        m = missing.size
        # Slots used in this lookup carry the current clock, so they are never chosen.
        if m < self.num_slots:
            victims = np.sort(np.argpartition(self._last_used, m - 1)[:m])
        else:
            victims = np.arange(self.num_slots)
        old = self._item_of[victims]
        evicted = old[old >= 0]
        self._evictions += int(evicted.size)
        self._slot_of[evicted] = -1
        self._slot_of[missing] = victims
        self._item_of[victims] = missing
        self._last_used[victims] = self._clock
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous copy still reads the staging rows
        staging = self._staging[:m]
        torch.index_select(self._host, 0, torch.from_numpy(missing), out=staging)
        cold = staging.to(self.device, non_blocking=True)  # ONE host -> device copy
        self.rows.index_copy_(0, torch.from_numpy(victims).to(self.device), cold)
        if self.device.type == "cuda":
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()
        self._bytes_copied += staging.nbytes
        return victims

    def stats(self) -> EmbeddingCacheStats:
        resident = self.num_items if self.fully_resident else int((self._item_of >= 0).sum())
        return EmbeddingCacheStats(
            num_items=self.num_items,
            num_slots=self.num_slots,
            resident=resident,
            fully_resident=self.fully_resident,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            bytes_copied=self._bytes_copied,
            device_bytes=self.rows.nbytes,
        )
