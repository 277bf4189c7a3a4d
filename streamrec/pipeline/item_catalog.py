"""The item catalogue as the model sees it when the table exceeds the GPU budget.

Two cache structures stand in for the all-GPU item table (DESIGN §4, issue 20):

- input embeddings: the model reads ``EmbeddingCache.rows`` (``HSTU.use_item_rows``), and
  every model call's item rows are translated into slot ids first, once per call, on the
  host arrays the call is built from (``slots``); cold rows are copied in by that call.
- retrieval: scores the ``RetrievalSet`` (the popular members, on the device) instead of
  the whole table; its results are item rows, and ranking translates them to slots.

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


def retrieve_members(
    retrievable: RetrievalSet, user_emb: torch.Tensor, k: int, drop: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` members by cosine score: ``(scores[B, k], item rows[B, k])``.

    The set's table has the item table's layout (row 0 padding), so the model's own
    retrieval ops serve it: the fused GEMM + top-k on CUDA, ``mm`` + ``topk`` elsewhere.
    ``drop[B, E]`` are table rows to skip (``retrievable.excluded_rows``; 0 = none), built
    apart so that this call copies nothing host -> device (it can be graph-captured).
    """
    table = retrievable.table  # [1 + N, D]
    k = min(k, retrievable.size)
    if fused_retrieval_enabled("auto", user_emb, table, k, 1):
        scores, rows = fused_retrieve(user_emb, table, drop, k, 1)
    else:
        scores, rows = retrieve_reference(user_emb, table, drop, k, 1)
    return scores, retrievable.items[rows]


class ItemCatalog:
    """Embedding-cache slots for model inputs plus the retrievable set for retrieval."""

    def __init__(self, embeddings: EmbeddingCache, retrievable: RetrievalSet) -> None:
        if embeddings.num_items != retrievable.num_items or embeddings.device != retrievable.device:
            raise ConfigError(
                f"embedding cache ({embeddings.num_items} rows on {embeddings.device}) and "
                f"retrieval set ({retrievable.num_items} rows on {retrievable.device}) must "
                "cover the same table on the same device"
            )
        self.embeddings = embeddings
        self.retrievable = retrievable

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

    def candidate_slots(self, items: torch.Tensor) -> torch.Tensor:
        """Slot ids of retrieved item rows ``[B, C]``, on their device (one small sync)."""
        if self.embeddings.fully_resident:
            return items
        slots = self.embeddings.slots(items.cpu().numpy())
        return torch.from_numpy(slots).to(items.device)

    def retrieve(
        self, user_emb: torch.Tensor, k: int, exclude: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores[B, k], item rows[B, k])`` over the retrievable set."""
        drop = self.retrievable.excluded_rows(exclude)  # [B, E] table rows
        return retrieve_members(self.retrievable, user_emb, k, drop)

    def observe(self, items: np.ndarray) -> None:
        """The item rows of a batch's new events (popularity for the next refresh)."""
        self.retrievable.observe(items)
        self.retrievable.tick()

    def close(self) -> None:
        self.retrievable.close()

    def stats(self) -> tuple[EmbeddingCacheStats, RetrievalSetStats]:
        return self.embeddings.stats(), self.retrievable.stats()
