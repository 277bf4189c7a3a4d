"""Reference SiLU attention of HSTU: no softmax, additive relative bias, fixed divisor.

Because there is no softmax, the output of one query is a plain sum over keys. A query's
keys can therefore be split into groups (cached keys read through a block table, the
step's own new keys, a candidate's own key) whose contributions are computed separately
and added; this is what makes incremental inference equal to full recompute.

Everything here is shape-static (``where`` masks, gathers, no ``.item()``) so the entry
points that use it export to AOTInductor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def time_bucket_edge_values(num_buckets: int, width: float) -> list[int]:
    """``time_bucket_edges`` as plain ints (no tensor: safe to inspect while tracing)."""
    return [math.ceil(1000.0 * math.expm1(b * width)) for b in range(1, num_buckets)]


def time_bucket_edges(num_buckets: int, width: float) -> torch.Tensor:
    """Bucket edges in integer milliseconds: bucket b holds log1p(|dt| s) in [b·w, (b+1)·w).

    Integer edges make the bucket of a given ``|dt|`` exact on every device and in every
    code path, so two paths that see the same timestamps get the same bias bit for bit.
    """
    edges = time_bucket_edge_values(num_buckets, width)
    return torch.tensor(edges, dtype=torch.int64)  # [num_buckets - 1]


def relative_bias(
    rel_pos: torch.Tensor,
    dt_ms: torch.Tensor,
    pos_bias: torch.Tensor,
    time_bias: torch.Tensor,
    edges: torch.Tensor,
) -> torch.Tensor:
    """rab(i, j) per head: learned bias over i − j plus over the bucketed |ts_i − ts_j|.

    rel_pos, dt_ms: [..., Q, K] int64 (broadcastable); pos_bias [N, H]; time_bias [NT, H].
    Returns [..., H, Q, K] (heads before the query axis, the layout the matmuls want).
    """
    num_pos = pos_bias.shape[0]
    pos_idx = rel_pos.clamp(0, num_pos - 1)
    time_idx = torch.bucketize(dt_ms.abs(), edges, right=True)
    pos = pos_bias.t()[:, pos_idx].movedim(0, -3)  # [..., H, Q, K]
    return pos + time_bias.t()[:, time_idx].movedim(0, -3)


def silu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor,
    divisor: int,
) -> torch.Tensor:
    """Σ_j silu(q·k_j/√d + rab) / N · v_j over the keys allowed by ``mask``.

    q [G, Q, H, d]; k, v [G, K, H, d]; bias [G|1, H, Q, K]; mask [G|1, Q, K] bool.
    Returns [G, Q, H, d]. Masked keys contribute exactly zero even if their K/V hold
    NaN (an unwritten pool slot), because both the weight and the value are masked.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("gqhd,gkhd->ghqk", q, k) * scale + bias  # [G, H, Q, K]
    weights = F.silu(scores) / divisor
    weights = torch.where(mask.unsqueeze(1), weights, torch.zeros_like(weights))
    v = torch.where(mask.any(dim=1)[..., None, None], v, torch.zeros_like(v))  # [G, K, H, d]
    return torch.einsum("ghqk,gkhd->gqhd", weights, v)


def self_attention_term(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias0: torch.Tensor, divisor: int
) -> torch.Tensor:
    """A token's attention to itself (i − j = 0, dt = 0): the candidate term of ``rank``.

    q, k, v [..., H, d]; bias0 [H]. Returns [..., H, d].
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    weight = F.silu((q * k).sum(-1) * scale + bias0) / divisor  # [..., H]
    return weight.unsqueeze(-1) * v
