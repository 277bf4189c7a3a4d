"""The precision a model serves at (``cache.kv_dtype``, ``model.weight_dtype``).

Its own module, free of torch, because the worker's configuration loader validates the
two knobs with it. ``models/quantization.py`` applies a precision to a loaded model.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrec.errors import ConfigError

KV_DTYPES = ("model", "fp8_e4m3")  # "model": the pool has the model's own dtype
WEIGHT_DTYPES = ("model", "fp8")  # "fp8": the layers' projection GEMMs in e4m3


@dataclass(frozen=True)
class ServingPrecision:
    """``kv_dtype``: the KV pool's dtype, "model" or "fp8_e4m3"; ``weight_dtype``: "model"
    or "fp8" (each layer's uvqk and output projections: embeddings and heads stay)."""

    kv_dtype: str = "model"
    weight_dtype: str = "model"

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype={self.kv_dtype!r} must be one of {list(KV_DTYPES)}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError(
                f"weight_dtype={self.weight_dtype!r} must be one of {list(WEIGHT_DTYPES)}"
            )

    @property
    def fp8_kv(self) -> bool:
        return self.kv_dtype == "fp8_e4m3"

    @property
    def fp8_weights(self) -> bool:
        return self.weight_dtype == "fp8"

    def key_settings(self) -> dict[str, str]:
        """What an AOTI package key records: nothing at the model's own precision, so the
        keys of the packages built before FP8 existed do not change."""
        return {
            name: value
            for name, value in (("kv_dtype", self.kv_dtype), ("weight_dtype", self.weight_dtype))
            if value != "model"
        }

    def __str__(self) -> str:
        return f"kv_dtype={self.kv_dtype} weight_dtype={self.weight_dtype}"


MODEL_PRECISION = ServingPrecision()  # the checkpoint's own dtype throughout
