"""The kernels' time bias (models/time_bias_kernels.py) equals ``relative_bias`` bit for
bit: from timestamps (every edge and cell bound, both paths of a multi-bucket tile) and
from key positions (the thresholds of users whose timestamps never decrease).

    TRITON_INTERPRET=1 PYTHONPATH=$PWD /work/triton-venv/bin/python -m pytest -q \\
        -p no:cacheprovider tests/models/test_time_bias_kernels.py
"""

from __future__ import annotations

import pytest
import torch

from streamrec.models import prefill_attention as pfa
from streamrec.models import prefill_kernels as pfk
from streamrec.models import time_bias_kernels as tbk
from streamrec.models.attention import relative_bias, time_bucket_edges
from tests.models.prefill_cases import make_jagged, needs_interpreter, require_cuda

if pfa.triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _bias_probe(
        dt_ptr, key_out_ptr, tile_out_ptr, pos_ptr, tb_ptr, cell_edge_ptr, cell_base_ptr,
        edges_ptr, n, NUM_POS: tl.constexpr, NUM_TIME: tl.constexpr, NUM_CELLS: tl.constexpr,
        BLOCK: tl.constexpr, BUCKET_LOOP: tl.constexpr,
    ):  # fmt: skip
        """Head 1: 2 x the per-key rab / 2 at relative position 0, and 2 x the tile time
        bias / 2 of 16 queries at ts 0 against keys at ts = dt (one tile, every edge: the
        per-element buckets, or with BUCKET_LOOP >= 32 the compare per edge)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        dt = tl.load(dt_ptr + i, mask=mask, other=0).to(tl.float64)
        pos_row = pos_ptr + (NUM_POS + 2 * tbk.POS_PAD) + tbk.POS_PAD
        tb_row = tb_ptr + NUM_TIME
        rel = tl.zeros([BLOCK], dtype=tl.int32)
        key = tbk.key_rab(rel, dt, pos_row, tb_row, cell_edge_ptr, cell_base_ptr, NUM_POS,
                           NUM_CELLS)  # fmt: skip
        tl.store(key_out_ptr + i, key * 2.0, mask=mask)
        ts_q = tl.zeros([16], dtype=tl.float64)
        q_lo, q_hi = tl.reduce((ts_q, ts_q), 0, tbk.min_max)
        zero = tl.zeros([16, BLOCK], dtype=tl.float32)
        k_lo, k_hi = tl.reduce((dt, dt), 0, tbk.min_max)
        tile = tbk.add_time_bias(zero, ts_q, dt, q_lo, q_hi, k_lo, k_hi, edges_ptr, tb_row,
                                  cell_edge_ptr, cell_base_ptr, NUM_CELLS,
                                  BUCKET_LOOP)  # fmt: skip
        tl.store(tile_out_ptr + i, tl.max(tile, 0) * 2.0, mask=mask)


def _probe_time_bias(device: str, bucket_loop: int) -> None:
    """Kernel biases of head 1 equal relative_bias bit for bit at every edge ±1, every
    cell bound ±1, 0 and 2^k up to 2^45 ms, both signs, per key and per tile."""
    edges = time_bucket_edges(32, 0.6)
    gen = torch.Generator().manual_seed(0)
    probes = {0, 1, 2, 3}
    for e in edges.tolist():
        probes |= {e - 1, e, e + 1}
    for octave in range(46):
        for quarter in range(4):
            bound = (4 + quarter) << octave >> 2
            probes |= {bound - 1, bound, bound + 1}
    dt = torch.tensor(sorted(p for p in probes if p >= 0), dtype=torch.int64)
    dt = torch.cat([dt, -dt, torch.randint(-(10**12), 10**12, (256,), generator=gen)])
    pos_bias = torch.randn(64, 2, generator=gen)
    time_bias = torch.randn(32, 2, generator=gen)
    rel = torch.zeros_like(dt)
    want_key = relative_bias(rel[None], dt[None], pos_bias, time_bias, edges)[1, 0]  # [n]
    want_time = time_bias[torch.bucketize(dt.abs(), edges, right=True), 1]
    dev = [t.to(device) for t in (dt, pos_bias, time_bias, edges)]
    tables = tbk.bias_tables(dev[1], dev[2], dev[3])
    pad = tbk.POS_PAD
    assert torch.equal(tables[0].cpu()[:, pad:-pad] * 2, pos_bias.t())
    key = torch.zeros(dt.shape[0], device=device)
    tile = torch.zeros(dt.shape[0], device=device)
    block = 256
    torch.library.wrap_triton(_bias_probe)[(triton.cdiv(dt.shape[0], block),)](
        dev[0], key, tile, *tables, dev[3], dt.shape[0], NUM_POS=64, NUM_TIME=32,
        NUM_CELLS=tbk.NUM_CELLS, BLOCK=block, BUCKET_LOOP=bucket_loop,
    )  # fmt: skip
    assert torch.equal(key.cpu(), want_key), (key.cpu() - want_key).abs().max()
    assert torch.equal(tile.cpu(), want_time), (tile.cpu() - want_time).abs().max()


@needs_interpreter
@pytest.mark.parametrize("bucket_loop", [pfk.PREFILL_BUCKET_LOOP, 32])
def test_interpreter_time_bias_is_exact(interpreter_scalars: None, bucket_loop: int) -> None:
    _probe_time_bias("cpu", bucket_loop)


@needs_interpreter
def test_interpreter_bucket_thresholds(interpreter_scalars: None) -> None:
    """thr[i, b] = keys j <= i of the user with ts_i - ts_j >= edges[b], for every user
    whose timestamps never decrease; the others are flagged 0 (their rows unread)."""
    case = make_jagged([0, 1, 5, 40, 3, 17, 64], "cpu", seed=3, head_dim=16)
    edges = case.edges
    thr, flags = tbk.bucket_thresholds(case.ts, case.offsets, edges, case.pos_bias.shape[0])
    offsets = case.offsets.tolist()
    for user in range(len(offsets) - 1):
        ts = case.ts[offsets[user] : offsets[user + 1]]
        ordered = bool((ts[1:] >= ts[:-1]).all())
        assert int(flags[user]) == int(ordered), user
        if not ordered:
            continue
        want = ((ts[:, None, None] - ts[None, :, None]) >= edges[None, None, :]) & (
            torch.arange(len(ts))[None, :, None] <= torch.arange(len(ts))[:, None, None]
        )  # [n, n, E]: key j counts for row i and edge b
        got = thr[offsets[user] : offsets[user + 1]]
        assert torch.equal(got, want.sum(1).to(torch.int32)), user


@pytest.mark.gpu
@pytest.mark.parametrize("bucket_loop", [pfk.PREFILL_BUCKET_LOOP, 32])
def test_time_bias_is_exact_on_cuda(bucket_loop: int) -> None:
    require_cuda()
    _probe_time_bias("cuda", bucket_loop)
