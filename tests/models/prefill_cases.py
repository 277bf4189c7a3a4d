"""Jagged prefill cases (q/k/v, timestamps over every time bucket, biases, candidates)
shared by the prefill, time-bias and FP8 kernel tests."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from streamrec.models import prefill_attention as pfa
from streamrec.models.attention import time_bucket_edges
from tests.triton_interpreter import INTERPRET

FP32_TOL = 1e-5
BF16_TOL = 1e-2
BASE_TS = 1_700_000_000_000


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), "op output has NaN/inf"
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


@dataclass
class Jagged:
    """One layer's jagged q/k/v with timestamps, biases and candidates per user."""

    q: torch.Tensor  # [T, H, d] (views of one [T, 4, H, d] projection when strided)
    k: torch.Tensor
    v: torch.Tensor
    ts: torch.Tensor  # [T]
    offsets: torch.Tensor  # [B + 1]
    qc: torch.Tensor  # [B, C, H, d]
    kc: torch.Tensor
    vc: torch.Tensor
    query_ts: torch.Tensor  # [B]: the user's newest timestamp
    pos_bias: torch.Tensor  # [N, H]
    time_bias: torch.Tensor  # [NT, H]
    edges: torch.Tensor  # [NT - 1]
    divisor: int

    def tail(self) -> tuple[torch.Tensor | int, ...]:
        return self.pos_bias, self.time_bias, self.edges, self.divisor

    def reference(self) -> torch.Tensor:
        return pfa.jagged_silu_attention_reference(
            self.q, self.k, self.v, self.ts, self.offsets, *self.tail()
        )

    def cand_reference(self) -> torch.Tensor:
        return pfa.jagged_candidate_attention_reference(
            self.qc, self.kc, self.vc, self.query_ts, self.k, self.v, self.ts, self.offsets,
            *self.tail(),
        )  # fmt: skip

    def prefill(self, **launch: int) -> torch.Tensor:
        if launch:
            return pfa.launch_prefill(
                self.q, self.k, self.v, self.ts, self.offsets, *self.tail(), **launch
            )
        return pfa.fused_prefill_attention(
            self.q, self.k, self.v, self.ts, self.offsets, *self.tail()
        )

    def candidates(self, **launch: int) -> torch.Tensor:
        args = (self.qc, self.kc, self.vc, self.query_ts, self.k, self.v, self.ts, self.offsets)
        if launch:
            return pfa.launch_candidates(*args, *self.tail(), **launch)
        return pfa.fused_prefill_candidates(*args, *self.tail())

    def to(self, dtype: torch.dtype) -> Jagged:
        """The same case with float tensors in ``dtype`` (index tensors untouched)."""
        names = ("q", "k", "v", "qc", "kc", "vc", "pos_bias", "time_bias")
        return replace(self, **{n: getattr(self, n).to(dtype) for n in names})


def make_jagged(
    lens: list[int], device: str, seed: int, heads: int = 2, head_dim: int = 32,
    cands: int = 5, num_pos: int = 4096, strided: bool = False,
) -> Jagged:  # fmt: skip
    """Timestamps cover every time bucket: sorted users with gaps of 0 … 1e8 ms, one with
    gaps up to ~3 years, one shuffled (|dt| both ways), one with equal timestamps."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    ts_parts = []
    for b, n in enumerate(lens):
        top = 10**11 if b % 4 == 1 else 10**8
        gaps = torch.randint(0, top, (n,), generator=gen)
        part = BASE_TS + torch.cumsum(gaps, 0)
        if b % 4 == 2:
            part = part[torch.randperm(n, generator=gen)]
        if b % 7 == 3:
            part = torch.full((n,), BASE_TS + b)
        ts_parts.append(part)
    ts = torch.cat(ts_parts) if ts_parts else torch.zeros(0, dtype=torch.int64)
    offsets = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)
    if strided:  # q, k, v as the projection leaves them: rows 4·H·d apart
        proj = torch.randn(total, 4, heads, head_dim, generator=gen)
        q, k, v = proj[:, 2], proj[:, 3], proj[:, 1]
    else:
        q, k, v = (torch.randn(total, heads, head_dim, generator=gen) for _ in range(3))
    qc, kc, vc = (torch.randn(len(lens), cands, heads, head_dim, generator=gen) for _ in range(3))
    newest = torch.tensor([int(p.max()) if len(p) else BASE_TS for p in ts_parts])
    num_time = 32
    case = Jagged(
        q=q, k=k, v=v, ts=ts, offsets=offsets, qc=qc, kc=kc, vc=vc,
        query_ts=newest + torch.randint(0, 10**6, (len(lens),), generator=gen),
        pos_bias=torch.randn(num_pos, heads, generator=gen) * 0.5,
        time_bias=torch.randn(num_time, heads, generator=gen) * 0.5,
        edges=time_bucket_edges(num_time, 0.6), divisor=num_pos,
    )  # fmt: skip
    for name, value in case.__dict__.items():
        if isinstance(value, torch.Tensor):
            setattr(case, name, value.to(device))
    return case


def edge_lengths(batch: int, seed: int, block: int = 128, cap: int = 300) -> list[int]:
    """0, 1, tile boundaries ±1, then random lengths up to ``cap``."""
    rng = random.Random(seed)
    fixed = [0, 1, block - 1, block, block + 1, 2 * block, 64, cap]
    return [fixed[i] if i < len(fixed) else rng.randint(0, cap) for i in range(batch)]


# ------------------------------------------------------------------------ CPU


needs_interpreter = pytest.mark.skipif(
    not (INTERPRET and pfa.triton_available()),
    reason="needs TRITON_INTERPRET=1 and Triton (the /work/triton-venv interpreter)",
)


def require_cuda() -> None:
    if INTERPRET or not torch.cuda.is_available():
        pytest.skip("needs CUDA (and no TRITON_INTERPRET)")
