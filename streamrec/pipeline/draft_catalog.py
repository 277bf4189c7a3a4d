"""The items a speculative draft proposes from: the few its target actually emits.

A draft's proposal costs a retrieval over the whole catalog (1M item rows at the
reference shapes: γ scans of the table per round, most of a round's retrieval), yet a
proposal only has to be *likely*: the target verifies every one, so a draft restricted to
a subset can lower the acceptance but never change the output. Greedy generation
concentrates on few items: on MovieLens-small the target's continuations in the draft's
training rollouts used 2,286 of 9,724 items, and their 1,000 most frequent covered 99.6 %
of them. ``offline/distillation.py`` writes those items, most frequent first, into the
draft's directory (``DRAFT_ITEMS``); with ``generation.draft_catalog = N`` the draft
scores only the first N of them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from streamrec.errors import ModelError
from streamrec.models.hstu import HSTU

DRAFT_ITEMS = "draft_items.npy"  # [N, 2] int64 (item row, times emitted), most first


def save_draft_items(model_dir: Path | str, emitted: np.ndarray) -> Path:
    """Write the item rows of ``emitted`` (any shape) by how often they occur."""
    rows, counts = np.unique(np.asarray(emitted, np.int64).ravel(), return_counts=True)
    order = np.lexsort((rows, -counts))  # most emitted first, then by row
    path = Path(model_dir) / DRAFT_ITEMS
    np.save(path, np.stack([rows[order], counts[order]], axis=1))
    return path


def load_draft_items(model_dir: Path | str, limit: int) -> np.ndarray:
    """The ``limit`` most emitted item rows recorded with a draft ([<= limit] int64)."""
    path = Path(model_dir) / DRAFT_ITEMS
    if not path.exists():
        raise ModelError(
            f"draft {model_dir} has no {DRAFT_ITEMS} (trained without rollouts, "
            "--rollout-k 0): set generation.draft_catalog = 0 or retrain the draft"
        )
    items = np.load(path)
    if items.ndim != 2 or items.shape[1] != 2:
        raise ModelError(f"{path}: expected [N, 2] (item row, count), got {items.shape}")
    return np.ascontiguousarray(items[:limit, 0], dtype=np.int64)


class DraftCatalog:
    """A draft's retrieval over its catalog: a gathered copy of those rows of its
    normalised item table, and the maps between catalog and item rows.

    The copy keeps the model's first ``first_item_row`` rows (padding and OOV) in front,
    so that the model's retrieval skips them as it does on the whole table; excluded item
    rows outside the catalog cannot be proposed anyway and map to -1 (none).
    """

    def __init__(self, draft: HSTU, rows: np.ndarray) -> None:
        cfg = draft.config
        first = cfg.first_item_row
        if len(rows) == 0:
            raise ModelError("draft catalog is empty")
        if int(rows.min()) < first or int(rows.max()) >= cfg.num_items:
            raise ModelError(
                f"draft catalog rows span [{int(rows.min())}, {int(rows.max())}], outside the "
                f"retrievable rows [{first}, {cfg.num_items})"
            )
        weight = draft.item_emb.weight
        device = weight.device
        with torch.no_grad():
            table = draft.retrieval_table.get(weight)  # [V, D]
            picked = torch.from_numpy(rows).to(device)  # [N]
            self.table = torch.cat([table[:first], table[picked]]).contiguous()  # [first+N, D]
        self.rows = torch.cat([torch.arange(first, device=device), picked])  # local -> item row
        self.local = torch.full((cfg.num_items,), -1, dtype=torch.int64, device=device)
        self.local[picked] = torch.arange(first, first + len(rows), device=device)
        self.size = len(rows)
        self._draft = draft

    def retrieve(
        self, user_emb: torch.Tensor, k: int, exclude: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of the catalog for user_emb [R, D]; exclude [R, E] item rows (-1: none).
        Returns scores and *item rows* [R, k], as ``HSTU.retrieve`` does."""
        local = torch.where(exclude >= 0, self.local[exclude.clamp(min=0)], -1)  # [R, E]
        scores, ids = self._draft.retrieve(user_emb, k, local, table=self.table)
        return scores, self.rows[ids]
