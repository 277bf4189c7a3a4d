"""A model that does no work: the host-ceiling mode of ``bench/worker_bench.py``.

With it, a step costs only what the worker's host path costs (fetch, decode, batching,
history appends, cache metadata, result encoding, produce, commits), so the events/s the
worker sustains is the ceiling the host path puts on any model. It lives in ``bench/``
only: the product never serves it.

It satisfies ``streamrec.pipeline.serving_model.ServingModel`` with outputs of the right
shapes and dtypes (zeros, and retrieval returning the first ``k`` retrievable rows), on a
tiny geometry (one layer, one head of 16) so that the KV writes the step still does cost
next to nothing.
"""

from __future__ import annotations

import torch

from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.models.vocabulary import ItemVocabulary

NULL_GEOMETRY = {"num_layers": 1, "num_heads": 1, "head_dim": 16, "d_model": 16}


class NullModel:
    """Zero outputs of the right shapes; ``rank`` scores decrease along the candidates."""

    def __init__(self, config: HSTUConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    def _kv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        shape = (c.num_layers, num_tokens, c.num_heads, c.head_dim)
        return (
            torch.zeros(shape, dtype=c.torch_dtype, device=self.device),
            torch.zeros(shape, dtype=c.torch_dtype, device=self.device),
        )

    def _users(self, offsets: torch.Tensor) -> torch.Tensor:
        emb = torch.zeros(offsets.shape[0] - 1, self.config.d_model, device=self.device)
        return emb.to(self.config.torch_dtype)  # [B, D]

    def prefill(
        self, items: torch.Tensor, actions: torch.Tensor, ts: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k, v = self._kv(items.shape[0])
        return k, v, self._users(offsets)

    def extend(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        offsets: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k, v = self._kv(items.shape[0])
        return k, v, self._users(offsets)

    def rank(
        self,
        cand_items: torch.Tensor,
        query_ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> torch.Tensor:
        b, c = cand_items.shape
        ramp = torch.linspace(1.0, 0.0, c, device=self.device)  # [C]
        return ramp.view(1, c, 1).expand(b, c, self.config.num_tasks).contiguous()

    def retrieve(
        self, user_emb: torch.Tensor, k: int, exclude: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b = user_emb.shape[0]
        first = self.config.first_item_row
        rows = torch.arange(first, first + k, device=self.device).expand(b, k)  # [B, k]
        scores = torch.linspace(1.0, 0.0, k, device=self.device).expand(b, k)
        return scores.contiguous(), rows.contiguous()


def null_checkpoint_parts(
    num_items: int, max_seq_len: int, device: torch.device
) -> tuple[HSTU, NullModel, ItemVocabulary]:
    """The (tiny) HSTU whose config and vocabulary the worker reads, and its null twin."""
    vocab = ItemVocabulary([f"i{n}" for n in range(num_items)], num_oov_buckets=16)
    g = NULL_GEOMETRY
    config = HSTUConfig(
        num_items=vocab.size,
        num_oov_buckets=16,
        max_seq_len=max_seq_len,
        num_layers=g["num_layers"],
        num_heads=g["num_heads"],
        head_dim=g["head_dim"],
        d_model=g["d_model"],
    )
    module = HSTU(config).eval()
    return module, NullModel(config, device), vocab
