"""Workspace: the per-row buffers a compaction moves are all of them."""

from __future__ import annotations

import torch

from streamrec.models.config import HSTUConfig
from streamrec.pipeline.generation_workspace import ModelGeometry, Workspace


def _workspace(rows: int) -> Workspace:
    cfg = HSTUConfig(
        num_items=50, d_model=16, num_layers=2, num_heads=2, head_dim=8, max_seq_len=64
    )
    geometry = ModelGeometry(cfg, torch.float32)
    return Workspace(rows, 5, 2, 10, 3, 4, geometry, geometry, torch.device("cpu"))


def test_row_axes_name_every_per_row_buffer() -> None:
    """A buffer added to the workspace but not to ROW_AXES would keep a compacted row's
    stale contents: every tensor with a row axis must be listed, on that axis."""
    ws = _workspace(rows=7)
    listed = dict(Workspace.ROW_AXES)
    tensors = {k: v for k, v in vars(ws).items() if isinstance(v, torch.Tensor)}
    per_row = {k for k, v in tensors.items() if v.dim() > 0}
    assert per_row == set(listed)
    for name, axis in listed.items():
        assert tensors[name].shape[axis] == 7, name


def test_take_moves_the_chosen_rows_of_every_buffer() -> None:
    big, small = _workspace(rows=6), _workspace(rows=2)
    for name, axis in Workspace.ROW_AXES:
        t = getattr(big, name)
        shape = [1] * t.dim()
        shape[axis] = t.shape[axis]
        rows = torch.arange(t.shape[axis]).view(shape).expand_as(t)
        t.copy_(rows.to(t.dtype) if t.dtype != torch.bool else rows % 2 == 1)
    small.take(big, torch.tensor([4, 1]))
    for name, axis in Workspace.ROW_AXES:
        got = getattr(small, name).movedim(axis, 0)
        if got.dtype == torch.bool:
            assert not got[0].any() and got[1].all(), name  # rows 4 and 1: even, odd
        else:
            assert (got[0] == 4).all() and (got[1] == 1).all(), name
