"""Shared set-up of the generation tests: small random models and users in a real KV cache."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from streamrec.cache.block_pool import NoRoom
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.pipeline.draft_context import DraftContext
from streamrec.pipeline.generation_workspace import ModelGeometry
from streamrec.pipeline.generator import GenerationInputs, GenModel

BASE_TS = 1_700_000_000_000


def random_hstu(
    seed: int,
    num_items: int = 60,
    num_layers: int = 2,
    d_model: int = 16,
    max_seq_len: int = 48,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> HSTU:
    cfg = HSTUConfig(
        num_items=num_items, num_oov_buckets=2, d_model=d_model, num_layers=num_layers,
        num_heads=2, head_dim=16, max_seq_len=max_seq_len, num_time_buckets=8, task_hidden=8,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = HSTU(cfg).eval()
    with torch.no_grad():  # non-zero biases so positions and time gaps matter
        for layer in model.layers:
            layer.pos_bias.normal_(0, 0.5)
            layer.time_bias.normal_(0, 0.5)
    return model.to(device, dtype)


def gen_model(model: HSTU) -> GenModel:
    dtype = next(model.parameters()).dtype
    return GenModel(model, ModelGeometry(model.config, dtype))


class CachedUsers:
    """Users whose histories were prefilled into a real ``KVCache`` (the state after a step)."""

    def __init__(
        self, model: HSTU, lengths: list[int], seed: int, block_size: int = 4, consumed: int = 3
    ) -> None:
        cfg = model.config
        dev = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        rng = np.random.default_rng(seed)
        self.model = model
        self.users = [f"u{i}" for i in range(len(lengths))]
        self.histories: list[np.ndarray] = []
        for n in lengths:
            items = rng.integers(cfg.first_item_row, cfg.num_items, n)
            actions = rng.integers(1, 5, n)
            ts = BASE_TS + np.cumsum(rng.integers(1_000, 10**6, n))
            self.histories.append(np.stack([items, actions, ts], axis=1).astype(np.int64))
        blocks = sum(-(-n // block_size) for n in lengths) + 4
        kv_cfg = KVCacheConfig(cfg.num_layers, cfg.num_heads, cfg.head_dim, block_size, dtype)
        self.cache = KVCache(kv_cfg, blocks, dev)
        tokens = torch.from_numpy(np.concatenate(self.histories).T.copy()).to(dev)  # [3, T]
        offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=dev)
        with torch.no_grad():
            k, v, self.user_emb = model.prefill(tokens[0], tokens[1], tokens[2], offsets)
        slots = []
        for user, n in zip(self.users, lengths, strict=True):
            got = self.cache.pool.append(user, n)
            assert not isinstance(got, NoRoom)
            slots.append(np.asarray(got, np.int64))
        self.cache.write(np.concatenate(slots), k, v, tokens[2])
        self.consumed = consumed

    def inputs(self, window: int | None = None) -> GenerationInputs:
        dev = self.cache.device
        tables, lens = self.cache.batch_tables(self.users)
        last_ts = torch.tensor([int(h[-1, 2]) for h in self.histories], device=dev)
        width = max(1, self.consumed)
        consumed = np.full((len(self.users), width), -1, np.int64)
        for b, h in enumerate(self.histories):
            recent = h[-self.consumed :, 0] if self.consumed else h[:0, 0]
            consumed[b, : len(recent)] = recent
        tokens = lens_t = None
        if window is not None:
            ctx = DraftContext(window)
            for user, h in zip(self.users, self.histories, strict=True):
                ctx.update(user, h, replace=True)
            tokens, lens_t = ctx.batch(self.users, dev)
        return GenerationInputs(
            user_emb=self.user_emb,
            block_tables=tables,
            cached_lens=lens,
            last_ts=last_ts,
            consumed=torch.from_numpy(consumed).to(dev),
            window=tokens,
            window_lens=lens_t,
        )


@torch.no_grad()
def recompute_next(
    model: HSTU, history: np.ndarray, generated: list[int], step_ms: int, action: int
) -> torch.Tensor:
    """The user embedding after history + generated items, by a full prefill (no cache)."""
    last = int(history[-1, 2])
    extra = [[item, action, last + (i + 1) * step_ms] for i, item in enumerate(generated)]
    rows = np.concatenate([history, np.asarray(extra, np.int64).reshape(-1, 3)])
    dev = next(model.parameters()).device
    t = torch.from_numpy(rows.T.copy()).to(dev)
    _, _, z = model.prefill_states(t[0], t[1], t[2], torch.tensor([0, len(rows)], device=dev))
    return F.normalize(z[-1], dim=-1)
