"""Test-only stand-in for the block pool: random non-contiguous blocks per user.

The real ``BlockPool`` lives in ``streamrec.cache``; the model tests only need slots and
block tables laid out the way the contract describes.
"""

from __future__ import annotations

import torch

from streamrec.models.hstu import HSTU


class FakePagedCache:
    """A paged K/V pool plus per-user block tables, written exactly as the engine would."""

    def __init__(self, model: HSTU, num_blocks: int, block_size: int, seed: int) -> None:
        cfg = model.config
        self.block_size = block_size
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_heads, cfg.head_dim)
        # NaN everywhere a slot was never written: masking must keep it out of every sum.
        self.kv = torch.full(shape, float("nan"))
        self.ts = torch.full((num_blocks, block_size), -(2**40), dtype=torch.int64)
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def add_users(self, n: int) -> None:
        self.tables.extend([] for _ in range(n))
        self.lens.extend(0 for _ in range(n))

    def slots(self, user: int, n_tokens: int) -> list[int]:
        out = []
        for _ in range(n_tokens):
            pos = self.lens[user]
            if pos % self.block_size == 0:
                self.tables[user].append(self.free.pop())
            out.append(
                self.tables[user][pos // self.block_size] * self.block_size + pos % self.block_size
            )
            self.lens[user] += 1
        return out

    def batch_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_tables [B, MB] int32 padded with garbage ids, lens [B] int64)."""
        width = max(1, *(len(t) for t in self.tables))
        rows = [t + [len(t) * 7 + 3] * (width - len(t)) for t in self.tables]
        return torch.tensor(rows, dtype=torch.int32), torch.tensor(self.lens, dtype=torch.int64)

    def write(self, slots: list[int], k: torch.Tensor, v: torch.Tensor, ts: torch.Tensor) -> None:
        lyr, _, nb, bs, h, d = self.kv.shape
        idx = torch.tensor(slots, dtype=torch.int64)
        self.kv[:, 0].view(lyr, nb * bs, h, d)[:, idx] = k
        self.kv[:, 1].view(lyr, nb * bs, h, d)[:, idx] = v
        self.ts.view(-1)[idx] = ts
