"""The fused full recompute of the H200 bench equals the dense one (issue 14, item 2).

``fused_recompute`` (jagged tokens, the fused prefill and candidate kernels) must compute
exactly what ``full_recompute`` (dense [B, L, L]) does, or the speedup against "the best
recompute" compares different work. Checked on the CPU interpreter in fp32 and, marked
``gpu``, on CUDA in bf16 at a larger shape.
"""

from __future__ import annotations

import pytest
import torch

from streamrec.models import prefill_attention as pfa
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from tests.triton_interpreter import INTERPRET, patch_scalars

pytest.importorskip("bench.h200_common")
from bench.h200_common import full_recompute, fused_recompute


def _case(device: str, dtype: str, batch: int, length: int, cands: int) -> tuple:
    cfg = HSTUConfig(
        num_items=500, d_model=64, num_layers=2, num_heads=2, head_dim=32,
        max_seq_len=max(64, length), dtype=dtype,
    )  # fmt: skip
    torch.manual_seed(0)
    model = HSTU(cfg).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.pos_bias.normal_(0, 0.5)
            layer.time_bias.normal_(0, 0.5)
    model = model.to(device, cfg.torch_dtype)
    gen = torch.Generator().manual_seed(1)
    items = torch.randint(1, cfg.num_items, (batch, length), generator=gen)
    actions = torch.randint(1, 4, (batch, length), generator=gen)
    ts = 1_700_000_000_000 + torch.randint(1000, 10**7, (batch, length), generator=gen).cumsum(1)
    cand = torch.randint(1, cfg.num_items, (batch, cands), generator=gen)
    dense = tuple(t.to(device) for t in (items, actions, ts, cand, ts[:, -1].contiguous()))
    return model, dense


def _compare(device: str, dtype: str, batch: int, length: int, cands: int) -> tuple[float, ...]:
    model, (items, actions, ts, cand, query_ts) = _case(device, dtype, batch, length, cands)
    offsets = torch.arange(batch + 1, device=device) * length
    with torch.no_grad():
        want = full_recompute(model, items, actions, ts, cand, query_ts)
        got = fused_recompute(
            model, items.reshape(-1), actions.reshape(-1), ts.reshape(-1), offsets, cand,
            query_ts,
        )  # fmt: skip
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    return tuple(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))


@pytest.mark.skipif(not (INTERPRET and pfa.triton_available()), reason="needs TRITON_INTERPRET=1")
def test_fused_recompute_equals_dense_on_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    patch_scalars(monkeypatch)
    emb_err, score_err = _compare("cpu", "float32", batch=3, length=40, cands=5)
    assert emb_err < 1e-5 and score_err < 1e-5


@pytest.mark.gpu
def test_fused_recompute_equals_dense_on_cuda() -> None:
    if INTERPRET or not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    emb_err, score_err = _compare("cuda", "bfloat16", batch=4, length=700, cands=64)
    print(f"\nfused vs dense recompute, bf16: user_emb {emb_err:.2e}, scores {score_err:.2e}")
    assert emb_err < 2e-2 and score_err < 2e-2
