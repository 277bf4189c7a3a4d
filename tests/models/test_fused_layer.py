"""The fused LayerNorm + GEMM kernels of an HSTU layer against the torch path (issue 14).

``gpu`` tests run on the H200 and, at small fp32 shapes, on the CPU interpreter:

    TRITON_INTERPRET=1 PYTHONPATH=$PWD /work/triton-venv/bin/python -m pytest -c /dev/null \\
        --noconftest -o markers=gpu -p no:cacheprovider -q -m gpu tests/models/test_fused_layer.py

Tolerances: fp32 uses IEEE dots (1e-5 relative); bf16 rounds LayerNorm's output (and the
gated product) to bf16 before the dot as the torch path does, but applies bias, SiLU and
the residual to the fp32 accumulator and rounds once (the torch path rounds after each),
so it is held to 1e-2 and to at most 2x the torch bf16 path's own error.
"""

from __future__ import annotations

import pytest
import torch

from streamrec.models.config import HSTUConfig
from streamrec.models.fused_layer import fused_layer_usable
from streamrec.models.hstu import HSTULayer
from tests.models.kernel_device import kernel_device

ON_GPU = torch.cuda.is_available()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all()
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def _layer(d_model: int, heads: int, head_dim: int, device: str) -> HSTULayer:
    cfg = HSTUConfig(num_items=50, d_model=d_model, num_heads=heads, head_dim=head_dim)
    torch.manual_seed(0)
    layer = HSTULayer(cfg).eval()
    with torch.no_grad():  # non-trivial LayerNorm affine parameters
        for norm in (layer.norm_in, layer.norm_attn):
            norm.weight.normal_(1.0, 0.3)
            norm.bias.normal_(0.0, 0.3)
    return layer.to(device)


def test_usable_only_for_cuda_inference() -> None:
    layer = _layer(64, 2, 32, "cpu")
    x = torch.randn(3, 64)
    assert not fused_layer_usable(x, layer.norm_in, layer.uvqk)  # CPU tensor
    odd = _layer(48, 2, 8, "cpu")  # K = 48: no whole K tile
    assert not fused_layer_usable(x[:, :48], odd.norm_in, odd.uvqk)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 70])
@torch.no_grad()
def test_fused_halves_match_torch_fp32(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both kernels equal project/output of the torch path, rows past a tile included,
    on the strided views the layer really passes (chunks of the projection)."""
    device = kernel_device(monkeypatch)
    layer = _layer(64, 2, 32, device)
    x = torch.randn(rows, 64, device=device) * 3 + 1  # a mean offset: the LayerNorm stats
    u, v, q, k = layer.project(x)
    got = layer.project(x, fused=True)
    for g, w in zip(got, (u, v, q, k), strict=True):
        assert g.shape == w.shape
        assert rel_err(g, w) < 1e-5
    attn = torch.randn(rows, 2, 32, device=device)
    want = layer.output(x, u, attn)
    assert rel_err(layer.output(x, got[0], attn, fused=True), want) < 1e-5


@pytest.mark.gpu
@torch.no_grad()
def test_fused_candidates_shape_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """[B, C, D] inputs (rank) through both kernels."""
    device = kernel_device(monkeypatch)
    layer = _layer(64, 2, 32, device)
    x = torch.randn(3, 7, 64, device=device)
    u, v, q, k = layer.project(x)
    fu, fv, fq, fk = layer.project(x, fused=True)
    assert max(rel_err(a, b) for a, b in ((fu, u), (fv, v), (fq, q), (fk, k))) < 1e-5
    attn = torch.randn(3, 7, 2, 32, device=device)
    assert rel_err(layer.output(x, fu, attn, fused=True), layer.output(x, u, attn)) < 1e-5


@pytest.mark.gpu
@torch.no_grad()
def test_launch_variants_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    device = kernel_device(monkeypatch)
    from streamrec.models.fused_layer import launch_norm_linear

    layer = _layer(128, 2, 32, device)
    x = torch.randn(37, 128, device=device)
    want = torch.nn.functional.silu(layer.uvqk(layer.norm_in(x)))
    n, lin = layer.norm_in, layer.uvqk
    for block_m, block_n, block_k, warps, stages in [
        (16, 32, 32, 4, 2), (64, 64, 64, 4, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 3),
        (128, 256, 64, 8, 3), (128, 64, 64, 4, 3),
    ]:  # fmt: skip
        got = launch_norm_linear(
            x, None, n.weight, n.bias, n.eps, lin.weight, lin.bias, None, True, block_m,
            block_n, block_k, warps, stages,
        )  # fmt: skip
        assert rel_err(got, want) < 1e-5, (block_m, block_n, block_k)


@pytest.mark.gpu
@torch.no_grad()
def test_fused_halves_bf16_error() -> None:
    if not ON_GPU:
        pytest.skip("bf16 on CUDA only")
    exact = _layer(512, 4, 128, "cuda")
    low = _layer(512, 4, 128, "cuda").to(torch.bfloat16)
    x = torch.randn(300, 512, device="cuda").to(torch.bfloat16)
    attn = torch.randn(300, 4, 128, device="cuda").to(torch.bfloat16)
    want = exact.project(x.float())
    torch_err = max(rel_err(a, b) for a, b in zip(low.project(x), want, strict=True))
    got = low.project(x, fused=True)
    fused_err = max(rel_err(a, b) for a, b in zip(got, want, strict=True))
    print(f"bf16 project: fused {fused_err:.2e}, torch bf16 {torch_err:.2e}")
    assert fused_err < 1e-2 and fused_err <= 2 * torch_err + 1e-4
    want_o = exact.output(x.float(), want[0], attn.float())
    torch_o = rel_err(low.output(x, got[0], attn), want_o)
    fused_o = rel_err(low.output(x, got[0], attn, fused=True), want_o)
    print(f"bf16 output: fused {fused_o:.2e}, torch bf16 {torch_o:.2e}")
    assert fused_o < 1e-2 and fused_o <= 2 * torch_o + 1e-4


@pytest.mark.gpu
@torch.no_grad()
def test_export_keeps_the_ops_and_graph_capture_replays() -> None:
    if not ON_GPU:
        pytest.skip("export and CUDA graphs on CUDA only")
    layer = _layer(64, 2, 32, "cuda")

    class Half(torch.nn.Module):
        def forward(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
            u, *_ = layer.project(x, fused=True)
            return layer.output(x, u, attn, fused=True)

    x, attn = torch.randn(9, 64, device="cuda"), torch.randn(9, 2, 32, device="cuda")
    program = torch.export.export(Half(), (x, attn), strict=False)
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert any("norm_linear_silu" in t for t in targets), targets
    assert any("gated_norm_linear_residual" in t for t in targets), targets
    want = layer.output(x, layer.project(x)[0], attn)
    assert rel_err(program.module()(x, attn), want) < 1e-5
    half = Half()
    half(x, attn)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = half(x, attn)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel_err(out, layer.output(x, layer.project(x)[0], attn)) < 1e-5
