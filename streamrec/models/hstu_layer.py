"""One pre-norm HSTU layer's weights and its two halves around the attention.

``project`` is LayerNorm -> one GEMM -> SiLU, split into u, v, q, k; ``output`` is the
gated residual tail. The attention itself lives with its caller (``HSTU``), which picks
a path per entry point; ``rank`` hands the candidate kernel the packed projection
(``project_packed``) so that q, k, v are never copied out of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from streamrec.models.config import HSTUConfig
from streamrec.models.fused_layer import fused_layer_usable, fused_output, fused_project

LayerState = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class HSTULayer(nn.Module):
    """Weights of one pre-norm HSTU layer; the attention is done by the caller."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        hd = config.num_heads * config.head_dim
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.norm_in = nn.LayerNorm(config.d_model)
        self.uvqk = nn.Linear(config.d_model, 4 * hd)
        self.norm_attn = nn.LayerNorm(hd)
        self.proj = nn.Linear(hd, config.d_model)
        self.pos_bias = nn.Parameter(torch.zeros(config.max_seq_len, config.num_heads))
        self.time_bias = nn.Parameter(torch.zeros(config.num_time_buckets, config.num_heads))
        self.dropout = nn.Dropout(config.dropout)

    def project(self, x: torch.Tensor, fused: bool = False) -> LayerState:
        """x [..., D] -> u, v, q, k, each [..., H, d]."""
        return self.split(*self.project_packed(x, fused))

    def project_packed(self, x: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, bool]:
        """x [..., D] -> the projection [..., 4*H*d] (columns u, v, q, k) and whether its
        SiLU is applied yet (``fused``: one kernel that applies it, see ``fusable``)."""
        if fused:
            return fused_project(x, self.norm_in, self.uvqk), True
        return self.uvqk(self.norm_in(x)), False

    def split(self, h: torch.Tensor, activated: bool) -> LayerState:
        """The projection's u, v, q, k [..., H, d], after the SiLU."""
        h = h if activated else F.silu(h)
        shape = (*h.shape[:-1], self.num_heads, self.head_dim)
        u, v, q, k = (part.reshape(shape) for part in h.chunk(4, dim=-1))
        return u, v, q, k

    def gate(self, h: torch.Tensor, activated: bool) -> torch.Tensor:
        """u [..., H, d] alone (its SiLU only: the attention read v, q, k itself)."""
        u = h[..., : self.num_heads * self.head_dim]
        u = u if activated else F.silu(u)
        return u.reshape(*h.shape[:-1], self.num_heads, self.head_dim)

    def value_query_key(
        self, h: torch.Tensor, activated: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """v, q, k [..., H, d] alone (their SiLU only; ``gate`` has u's)."""
        t = h[..., self.num_heads * self.head_dim :]
        t = t if activated else F.silu(t)
        v, q, k = t.reshape(*h.shape[:-1], 3, self.num_heads, self.head_dim).unbind(-3)
        return v, q, k

    def qkv_columns(self) -> tuple[int, int, int]:
        """Where q, k and v start in a projection row."""
        width = self.num_heads * self.head_dim
        return 2 * width, 3 * width, width

    def output(
        self, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor, fused: bool = False
    ) -> torch.Tensor:
        """Residual update x + Linear(u ⊙ LayerNorm(attn)); u, attn [..., H, d]."""
        if fused:
            return fused_output(x, u.flatten(-2), attn.flatten(-2), self.norm_attn, self.proj)
        gated = u.flatten(-2) * self.norm_attn(attn.flatten(-2))  # [..., H*d]
        return x + self.dropout(self.proj(gated))

    def fusable(self, x: torch.Tensor) -> bool:
        """Whether ``project``/``output`` may run fused for input x: see
        ``fused_layer_usable``; dropout must be inactive."""
        return (
            (not self.training or self.dropout.p == 0.0)
            and fused_layer_usable(x, self.norm_in, self.uvqk)
            and fused_layer_usable(x, self.norm_attn, self.proj)
        )

    def bias0(self) -> torch.Tensor:
        """rab of a token with itself (relative position 0, dt = 0): [H]."""
        return self.pos_bias[0] + self.time_bias[0]
