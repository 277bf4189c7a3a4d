"""Generation as part of a model step: the step's users, right after they were scored.

``ModelStep`` calls ``run`` once per (sub-)step with the users it just extended or
rebuilt and their user embeddings: the KV cache then holds each user's newest tokens,
which is all ``Generator`` needs. This class turns the step's ``UserWork`` into the
generator's inputs (each user's newest timestamp, the recent items it must not generate,
the block tables) and keeps the draft's per-user token window in step with the cache:
a rebuilt user's window restarts from its history, an extended one grows by its tokens,
and a user that leaves the cache leaves the window store too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
import torch

from streamrec.cache.kv_cache import KVCache, to_device
from streamrec.pipeline.draft_context import DraftContext
from streamrec.pipeline.generator import (
    Generated,
    GenerationInputs,
    GenerationStats,
    Generator,
    consumed_rows,
)


class StepUser(Protocol):
    """What generation reads of a user's step (``model_step.UserWork`` has it)."""

    @property
    def user_id(self) -> str: ...

    @property
    def tokens(self) -> np.ndarray: ...  # [n, 3] (item, action, ts_ms)

    @property
    def prefill(self) -> bool: ...  # the tokens are the whole history (a rebuild)

    @property
    def recent(self) -> np.ndarray: ...  # [E] item rows not to generate


class StepGeneration:
    """A ``Generator`` fed from model steps (and the draft windows it needs)."""

    def __init__(self, generator: Generator, cache: KVCache) -> None:
        self.generator = generator
        self.cache = cache
        self.context = DraftContext(generator.window) if generator.speculative else None

    @property
    def k(self) -> int:
        return self.generator.config.k

    @property
    def stats(self) -> GenerationStats:
        return self.generator.stats

    def forget(self, users: Iterable[str]) -> None:
        """Users gone from the KV cache: their next step is a rebuild."""
        if self.context is not None:
            self.context.drop(users)

    def run(self, work: Sequence[StepUser], user_emb: torch.Tensor) -> Generated:
        """k items per user of ``work`` (after its step); user_emb [B, D] in work order."""
        users = [w.user_id for w in work]
        device = self.cache.device
        if self.context is not None:
            for w in work:
                self.context.update(w.user_id, w.tokens, replace=w.prefill)
        tables, lens = self.cache.batch_tables(users)  # [B, MB], [B]
        consumed = consumed_rows([w.recent for w in work])  # [B, E]
        last_ts = np.fromiter((int(w.tokens[-1, 2]) for w in work), np.int64, len(work))
        window = window_lens = None
        if self.context is not None:
            window, window_lens = self.context.batch(users, device)
        return self.generator.generate(
            GenerationInputs(
                user_emb=user_emb,
                block_tables=tables,
                cached_lens=lens,
                last_ts=to_device(last_ts, device),
                consumed=to_device(consumed, device),
                window=window,
                window_lens=window_lens,
            )
        )
