"""``HSTU.extend_scratch``: generated tokens after a user's paged cache and a scratch.

Generation (pipeline/generator.py) feeds the items it generates back as tokens without
ever touching the user's cache: they are guesses, like ranking candidates. Their keys
and values live in a scratch the caller owns and rewinds at will. The math is the same
as ``extend``'s (SiLU attention is a plain sum, so the cached keys, the scratch keys and
the call's own keys are separate terms): on CUDA the fused token-attention op covers the
cache and the new tokens and the few scratch slots are added densely; elsewhere the
cache goes through the torch gather and the scratch and new keys are attended at once.
Shape-static like the other entry points, so it exports to AOTInductor.

Kept out of hstu.py for that module's length; it reads the model's layers, bias and
helpers through the ``ScratchModel`` protocol (no import of hstu: no cycle).
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from streamrec.models.attention import silu_attention
from streamrec.models.config import HSTUConfig
from streamrec.models.paged_attention import fused_attention_enabled, fused_token_attention


class ScratchLayer(Protocol):
    """What of an ``HSTULayer`` it uses."""

    pos_bias: torch.Tensor
    time_bias: torch.Tensor

    def project(self, x: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, ...]: ...

    def output(
        self, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor, fused: bool = False
    ) -> torch.Tensor: ...


class ScratchModel(Protocol):
    """What of ``HSTU`` it uses."""

    config: HSTUConfig
    attention_backend: str
    layers: nn.ModuleList
    norm_out: nn.LayerNorm
    time_edges: Any  # a registered buffer [NT - 1] int64

    def _embed(self, items: torch.Tensor, actions: torch.Tensor) -> torch.Tensor: ...

    def _bias(self, layer: Any, rel_pos: torch.Tensor, dt_ms: torch.Tensor) -> torch.Tensor: ...

    def _layers_fused(self, x: torch.Tensor) -> bool: ...

    def _context_attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        pos: torch.Tensor,
        ts: torch.Tensor,
        users: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> torch.Tensor: ...


def scratch_extend(
    model: ScratchModel,
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q tokens per user after the paged cache *and* a private scratch; writes nothing.

    Generation feeds the items it generates back as tokens without ever touching the
    user's cache (they are guesses, like ranking candidates): their K/V live in
    ``scratch_kv [Lyr, 2, B, S, H, d]`` / ``scratch_ts [B, S]``, which the caller owns
    and rewinds at will. Token r of user b sits at position ``cached_lens[b] +
    scratch_lens[b] + r``; it sees b's cached positions, b's first ``scratch_lens[b]``
    scratch slots (positions ``cached_lens[b] + j``) and b's tokens 0..r. Tokens past a
    user's real count can pad a row: nothing before them looks at them.

    items, actions, ts [B, Q]. Returns (k_new, v_new [Lyr, B, Q, H, d], emb [B, Q, D]),
    emb being each token's normalised output (its next-item query).
    """
    num_users, num_new = items.shape
    dev = items.device
    n = model.config.max_seq_len
    new_idx = torch.arange(num_new, device=dev, dtype=torch.int64)  # [Q]
    slot_idx = torch.arange(scratch_ts.shape[1], device=dev, dtype=torch.int64)  # [S]
    pos = (cached_lens + scratch_lens).unsqueeze(1) + new_idx  # [B, Q]
    users = torch.arange(num_users, device=dev).unsqueeze(1).expand(-1, num_new)  # [B, Q]
    # (contiguous: the fused op addresses these by token index)
    flat_pos, flat_ts = pos.reshape(-1).contiguous(), ts.reshape(-1).contiguous()  # [T]
    flat_users = users.reshape(-1).contiguous()  # [T], T = B*Q
    first = (users * num_new).reshape(-1).contiguous()  # [T] each user's first token
    x = model._embed(items, actions).reshape(num_users * num_new, -1)  # [T, D]
    edges: torch.Tensor = model.time_edges
    fused = fused_attention_enabled(model.attention_backend, x, model.config.head_dim)
    fl = model._layers_fused(x)
    # Fused: the op covers the cache and the new tokens; the scratch slots are added
    # densely. Torch: the cache through the gather, then scratch and new keys at once.
    key_pos = cached_lens.unsqueeze(1) + slot_idx  # [B, S] scratch positions
    key_ts, key_ok = scratch_ts, slot_idx < scratch_lens.unsqueeze(1)  # [B, S]
    if not fused:
        key_pos = torch.cat([key_pos, pos], dim=1)  # [B, S+Q]
        key_ts = torch.cat([key_ts, ts], dim=1)
        key_ok = torch.cat([key_ok, torch.ones_like(items, dtype=torch.bool)], dim=1)
    rel = pos.unsqueeze(2) - key_pos.unsqueeze(1)  # [B, Q, K]
    dt = ts.unsqueeze(2) - key_ts.unsqueeze(1)  # [B, Q, K]
    mask = key_ok.unsqueeze(1) & (rel >= 0)  # [B, Q, K]
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    for idx, module in enumerate(model.layers):
        layer = cast(ScratchLayer, module)
        u, v, q, k = layer.project(x, fl)  # [T, H, d]
        heads = q.shape[-2:]
        dense = (num_users, num_new, *heads)
        keys, values = scratch_kv[idx, 0], scratch_kv[idx, 1]  # [B, S, H, d]
        if fused:
            attn = fused_token_attention(
                q, k, v, flat_pos, flat_ts, flat_users, first, kv_pool[idx], ts_pool,
                block_tables, cached_lens, layer.pos_bias, layer.time_bias, edges, n,
            )  # fmt: skip
        else:
            attn = model._context_attention(
                idx, q, flat_pos, flat_ts, flat_users, kv_pool, ts_pool, block_tables,
                cached_lens,
            )  # fmt: skip
            keys = torch.cat([keys, k.view(dense)], dim=1)  # [B, S+Q, H, d]
            values = torch.cat([values, v.view(dense)], dim=1)
        bias = model._bias(layer, rel, dt).to(x.dtype)  # [B, H, Q, K]
        local = silu_attention(q.view(dense), keys, values, bias, mask, n)  # [B, Q, H, d]
        x = layer.output(x, u, attn + local.reshape(q.shape), fl)
        ks.append(k.view(dense))
        vs.append(v.view(dense))
    emb = F.normalize(model.norm_out(x), dim=-1).view(num_users, num_new, -1)  # [B, Q, D]
    return torch.stack(ks), torch.stack(vs), emb
