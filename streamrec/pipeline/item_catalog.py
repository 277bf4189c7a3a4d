"""The item catalogue as the model sees it when the table exceeds the GPU budget.

Two cache structures stand in for the all-GPU item table (DESIGN §4, issue 20):

- input embeddings: the model reads ``EmbeddingCache.rows`` (``HSTU.use_item_rows``), and
  every model call's item rows are translated into slot ids first, once per call, on the
  host arrays the call is built from (``slots``); cold rows are copied in by that call.
- retrieval: scores the ``RetrievalSet`` (the popular members, on the device) instead of
  the whole table; its results are item rows, and ranking needs their slots. When the cache
  has room for the set plus ``MIN_FREE_SLOTS`` (the common case: the set is the hot part
  of the catalogue), the members are pinned in the cache and a device table maps each
  set row to its slot, so a step's candidates never miss and never go through the host.
  Otherwise the candidates' slots are looked up on the host like any other rows (one
  device -> host -> device round trip per step: ~3 ms at batch 64 on the H200, issue 20).

With the table on the GPU the worker builds no catalogue and nothing here runs. With it,
outputs equal the all-GPU table's whenever the retrievable set holds every retrievable
row (tests/pipeline/test_item_catalog.py); a smaller set trades recall for memory.
"""

from __future__ import annotations

import numpy as np
import torch

from streamrec.cache.embedding_cache import EmbeddingCache
from streamrec.cache.retrieval_set import RetrievalSet
from streamrec.cache.stats import EmbeddingCacheStats, RetrievalSetStats
from streamrec.errors import ConfigError
from streamrec.models.hstu import HSTU
from streamrec.models.retrieval import fused_retrieval_enabled, fused_retrieve, retrieve_reference

MIN_FREE_SLOTS = 65_536  # unpinned slots kept for the rows of one model call's inputs


def retrieve_set_rows(
    retrievable: RetrievalSet, user_emb: torch.Tensor, k: int, drop: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` members by cosine score: ``(scores[B, k], set table rows[B, k])``.

    The set's table has the item table's layout (row 0 padding), so the model's own
    retrieval ops serve it: the fused GEMM + top-k on CUDA, ``mm`` + ``topk`` elsewhere.
    ``drop[B, E]`` are table rows to skip (``retrievable.excluded_rows``; 0 = none), built
    apart so that this call copies nothing host -> device (it can be graph-captured).
    """
    table = retrievable.table  # [1 + N, D]
    k = min(k, retrievable.size)
    if fused_retrieval_enabled("auto", user_emb, table, k, 1):
        return fused_retrieve(user_emb, table, drop, k, 1)
    return retrieve_reference(user_emb, table, drop, k, 1)


def retrieve_members(
    retrievable: RetrievalSet, user_emb: torch.Tensor, k: int, drop: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` members by cosine score: ``(scores[B, k], item rows[B, k])``."""
    scores, rows = retrieve_set_rows(retrievable, user_emb, k, drop)
    return scores, retrievable.items[rows]


class ItemCatalog:
    """Embedding-cache slots for model inputs plus the retrievable set for retrieval."""

    def __init__(
        self,
        embeddings: EmbeddingCache,
        retrievable: RetrievalSet,
        min_free_slots: int = MIN_FREE_SLOTS,
    ) -> None:
        if embeddings.num_items != retrievable.num_items or embeddings.device != retrievable.device:
            raise ConfigError(
                f"embedding cache ({embeddings.num_items} rows on {embeddings.device}) and "
                f"retrieval set ({retrievable.num_items} rows on {retrievable.device}) must "
                "cover the same table on the same device"
            )
        self.embeddings = embeddings
        self.retrievable = retrievable
        # Pinned members: set table row -> embedding slot, on the device ([1 + N]; row 0,
        # the padding row, maps to slot 0 and is never a result). None: host lookups.
        self._row_slots: torch.Tensor | None = None
        self._pinned_members = np.zeros(0, dtype=np.int64)  # [N] what is pinned, by position
        room = embeddings.num_slots - retrievable.size
        if not embeddings.fully_resident and room >= min_free_slots:
            self._pin_members()

    @property
    def size(self) -> int:
        """How many items retrieval can return."""
        return self.retrievable.size

    def bind(self, model: HSTU) -> None:
        """Make ``model`` read its input embeddings from the cache's device slots."""
        model.use_item_rows(self.embeddings.rows)

    def slots(self, items: np.ndarray) -> np.ndarray:
        """Slot ids of item rows (the model's item arguments); copies cold rows in."""
        return self.embeddings.slots(items)

    @property
    def members_pinned(self) -> bool:
        return self._row_slots is not None

    @property
    def row_slots(self) -> torch.Tensor | None:
        """``[1 + N]`` embedding slot of each set table row on the device, when pinned."""
        return self._row_slots

    def candidate_slots(self, items: torch.Tensor) -> torch.Tensor:
        """Slot ids of retrieved item rows ``[B, C]``, on their device (one small sync)."""
        if self.embeddings.fully_resident:
            return items
        slots = self.embeddings.slots(items.cpu().numpy())
        return torch.from_numpy(slots).to(items.device)

    def retrieve(
        self, user_emb: torch.Tensor, k: int, exclude: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scores[B, k], item rows[B, k], embedding slots[B, k])`` over the retrievable
        set; the slots come from the device table when the members are pinned."""
        drop = self.retrievable.excluded_rows(exclude)  # [B, E] table rows
        scores, rows = retrieve_set_rows(self.retrievable, user_emb, k, drop)
        items = self.retrievable.items[rows]  # [B, k]
        if self._row_slots is None:
            return scores, items, self.candidate_slots(items)
        self.embeddings.count_hits(rows.numel())
        return scores, items, self._row_slots[rows]

    def observe(self, items: np.ndarray) -> None:
        """The item rows of a batch's new events (popularity for the next refresh)."""
        self.retrievable.observe(items)
        if self.retrievable.tick() and self._row_slots is not None:
            self._repin()

    def _pin_members(self) -> None:
        members = self.retrievable.members.copy()  # [N]
        slots = self.embeddings.pin(members)
        row_slots = np.concatenate([[0], slots]).astype(np.int64)  # [1 + N]
        self._row_slots = torch.from_numpy(row_slots).to(self.retrievable.device)
        self._pinned_members = members

    def _repin(self) -> None:
        """After a set refresh: pin the entering members, release the leaving ones."""
        assert self._row_slots is not None
        members = self.retrievable.members
        moved = np.flatnonzero(members != self._pinned_members)  # positions swapped
        if not moved.size:
            return
        self.embeddings.unpin(self._pinned_members[moved])
        slots = self.embeddings.pin(members[moved])
        index = torch.from_numpy(moved + 1).to(self._row_slots.device)
        self._row_slots.index_copy_(0, index, torch.from_numpy(slots).to(index.device))
        self._pinned_members = members.copy()

    def close(self) -> None:
        self.retrievable.close()

    def stats(self) -> tuple[EmbeddingCacheStats, RetrievalSetStats]:
        return self.embeddings.stats(), self.retrievable.stats()
