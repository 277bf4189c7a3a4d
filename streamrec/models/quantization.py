"""A loaded HSTU turned into its FP8 serving form: FP8 projection weights, FP8 KV scales.

``cache.kv_dtype`` and ``model.weight_dtype`` (worker/config.py) name a
``ServingPrecision``; ``apply_precision`` turns a loaded ``HSTU`` into that model once,
before it serves or is exported: the layers' ``uvqk``/``proj`` become ``FP8Linear`` and
the KV scales (``fp8.KVScales``) are derived from the (possibly quantized) weights. Both
change the numerics, so an AOTI package is keyed by the precision too (aoti_export.py).
"""

from __future__ import annotations

import torch

from streamrec.errors import ConfigError
from streamrec.models.fp8 import FP8, KVScales, power_of_two_scale, projection_bound
from streamrec.models.fp8_linear import FP8Linear
from streamrec.models.hstu import HSTU, HSTULayer
from streamrec.models.serving_precision import ServingPrecision


def kv_storage_dtype(precision: ServingPrecision, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for a model computing in ``model_dtype``."""
    return FP8 if precision.fp8_kv else model_dtype


def model_precision(model: HSTU) -> ServingPrecision:
    """The precision ``apply_precision`` left ``model`` at."""
    layer = model.layers[0]
    assert isinstance(layer, HSTULayer)
    return ServingPrecision(
        kv_dtype="fp8_e4m3" if model.kv_quant is not None else "model",
        weight_dtype="fp8" if isinstance(layer.uvqk, FP8Linear) else "model",
    )


def kv_scales(model: HSTU) -> KVScales:
    """Per-(layer, K/V, head) scales from the bound on each layer's k and v projections."""
    cfg = model.config
    rows: list[torch.Tensor] = []
    for layer in model.layers:
        assert isinstance(layer, HSTULayer)
        lin = layer.uvqk
        weight = lin.dequantized_weight() if isinstance(lin, FP8Linear) else lin.weight
        bias: torch.Tensor | None = lin.bias
        norm = layer.norm_in
        bound = projection_bound(weight, bias, norm.weight, norm.bias)  # [4*H*d]: u, v, q, k
        per_head = bound.view(4, cfg.num_heads, cfg.head_dim).amax(dim=-1)  # [4, H]
        rows.append(power_of_two_scale(per_head[[3, 1]]))  # [2, H]: k, v
    return KVScales(torch.stack(rows).to(model.item_emb.weight.device))  # [Lyr, 2, H]


@torch.no_grad()
def apply_precision(model: HSTU, precision: ServingPrecision) -> HSTU:
    """Quantize ``model`` in place to ``precision`` (for serving: FP8 weights are frozen).

    Idempotent for the same precision; going back to the model's own precision needs a
    fresh load of the checkpoint.
    """
    current = model_precision(model)
    if (current.fp8_kv and not precision.fp8_kv) or (
        current.fp8_weights and not precision.fp8_weights
    ):
        raise ConfigError(
            f"model is already at {current}; {precision} needs a fresh load of the weights"
        )
    if precision.fp8_weights and not current.fp8_weights:
        for layer in model.layers:
            assert isinstance(layer, HSTULayer)
            layer.uvqk = FP8Linear(layer.uvqk)  # type: ignore[assignment]
            layer.proj = FP8Linear(layer.proj)  # type: ignore[assignment]
    if precision.fp8_kv:  # (re)derived: the weights may have just been quantized
        model.kv_quant = kv_scales(model)
    return model
