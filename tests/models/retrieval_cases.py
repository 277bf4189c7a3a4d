"""Retrieval test inputs shared by test_retrieval.py and test_score_scan.py: the exact
top-k oracle and small stress cases on a dyadic grid (scores exact in fp32 and bf16)."""

from __future__ import annotations

import torch

from streamrec.models.topk_merge import pack_keys, unpack_keys

FIRST = 17  # first retrievable row (padding + 16 OOV buckets)


def oracle(
    scores: torch.Tensor, exclude: torch.Tensor, k: int, first: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k over rows >= first by key (score desc, index asc), excluded = -inf."""
    num_items = scores.shape[1]
    masked = scores.float().clone()
    masked.scatter_(1, exclude.clamp(min=0, max=num_items - 1), float("-inf"))
    idx = torch.arange(first, num_items).expand(scores.shape[0], -1)
    keys = pack_keys(masked[:, first:], idx)
    return unpack_keys(torch.topk(keys, k, dim=1).values)


def dyadic(rows: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """Entries in {-4..4}/8: dot products over dim <= 64 are exact in fp32 and bf16."""
    return torch.randint(-4, 5, (rows, dim), generator=gen).float() / 8


def case(name: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(user_emb [B, D], table [V, D], exclude [B, E], k) of a named stress case."""
    gen = torch.Generator().manual_seed(seed)
    num_users, num_items, dim, k = 3, 4000, 32, 4
    users, table = dyadic(num_users, dim, gen), dyadic(num_items, dim, gen)
    exclude = torch.randint(-1, num_items, (num_users, 2), generator=gen)
    if name == "clustered":  # 600 copies of user 0's direction: one chunk overflows
        table[FIRST + 900 : FIRST + 1500] = users[0]
    elif name == "zero_user":  # every score 0: order by index alone
        users[1] = 0
    elif name == "exclude_best":  # each user's best rows are excluded
        best = oracle(users @ table.t(), torch.full((num_users, 1), -1), 2, FIRST)[1]
        exclude = torch.cat([best, exclude[:, :1]], dim=1)
    elif name == "tiny":  # fewer valid rows than k: excluded rows fill in at -inf
        table = table[: FIRST + k + 1]
        exclude = torch.tensor([[FIRST, FIRST + 1], [-1, -1], [FIRST + 2, 10_000]])
    elif name != "random":
        raise ValueError(name)
    return users, table, exclude, k


CASES = ("random", "clustered", "zero_user", "exclude_best", "tiny")
