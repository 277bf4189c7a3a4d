"""What the engine needs of a model: the four tensor entry points and nothing else.

Eager ``HSTU`` and the AOTInductor runtime both satisfy this protocol, so the engine never
knows (or cares) which backend it drives; the backend name is reported in stats so the
worker can log it and export it as a metric.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ServingModel(Protocol):
    """The serving entry points of docs/contracts.md."""

    def prefill(
        self, items: torch.Tensor, actions: torch.Tensor, ts: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def rank(
        self,
        cand_items: torch.Tensor,
        query_ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> torch.Tensor: ...

    def retrieve(
        self, user_emb: torch.Tensor, k: int, exclude: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class GeneratingModel(ServingModel, Protocol):
    """A serving model that can also generate: ``extend_scratch`` (docs/contracts.md).

    Eager ``HSTU``, ``AOTIModel`` and ``GraphedModel`` have it; a model without it still
    serves the ranked list, only not the generated continuation.
    """

    def extend_scratch(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
        scratch_kv: torch.Tensor,
        scratch_ts: torch.Tensor,
        scratch_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
