"""The fused jagged prefill op and its candidate rule against their torch references.

CPU tests pin the references to the model's own dense attention and cached candidate
attention. Kernel tests run the Triton kernels: on the CPU interpreter (small shapes;
``TRITON_INTERPRET=1`` with the Triton venv, see below) and, marked ``gpu``, on CUDA.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD /work/triton-venv/bin/python -m pytest -q \\
        -p no:cacheprovider tests/models/test_prefill_attention.py

Tolerances: fp32 inputs use IEEE fp32 dots in the kernels, so the ops match the fp32
reference within 1e-5 relative error. bf16 inputs: the kernels accumulate in fp32 and
round the SiLU weights to bf16 once before the second matmul; they are compared with the
fp32 reference on the same (bf16-rounded) inputs within 1e-2 relative error, and must be
no worse than 2x the error of the bf16 torch path itself.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from streamrec.errors import ModelError
from streamrec.models import prefill_attention as pfa
from streamrec.models import prefill_kernels as pfk
from streamrec.models import time_bias_kernels as tbk
from streamrec.models.attention import (
    relative_bias,
    silu_attention,
    time_bucket_edges,
)
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from tests.models.paged import FakePagedCache
from tests.models.test_hstu_gpu import _model as gpu_model
from tests.triton_interpreter import INTERPRET, patch_scalars

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


def _small_model(seed: int = 0, layers: int = 1) -> HSTU:
    cfg = HSTUConfig(
        num_items=50, d_model=32, num_layers=layers, num_heads=2, head_dim=16, max_seq_len=64
    )
    torch.manual_seed(seed)
    model = HSTU(cfg, attention_backend="torch").eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.pos_bias.normal_(0, 0.5)
            layer.time_bias.normal_(0, 0.5)
    return model


def _bind(case: Jagged, model: HSTU) -> Jagged:
    layer = model.layers[0]
    edges: torch.Tensor = model.time_edges  # type: ignore[assignment]
    return replace(
        case, pos_bias=layer.pos_bias.detach(), time_bias=layer.time_bias.detach(),
        edges=edges, divisor=model.config.max_seq_len,
    )  # fmt: skip


def test_reference_is_the_model_dense_attention() -> None:
    """The oracle equals what encode_dense computes on padded rows, user by user."""
    model = _small_model()
    case = _bind(make_jagged([0, 1, 7, 33, 64], "cpu", seed=1, head_dim=16), model)
    got = case.reference()
    width = 64
    bounds = case.offsets.tolist()
    for start, end in itertools.pairwise(bounds):
        n = end - start
        pad = width - n
        ts = torch.nn.functional.pad(case.ts[start:end], (0, pad)).unsqueeze(0)  # [1, W]
        valid = (torch.arange(width) < n).unsqueeze(0)
        rel, dt, mask = HSTU._dense_geometry(ts, valid)
        bias = model._bias(model.layers[0], rel, dt)  # [1, H, W, W]
        rows = [torch.nn.functional.pad(t[start:end], (0, 0, 0, 0, 0, pad)) for t in (
            case.q, case.k, case.v)]  # fmt: skip
        want = silu_attention(*(r.unsqueeze(0) for r in rows), bias, mask, case.divisor)
        assert torch.allclose(got[start:end], want[0, :n], rtol=0, atol=1e-6)


def test_candidate_reference_is_the_model_rank_attention() -> None:
    """The candidate oracle equals rank's cached attention plus its self term."""
    model = _small_model()
    case = _bind(make_jagged([0, 1, 16, 17, 40], "cpu", seed=2, head_dim=16, cands=3), model)
    cache = FakePagedCache(model, num_blocks=32, block_size=4, seed=3)
    lens = case.offsets.diff().tolist()
    cache.add_users(len(lens))
    slots = [s for b, n in enumerate(lens) for s in cache.slots(b, n)]
    cache.write(slots, case.k.unsqueeze(0), case.v.unsqueeze(0), case.ts)
    tables, cached = cache.batch_tables()
    with torch.no_grad():  # rank's attention includes each candidate's own key
        q, k, v = (t.flatten(-2) for t in (case.qc, case.kc, case.vc))
        h = torch.cat([torch.zeros_like(q), v, q, k], dim=-1)  # the projection: u, v, q, k
        want = model._candidate_attention(
            0, h, True, case.query_ts, cache.kv, cache.ts, tables, cached
        )
    assert rel_err(case.cand_reference(), want) < 1e-6


def test_time_cells_exact() -> None:
    assert pfa.time_cells_exact(32, 0.6)  # the default config
    assert pfa.time_cells_exact(64, 0.3)
    assert not pfa.time_cells_exact(64, 0.1)  # two edges in one quarter octave
    assert not pfa.time_cells_exact(60, 0.6)  # edges past 2^52 ms


def test_backend_switch_on_cpu() -> None:
    x = torch.zeros(3, 32)
    assert not pfa.fused_prefill_enabled("auto", x, 16, 32, 0.6)
    assert not pfa.fused_prefill_enabled("torch", x, 16, 32, 0.6)
    with pytest.raises(ModelError, match="attention_backend='triton'"):
        pfa.fused_prefill_enabled("triton", x, 16, 32, 0.6)


def test_check_inputs() -> None:
    q = torch.zeros(5, 2, 16)
    with pytest.raises(ModelError, match="alike"):
        pfa.check_inputs(q, q[:4], q, 128, 64)
    with pytest.raises(ModelError, match="power-of-two head_dim"):
        pfa.check_inputs(q[..., :12], q[..., :12], q[..., :12], 128, 64)
    with pytest.raises(ModelError, match="multiple of BLOCK_N"):
        pfa.check_inputs(q, q, q, 64, 128)
    with pytest.raises(ModelError, match="both <="):
        pfa.check_inputs(q, q, q, 256, 64)
    pfa.check_inputs(q, q, q, 128, 64)


# ------------------------------------------------------------------ kernels

needs_interpreter = pytest.mark.skipif(
    not (INTERPRET and pfa.triton_available()),
    reason="needs TRITON_INTERPRET=1 and Triton (the /work/triton-venv interpreter)",
)


def _cuda() -> None:
    if INTERPRET or not torch.cuda.is_available():
        pytest.skip("needs CUDA (and no TRITON_INTERPRET)")


@pytest.fixture
def interpreter_scalars(monkeypatch: pytest.MonkeyPatch) -> None:
    patch_scalars(monkeypatch)


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


# CPU interpreter: small shapes, tile sizes small enough to cross many tile boundaries.


@needs_interpreter
@pytest.mark.parametrize("bucket_loop", [pfk.PREFILL_BUCKET_LOOP, 32])
def test_interpreter_time_bias_is_exact(interpreter_scalars: None, bucket_loop: int) -> None:
    _probe_time_bias("cpu", bucket_loop)


@needs_interpreter
@pytest.mark.parametrize(
    ("block_m", "block_n", "strided", "bucket_loop", "thresholds"),
    [(16, 16, False, 4, False), (32, 16, True, 0, False), (64, 32, False, 32, False),
     (16, 16, False, 4, True), (32, 16, True, 4, True)],
)  # fmt: skip
def test_interpreter_prefill(
    interpreter_scalars: None,
    block_m: int,
    block_n: int,
    strided: bool,
    bucket_loop: int,
    thresholds: bool,
) -> None:
    """bucket_loop 0: every multi-bucket tile's buckets per element; 32: compares only;
    thresholds: users with sorted timestamps by key positions (the shuffled one and the
    rest of the cases by timestamps, in the second launch)."""
    lens = [0, 1, *(block_m + d for d in (-1, 0, 1)), 2 * block_m, 3, 150]
    case = make_jagged(lens, "cpu", seed=block_m, head_dim=16, strided=strided)
    got = case.prefill(block_m=block_m, block_n=block_n, num_warps=1, bucket_loop=bucket_loop,
                       thresholds=thresholds)  # fmt: skip
    if thresholds:  # the same biases, so the same sums bit for bit
        general = case.prefill(block_m=block_m, block_n=block_n, num_warps=1)
        assert torch.equal(got, general)
    err = rel_err(got, case.reference())
    print(f"interpreter prefill {block_m}x{block_n} strided={strided} loop={bucket_loop} "
          f"thresholds={thresholds}: rel err {err:.2e}")  # fmt: skip
    assert got.shape == case.q.shape and got.dtype == case.q.dtype
    assert err < FP32_TOL


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


@needs_interpreter
@pytest.mark.parametrize(("target", "cands"), [(1, 5), (512, 37)])
def test_interpreter_candidates(interpreter_scalars: None, target: int, cands: int) -> None:
    """target 1: one key range per user (plain store); 512: many ranges (atomics)."""
    case = make_jagged([0, 1, 16, 17, 90], "cpu", seed=cands, head_dim=16, cands=cands,
                       num_pos=128)  # fmt: skip
    got = case.candidates(block_m=16, block_n=16, num_warps=1, target_programs=target)
    err = rel_err(got, case.cand_reference())
    print(f"interpreter candidates target={target} C={cands}: rel err {err:.2e}")
    assert got.shape == case.qc.shape
    assert err < FP32_TOL


# GPU: the default launch shapes, the swept ones, bf16, the model and export.


@pytest.mark.gpu
@pytest.mark.parametrize("bucket_loop", [pfk.PREFILL_BUCKET_LOOP, 32])
def test_time_bias_is_exact_on_cuda(bucket_loop: int) -> None:
    _cuda()
    _probe_time_bias("cuda", bucket_loop)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_prefill_fp32(batch: int) -> None:
    _cuda()
    case = make_jagged(edge_lengths(batch, batch), "cuda", seed=batch, head_dim=64,
                       strided=batch == 8)  # fmt: skip
    err = rel_err(case.prefill(), case.reference())
    print(f"prefill fp32 batch={batch}: rel err {err:.2e}")
    assert err < FP32_TOL


@pytest.mark.gpu
def test_prefill_long_histories() -> None:
    _cuda()
    case = make_jagged([4096, 1000, 2049, 0, 129], "cuda", seed=5, heads=4, head_dim=128)
    err = rel_err(case.prefill(), case.reference())
    print(f"prefill fp32 long: rel err {err:.2e}")
    assert err < FP32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("thresholds", [False, True])
@pytest.mark.parametrize("launch", pfa.PREFILL_LAUNCHES[:2])
def test_prefill_bf16(launch: tuple[int, int, int, int], thresholds: bool) -> None:
    """The first two launches in bf16, the time bias from timestamps and (users with
    sorted timestamps) from key positions; the kernel sweep checks every other launch
    shape against the fp32 reference (its rel_err_vs_fp32 column)."""
    _cuda()
    exact = make_jagged([*edge_lengths(16, 3), 1100], "cuda", seed=3, heads=4, head_dim=128)
    low = exact.to(torch.bfloat16)
    want = low.to(torch.float32).reference()  # fp32 math on the bf16-rounded inputs
    block_m, block_n, warps, stages = launch
    got = low.prefill(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                      thresholds=thresholds)  # fmt: skip
    got_err = rel_err(got, want)
    torch_err = rel_err(low.reference(), want)
    print(f"prefill bf16 {launch} thresholds={thresholds}: op {got_err:.2e}, "
          f"torch bf16 path {torch_err:.2e}")  # fmt: skip
    assert got_err < BF16_TOL
    assert got_err <= 2 * torch_err + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_candidates(batch: int, dtype: torch.dtype) -> None:
    """Batch 1 is cut into many key ranges (atomics), batch 64 is not."""
    _cuda()
    exact = make_jagged(edge_lengths(batch, batch + 1), "cuda", seed=batch, heads=4,
                        head_dim=128, cands=256 if batch < 64 else 40)  # fmt: skip
    if dtype == torch.float32:
        err = rel_err(exact.candidates(), exact.cand_reference())
        print(f"candidates fp32 batch={batch}: rel err {err:.2e}")
        assert err < FP32_TOL
        return
    low = exact.to(dtype)
    want = low.to(torch.float32).cand_reference()
    got_err = rel_err(low.candidates(), want)
    torch_err = rel_err(low.cand_reference(), want)
    print(f"candidates bf16 batch={batch}: op {got_err:.2e}, torch bf16 path {torch_err:.2e}")
    assert got_err < BF16_TOL
    assert got_err <= 2 * torch_err + 1e-4


def _histories(model: HSTU, lens: list[int]) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    total = sum(lens)
    items = torch.randint(model.config.first_item_row, model.config.num_items, (total,),
                          generator=gen)  # fmt: skip
    actions = torch.randint(1, model.config.num_actions, (total,), generator=gen)
    ts = BASE_TS + torch.cumsum(torch.randint(0, 10**7, (total,), generator=gen), 0)
    offsets = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)
    return tuple(t.cuda() for t in (items, actions, ts, offsets))


# Relative bounds of HSTU.prefill fused vs dense after 3 layers (as tests/models/test_hstu_gpu.py).
MODEL_TOL = {"float32": 1e-4, "bfloat16": 3e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@torch.inference_mode()
def test_hstu_prefill_fused_equals_dense(dtype: str) -> None:
    _cuda()
    model = gpu_model(dtype)
    inputs = _histories(model, [512, 1, 0, 127, 128, 129, 300, 5])
    fused = model.prefill(*inputs)
    width = model.dense_width(inputs[3])
    k, v, z = model.prefill_states(*inputs, width=width)  # explicit width: the dense path
    dense = (k, v, model._user_embedding(z, inputs[3]))
    errs = [rel_err(a, b) for a, b in zip(fused, dense)]
    print(f"\nHSTU.prefill {dtype} fused vs dense: K {errs[0]:.2e} V {errs[1]:.2e} "
          f"user_emb {errs[2]:.2e}")  # fmt: skip
    assert all(a.shape == b.shape for a, b in zip(fused, dense))
    assert max(errs) < MODEL_TOL[dtype]


@pytest.mark.gpu
@torch.inference_mode()
def test_export_keeps_the_prefill_op() -> None:
    """torch.export of HSTU.prefill with dynamic T and B keeps one op node per layer."""
    _cuda()
    from torch.export import Dim

    model = gpu_model("float32")

    class Prefill(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, items, actions, ts, offsets):
            return self.model.prefill(items, actions, ts, offsets)

    example = _histories(model, [5, 20, 33])
    tokens, users = {0: Dim("T", min=1)}, Dim("B", min=1)
    program = torch.export.export(
        Prefill(), example, dynamic_shapes=(tokens, tokens, tokens, {0: users + 1}),
        strict=False,
    )  # fmt: skip
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert sum("jagged_silu_attention" in t for t in targets) == model.config.num_layers
    other = _histories(model, [1, 300, 0, 64, 65])  # other T and B than the example
    got = program.module()(*other)
    want = model.prefill(*other)
    for a, b in zip(got, want):
        assert rel_err(a, b) < FP32_TOL
