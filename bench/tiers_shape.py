"""The shapes, model and timing helpers both sections of ``tiers_bench`` share.

``H200`` is the reference HSTU-8L at the issue's catalog size (20M items); ``SMOKE`` the
tiny shapes that check the code on the CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from bench.h200_common import graphed
from bench.reference_config import HSTU_8L, SPEEDUP_HISTORY_LEN
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU, HSTULayer

BASE_TS = 1_700_000_000_000
BLOCK = 16
Rows = list[dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Shape:
    items: int
    dim: int
    layers: int
    heads: int
    head_dim: int
    max_seq_len: int
    history: int
    batch: int
    cands: int
    retrievable: int
    slot_fractions: tuple[float, ...]
    disk_users: int
    steps: int


H200 = Shape(
    items=20_000_000, dim=HSTU_8L.d_model, layers=HSTU_8L.num_layers, heads=HSTU_8L.num_heads,
    head_dim=HSTU_8L.head_dim, max_seq_len=HSTU_8L.max_seq_len, history=SPEEDUP_HISTORY_LEN,
    batch=64, cands=HSTU_8L.num_candidates, retrievable=1_000_000,
    slot_fractions=(0.02, 0.1, 0.2, 0.4), disk_users=12, steps=30,
)  # fmt: skip
SMOKE = Shape(
    items=20_000, dim=64, layers=2, heads=2, head_dim=32, max_seq_len=128, history=64,
    batch=4, cands=16, retrievable=2_000, slot_fractions=(0.05, 0.2), disk_users=3, steps=4,
)  # fmt: skip


def captured(
    front: Callable[[], torch.Tensor], back: Callable[[], torch.Tensor], device: torch.device
) -> list[Callable[[], torch.Tensor]]:
    """The two halves of a step as CUDA-graph replays returning their static outputs
    (eager on the CPU, or if a capture fails)."""
    if device.type != "cuda":
        return [front, back]
    try:
        return [graphed(front), graphed(back)]
    except Exception as exc:  # capture errors come in many types
        print(f"CUDA-graph capture failed, timing eagerly: {type(exc).__name__}: {exc}")
        return [front, back]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tier_model(shape: Shape, device: torch.device, dtype: torch.dtype) -> HSTU:
    config = HSTUConfig(
        num_items=1024 + 17, d_model=shape.dim, num_layers=shape.layers, num_heads=shape.heads,
        head_dim=shape.head_dim, max_seq_len=shape.max_seq_len,
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
    )  # fmt: skip
    torch.manual_seed(0)
    model = HSTU(config).eval()
    with torch.no_grad():
        for layer in model.layers:
            assert isinstance(layer, HSTULayer)
            layer.pos_bias.normal_(0, 0.3)
            layer.time_bias.normal_(0, 0.3)
    return model.to(device, dtype)
