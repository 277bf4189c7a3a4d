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
from dataclasses import replace

import numpy as np
import pytest
import torch

from streamrec.errors import ModelError
from streamrec.models import prefill_attention as pfa
from streamrec.models import prefill_kernels as pfk
from streamrec.models.attention import (
    silu_attention,
)
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from tests.models.paged import FakePagedCache
from tests.models.prefill_cases import (
    BASE_TS,
    BF16_TOL,
    FP32_TOL,
    Jagged,
    edge_lengths,
    make_jagged,
    needs_interpreter,
    rel_err,
    require_cuda,
)
from tests.models.test_hstu_gpu import _model as gpu_model


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


# CPU interpreter: small shapes, tile sizes small enough to cross many tile boundaries.


@needs_interpreter
@pytest.mark.parametrize(
    ("block_m", "block_n", "strided", "bucket_loop", "thresholds", "tile_range"),
    [(16, 16, False, 4, False, False), (32, 16, True, 0, False, False),
     (64, 32, False, 32, False, False), (16, 16, False, 4, True, False),
     (32, 16, True, 4, True, False), (16, 16, False, 4, True, True),
     (32, 16, True, 4, True, True)],
)  # fmt: skip
def test_interpreter_prefill(
    interpreter_scalars: None,
    block_m: int,
    block_n: int,
    strided: bool,
    bucket_loop: int,
    thresholds: bool,
    tile_range: bool,
) -> None:
    """bucket_loop 0: every multi-bucket tile's buckets per element; 32: compares only;
    thresholds: users with sorted timestamps by key positions (the shuffled one and the
    rest of the cases by timestamps, in the second launch); tile_range: their key tiles'
    bucket ranges from the query tile's first and last rows of thresholds."""
    lens = [0, 1, *(block_m + d for d in (-1, 0, 1)), 2 * block_m, 3, 150]
    case = make_jagged(lens, "cpu", seed=block_m, head_dim=16, strided=strided)
    got = case.prefill(block_m=block_m, block_n=block_n, num_warps=1, bucket_loop=bucket_loop,
                       thresholds=thresholds, tile_range=tile_range)  # fmt: skip
    if thresholds:  # the same biases, so the same sums bit for bit
        general = case.prefill(block_m=block_m, block_n=block_n, num_warps=1)
        assert torch.equal(got, general)
    err = rel_err(got, case.reference())
    print(f"interpreter prefill {block_m}x{block_n} strided={strided} loop={bucket_loop} "
          f"thresholds={thresholds}: rel err {err:.2e}")  # fmt: skip
    assert got.shape == case.q.shape and got.dtype == case.q.dtype
    assert err < FP32_TOL


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
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_prefill_fp32(batch: int) -> None:
    require_cuda()
    case = make_jagged(edge_lengths(batch, batch), "cuda", seed=batch, head_dim=64,
                       strided=batch == 8)  # fmt: skip
    err = rel_err(case.prefill(), case.reference())
    print(f"prefill fp32 batch={batch}: rel err {err:.2e}")
    assert err < FP32_TOL


@pytest.mark.gpu
def test_prefill_long_histories() -> None:
    require_cuda()
    case = make_jagged([4096, 1000, 2049, 0, 129], "cuda", seed=5, heads=4, head_dim=128)
    err = rel_err(case.prefill(), case.reference())
    print(f"prefill fp32 long: rel err {err:.2e}")
    assert err < FP32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("thresholds", "tile_range"), [(False, False), (True, False), (True, True)]
)
@pytest.mark.parametrize("launch", pfa.PREFILL_LAUNCHES[:2])
def test_prefill_bf16(
    launch: tuple[int, int, int, int], thresholds: bool, tile_range: bool
) -> None:
    """The first two launches in bf16, the time bias from timestamps and (users with
    sorted timestamps) from key positions, their bucket ranges by timestamps or from
    thresholds; the kernel sweep checks every other launch shape against the fp32
    reference (its rel_err_vs_fp32 column)."""
    require_cuda()
    exact = make_jagged([*edge_lengths(16, 3), 1100], "cuda", seed=3, heads=4, head_dim=128)
    low = exact.to(torch.bfloat16)
    want = low.to(torch.float32).reference()  # fp32 math on the bf16-rounded inputs
    block_m, block_n, warps, stages = launch
    got = low.prefill(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                      thresholds=thresholds, tile_range=tile_range)  # fmt: skip
    if tile_range:  # the same buckets as by timestamps, so the same sums bit for bit
        by_ts = low.prefill(block_m=block_m, block_n=block_n, num_warps=warps,
                            num_stages=stages, thresholds=True, tile_range=False)  # fmt: skip
        assert torch.equal(got, by_ts)
    got_err = rel_err(got, want)
    torch_err = rel_err(low.reference(), want)
    print(f"prefill bf16 {launch} thresholds={thresholds} tile_range={tile_range}: "
          f"op {got_err:.2e}, torch bf16 path {torch_err:.2e}")  # fmt: skip
    assert got_err < BF16_TOL
    assert got_err <= 2 * torch_err + 1e-4


@pytest.mark.gpu
def test_prefill_register_cap_changes_no_bit() -> None:
    """``max_registers`` (Triton's maxnreg) changes register allocation, not arithmetic:
    the op's sorted-user launch gives the same output bit for bit under a cap of 168."""
    require_cuda()
    case = make_jagged([*edge_lengths(16, 5), 1100], "cuda", seed=5, heads=4, head_dim=128)
    low = case.to(torch.bfloat16)
    block_m, block_n, warps, stages = pfk.PREFILL_THR_LAUNCH
    launch = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                  thresholds=True)  # fmt: skip
    assert torch.equal(low.prefill(**launch, max_registers=168), low.prefill(**launch))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_candidates(batch: int, dtype: torch.dtype) -> None:
    """Batch 1 is cut into many key ranges (atomics), batch 64 is not."""
    require_cuda()
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
    require_cuda()
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
    require_cuda()
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
