"""Item embeddings: the full table in host memory, the hot rows in device slots.

A catalogue of tens of millions of items does not fit next to the KV pool, but request
traffic is heavily skewed, so a fixed buffer of hot rows on the device serves almost every
lookup. The serving path translates item rows into slot ids once per model call
(``slots``) and the model reads its input embeddings from ``rows`` (see
``HSTU.use_item_rows``); the rows of the misses are gathered on the host into a pinned
staging buffer and moved in ONE host→device copy per call. When the whole table fits the
budget it simply lives on the device, ``slots`` is the identity and no bookkeeping runs.

The host table need not be pinned (it may be a memory map of the model directory): only
the staging buffers are, so a 20 GB table costs no pinned memory. Two staging buffers are
used in turn, so the host only waits for the copy issued two calls ago.

Eviction is CLOCK (second chance) over NumPy arrays: a hit sets the slot's reference bit,
the hand sweeps a window of slots per fill and takes those whose bit is clear and that the
current call does not use. That is O(rows of the call) per call; an exact LRU would need an
O(slots) selection per fill (~10 ms for 2M slots). All lookups and all model calls that
read ``rows`` must run on one CUDA stream: a later call may overwrite a slot that an earlier
call's kernels read, and only stream order makes that safe.

Rows can be pinned (``pin``): the sweep never takes their slots. The item catalogue pins
the retrievable set's members, so ranking candidates (which retrieval draws from that set)
never miss and their slots are known on the device without asking the host.
"""

from __future__ import annotations

import numpy as np
import torch

from streamrec.cache.stats import EmbeddingCacheStats
from streamrec.errors import CacheError, ConfigError

DEFAULT_STAGING_ROWS = 65_536  # per staging buffer; larger misses are copied in chunks


class EmbeddingCache:
    """``slots(items) -> slot ids`` into ``rows[S, D]`` on the device, over ``table[V, D]``."""

    def __init__(
        self,
        table: torch.Tensor,
        device: torch.device | str,
        *,
        budget_bytes: int | None = None,
        num_slots: int | None = None,
        staging_rows: int = DEFAULT_STAGING_ROWS,
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
        if staging_rows <= 0:
            raise ConfigError(f"staging_rows={staging_rows} must be > 0")
        self.device = torch.device(device)
        num_items, dim = table.shape
        self.row_bytes = dim * table.element_size()
        if budget_bytes is not None:
            num_slots = budget_bytes // self.row_bytes
        slots = num_items if num_slots is None else min(int(num_slots), num_items)
        if slots <= 0:
            raise ConfigError(
                f"embedding cache holds no row: num_slots={num_slots} budget={budget_bytes} "
                f"row_bytes={self.row_bytes}"
            )
        self.num_items, self.dim, self.num_slots = num_items, dim, slots
        self.fully_resident = slots == num_items
        self._lookups = self._misses = self._evictions = self._bytes_copied = self._copies = 0
        self._clock = 0
        self._host = table.contiguous()  # [V, D]; pageable or memory-mapped is fine
        if self.fully_resident:
            self.rows = table.to(self.device)  # [V, D]
            self.device = self.rows.device  # with its index ("cuda" -> "cuda:0")
            self._bytes_copied = table.nbytes
            return
        on_cuda = self.device.type == "cuda"
        self.rows = torch.zeros((slots, dim), dtype=table.dtype, device=self.device)  # [S, D]
        self.device = self.rows.device  # with its index ("cuda" -> "cuda:0")
        rows = min(staging_rows, slots)
        self._staging = [
            torch.empty((rows, dim), dtype=table.dtype, pin_memory=on_cuda) for _ in range(2)
        ]  # 2 x [R, D]
        self._copy_done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._slot_of = np.full(num_items, -1, dtype=np.int32)  # item -> slot
        self._item_of = np.full(slots, -1, dtype=np.int64)  # slot -> item
        self._ref = np.zeros(slots, dtype=bool)  # CLOCK reference bit
        self._stamp = np.full(slots, -1, dtype=np.int64)  # clock of the call that last used it
        self._pinned = np.zeros(slots, dtype=bool)  # never evicted (``pin``)
        self._hand = 0
        self._resident = 0
        if on_cuda:  # the zero fill must land before another stream's first copy
            torch.cuda.current_stream(self.device).synchronize()

    # ------------------------------------------------------------------ lookups

    def slots(self, items: np.ndarray) -> np.ndarray:
        """Slot ids (int64, ``items``' shape) of item rows; cold rows are copied in first."""
        idx = np.asarray(items, dtype=np.int64)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.num_items):
            bad = idx[(idx < 0) | (idx >= self.num_items)].flat[0]
            raise CacheError(f"item index {bad} outside the table of {self.num_items} rows")
        self._lookups += idx.size
        if self.fully_resident:
            return idx
        flat = idx.reshape(-1)
        self._clock += 1
        slots = self._slot_of[flat].astype(np.int64)  # [N]
        hit = slots >= 0
        used = slots[hit]
        self._ref[used] = True
        self._stamp[used] = self._clock
        if not hit.all():
            missing = np.unique(flat[~hit])
            self._fill(missing)
            slots[~hit] = self._slot_of[flat[~hit]]
        return slots.reshape(idx.shape)

    def pin(self, items: np.ndarray) -> np.ndarray:
        """Load ``items`` (distinct rows) and keep them resident until ``unpin``; returns
        their slots. A table that lives on the device has nothing to pin (identity)."""
        idx = np.asarray(items, dtype=np.int64).reshape(-1)
        if self.fully_resident:
            return self.slots(idx)
        free = self.num_slots - int(np.count_nonzero(self._pinned))
        if idx.size > free:
            raise CacheError(
                f"cannot pin {idx.size} rows: {free} of the {self.num_slots} embedding slots "
                "are not pinned"
            )
        slots = self.slots(idx)
        self._pinned[slots] = True
        return slots

    def count_hits(self, n: int) -> None:
        """Account ``n`` lookups served from pinned slots without ``slots`` (on the device)."""
        self._lookups += n

    def unpin(self, items: np.ndarray) -> None:
        """Let the sweep take ``items``' slots again (rows not resident are ignored)."""
        if self.fully_resident:
            return
        slots = self._slot_of[np.asarray(items, dtype=np.int64).reshape(-1)]
        self._pinned[slots[slots >= 0]] = False

    def lookup(self, items: torch.Tensor) -> torch.Tensor:
        """Rows of ``items[...]`` (int64 item indices) as ``[..., D]`` on the device."""
        slots = self.slots(items.cpu().numpy())
        index = torch.from_numpy(np.ascontiguousarray(slots).reshape(-1)).to(self.device)
        return self.rows.index_select(0, index).reshape(*items.shape, self.dim)

    # ------------------------------------------------------------------ fills

    def _fill(self, missing: np.ndarray) -> None:
        """Load ``missing`` (distinct) items into victim slots chosen by the CLOCK hand."""
        victims = self._victims(missing.size)
        old = self._item_of[victims]
        evicted = old[old >= 0]
        self._evictions += int(evicted.size)
        self._resident += int(missing.size - evicted.size)
        self._slot_of[evicted] = -1
        self._slot_of[missing] = victims
        self._item_of[victims] = missing
        self._ref[victims] = True
        self._stamp[victims] = self._clock
        self._misses += int(missing.size)
        step = self._staging[0].shape[0]
        for lo in range(0, missing.size, step):
            self._copy(missing[lo : lo + step], victims[lo : lo + step])

    def _victims(self, m: int) -> np.ndarray:
        """``m`` slots whose reference bit is clear and that this call does not use."""
        size = self.num_slots
        taken: list[np.ndarray] = []
        swept = 0
        while m > 0:
            if swept > 2 * size:
                pinned = int(np.count_nonzero(self._pinned))
                raise CacheError(
                    f"one call needs {m} more embedding slots than the {size - pinned} it may "
                    f"evict ({pinned} of {size} pinned): raise cache.embedding_cache_rows "
                    "above the rows of the largest model call (plus cache.retrievable_items "
                    "when the retrievable set is pinned)"
                )
            width = min(size, max(2 * m, 1024))
            window = (self._hand + np.arange(width)) % size
            free = ~self._ref[window] & (self._stamp[window] != self._clock)
            free &= ~self._pinned[window]
            picked = np.flatnonzero(free)[:m]
            end = int(picked[-1]) + 1 if picked.size == m else width
            self._ref[window[:end]] = False  # second chance spent for every slot swept
            taken.append(window[picked])
            self._stamp[window[picked]] = self._clock  # a wrapped sweep must not retake it
            m -= picked.size
            self._hand = (self._hand + end) % size
            swept += end
        return np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)

    def _copy(self, items: np.ndarray, slots: np.ndarray) -> None:
        """Gather ``items`` on the host into a staging buffer, then one host→device copy."""
        turn = self._turn
        self._turn ^= 1
        done = self._copy_done[turn]
        if done is not None:
            done.synchronize()  # the copy issued two calls ago still reads this buffer
        staging = self._staging[turn][: items.size]
        torch.index_select(self._host, 0, torch.from_numpy(items), out=staging)
        cold = staging.to(self.device, non_blocking=True)  # [m, D]
        self.rows.index_copy_(0, torch.from_numpy(slots).to(self.device), cold)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._copy_done[turn] = event
        self._copies += 1
        self._bytes_copied += staging.nbytes

    def stats(self) -> EmbeddingCacheStats:
        resident = self.num_items if self.fully_resident else self._resident
        return EmbeddingCacheStats(
            num_items=self.num_items,
            num_slots=self.num_slots,
            resident=resident,
            fully_resident=self.fully_resident,
            lookups=self._lookups,
            misses=self._misses,
            evictions=self._evictions,
            copies=self._copies,
            bytes_copied=self._bytes_copied,
            device_bytes=self.rows.nbytes,
            pinned=0 if self.fully_resident else int(np.count_nonzero(self._pinned)),
        )
