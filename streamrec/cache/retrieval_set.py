"""The items retrieval may return when the catalogue does not fit on the device.

Exact retrieval scores every row of the item table, so it needs the whole normalised
table on the GPU. Past the GPU budget the worker retrieves from a *retrievable set*: the
``N`` items with the highest exponentially decayed event count (popular now, so fresh
items enter as soon as they are played), normalised on the device as ``table[N, D]``.
Retrieval is then the same top-k over ``N`` rows instead of ``V`` (``pipeline.item_catalog.
retrieve_members``: the fused kernel on CUDA, ``mm`` + ``topk`` elsewhere), and its recall against
exact retrieval is what the model's popularity bias allows (measured in
``bench/retrieval_set_recall.py``; BENCHMARKS.md). Ranking candidates are always members,
so their input rows are the hottest of the embedding cache. The device table has the
item table's layout: row 0 is padding (never returned), member ``p`` is row ``p + 1``.

Refresh runs while serving: ``observe`` counts the new events' items per batch (O(events),
the decay is a growing increment, not a pass over ``V``); ``tick`` starts the top-N
selection (an O(V) partition, ~0.1 s at 20M items) on a background thread when due, and
applies a finished selection on the caller's thread: the entering items' rows are copied
into the leaving items' positions in place, in one host→device copy per chunk. An item
enters only if its count beats the weakest member's by ``hysteresis``, so ties and noise
do not churn the set.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from streamrec.cache.stats import RetrievalSetStats
from streamrec.errors import CacheError, ConfigError

_RENORMALISE_AT = 2.0**60  # float32 counts stay finite: rescale before the increment overflows
_CHUNK_ROWS = 65_536


@dataclass(frozen=True)
class RefreshPlan:
    """Items to swap in: ``enter[i]`` takes position ``positions[i]`` (whose item leaves)."""

    positions: np.ndarray  # [M] int64
    enter: np.ndarray  # [M] int64 item rows
    planned_s: float


class RetrievalSet:
    """``retrieve(user_emb, k, exclude)`` over the ``size`` most popular retrievable rows."""

    def __init__(
        self,
        table: torch.Tensor,
        device: torch.device | str,
        size: int,
        first_item_row: int,
        *,
        initial: np.ndarray | None = None,
        half_life_events: float = 1_000_000.0,
        refresh_events: int = 100_000,
        hysteresis: float = 0.1,
    ) -> None:
        if table.dim() != 2 or table.device.type != "cpu":
            raise ConfigError(
                f"retrieval set table must be a 2-D host tensor, got {tuple(table.shape)} on "
                f"{table.device}"
            )
        num_items = table.shape[0]
        retrievable = num_items - first_item_row
        if not 0 < size <= retrievable:
            raise ConfigError(
                f"retrieval set size={size} must be in 1..{retrievable} (retrievable rows)"
            )
        if half_life_events <= 0 or refresh_events <= 0 or hysteresis < 0:
            raise ConfigError(
                f"half_life_events={half_life_events} and refresh_events={refresh_events} "
                f"must be > 0, hysteresis={hysteresis} >= 0"
            )
        self.device = torch.device(device)
        self.num_items, self.size, self.first_item_row = num_items, size, first_item_row
        self._host = table
        self._half_life = float(half_life_events)
        self._refresh_events = refresh_events
        self._hysteresis = hysteresis
        members = np.arange(first_item_row, first_item_row + size, dtype=np.int64)
        if initial is not None:
            members = np.asarray(initial, dtype=np.int64)
            distinct = np.unique(members).size == members.size
            inside = bool(members.size) and members.min() >= first_item_row
            if members.shape != (size,) or not distinct or not inside or members.max() >= num_items:
                raise ConfigError(
                    f"initial retrieval set must be {size} distinct rows in "
                    f"{first_item_row}..{num_items - 1}, got {members.size} "
                    f"(distinct={distinct})"
                )
        self.members = members.copy()  # [N] position -> item row
        self._position_of = np.full(num_items, -1, dtype=np.int32)  # item row -> position
        self._position_of[members] = np.arange(size, dtype=np.int32)
        self._counts = np.zeros(num_items, dtype=np.float32)  # decayed event counts
        self._increment = 1.0
        self.table = torch.zeros((size + 1, table.shape[1]), dtype=table.dtype, device=self.device)
        # [1 + N, D] normalised rows, row 0 padding
        self.device = self.table.device  # with its index ("cuda" -> "cuda:0"), as the cache's
        self.items = torch.from_numpy(np.concatenate([[0], members])).to(self.device)
        # [1 + N] int64 item row of each table row
        self._write(np.arange(size, dtype=np.int64), members)
        if self.device.type == "cuda":  # serving reads it on another stream
            torch.cuda.current_stream(self.device).synchronize()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[RefreshPlan] | None = None
        self._since_refresh = 0
        self._events = self._events_in_set = self._refreshes = self._swapped = 0
        self._last_refresh_s = 0.0

    # ------------------------------------------------------------------ serving

    def excluded_rows(self, exclude: np.ndarray) -> torch.Tensor:
        """Table rows ``[B, E]`` of the members among ``exclude[B, E]`` item rows (-1 =
        none); non-members and -1 map to the padding row 0."""
        rows = np.asarray(exclude, dtype=np.int64)
        drop = self._position_of[np.clip(rows, 0, self.num_items - 1)].astype(np.int64) + 1
        drop[rows < 0] = 0
        if not drop.shape[1]:
            drop = np.zeros((rows.shape[0], 1), dtype=np.int64)
        return torch.from_numpy(drop).to(self.device)

    def observe(self, items: np.ndarray) -> None:
        """Count the items of new events (once per event, never a prefilled history)."""
        rows = np.asarray(items, dtype=np.int64).reshape(-1)
        if not rows.size:
            return
        self._events += rows.size
        self._events_in_set += int(np.count_nonzero(self._position_of[rows] >= 0))
        self._since_refresh += rows.size
        np.add.at(self._counts, rows, np.float32(self._increment))
        self._increment *= 2.0 ** (rows.size / self._half_life)
        if self._increment > _RENORMALISE_AT:
            self._counts /= np.float32(self._increment)
            self._increment = 1.0

    def tick(self) -> bool:
        """Apply a finished refresh, or start one when due; True when the set changed."""
        if self._pending is not None:
            if not self._pending.done():
                return False
            plan = self._pending.result()
            self._pending = None
            self.apply(plan)
            return plan.enter.size > 0
        if self._since_refresh >= self._refresh_events:
            self._since_refresh = 0
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="streamrec-retrieval")
            self._pending = self._executor.submit(self.plan)
        return False

    # ------------------------------------------------------------------ refresh

    def plan(self) -> RefreshPlan:
        """The swaps that make the set the top ``size`` by count (thread-safe: reads only)."""
        start = time.perf_counter()
        counts = self._counts[self.first_item_row :]
        top = np.argpartition(-counts, self.size - 1)[: self.size] + self.first_item_row
        members = self.members.copy()
        entering = top[self._position_of[top] < 0]
        if not entering.size:
            return RefreshPlan(np.zeros(0, np.int64), np.zeros(0, np.int64), 0.0)
        entering = entering[np.argsort(-self._counts[entering], kind="stable")]
        weakest = np.argsort(self._counts[members], kind="stable")[: entering.size]
        beats = self._counts[entering] > self._counts[members[weakest]] * (1 + self._hysteresis)
        n = int(np.count_nonzero(beats))  # both sorted: the first n pairs are the swaps
        return RefreshPlan(
            positions=weakest[:n].astype(np.int64),
            enter=entering[:n].astype(np.int64),
            planned_s=time.perf_counter() - start,
        )

    def apply(self, plan: RefreshPlan) -> None:
        """Swap ``plan.enter`` into the set on the device (the caller's stream)."""
        start = time.perf_counter()
        if plan.enter.size:
            if np.any(self._position_of[plan.enter] >= 0):
                raise CacheError("stale retrieval-set plan: an entering item is already a member")
            self._position_of[self.members[plan.positions]] = -1
            self._position_of[plan.enter] = plan.positions.astype(np.int32)
            self.members[plan.positions] = plan.enter
            self._write(plan.positions, plan.enter)
            index = torch.from_numpy(plan.positions + 1).to(self.device)
            self.items.index_copy_(0, index, torch.from_numpy(plan.enter).to(self.device))
        self._refreshes += 1
        self._swapped += int(plan.enter.size)
        self._last_refresh_s = plan.planned_s + time.perf_counter() - start

    def refresh(self) -> RefreshPlan:
        """Plan and apply now, on the caller's thread (start-up, tests, benchmarks)."""
        plan = self.plan()
        self.apply(plan)
        return plan

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._pending = None

    def stats(self) -> RetrievalSetStats:
        return RetrievalSetStats(
            size=self.size,
            num_items=self.num_items,
            events=self._events,
            events_in_set=self._events_in_set,
            refreshes=self._refreshes,
            swapped=self._swapped,
            last_refresh_s=self._last_refresh_s,
            device_bytes=self.table.nbytes + self.items.nbytes,
        )

    def _write(self, positions: np.ndarray, items: np.ndarray) -> None:
        """Normalised rows of ``items`` into ``table[positions]``, chunk by chunk."""
        for lo in range(0, items.size, _CHUNK_ROWS):
            rows = self._host.index_select(0, torch.from_numpy(items[lo : lo + _CHUNK_ROWS]))
            dev = F.normalize(rows.to(self.device, non_blocking=False), dim=-1)  # [m, D]
            index = torch.from_numpy(positions[lo : lo + _CHUNK_ROWS] + 1).to(self.device)
            self.table.index_copy_(0, index, dev)
