"""The shape of an HSTU model, fixed at construction and saved beside its weights.

Everything an entry point needs to interpret a tensor (catalog rows, heads, the attention
divisor ``N``, the time-bucket edges) lives here, so a checkpoint directory is
self-describing and the cache can size its pool from the config alone.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from streamrec.errors import ConfigError
from streamrec.schemas.events import NUM_ACTIONS

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class HSTUConfig:
    """Model hyperparameters; ``num_items`` counts every embedding row.

    Row 0 is padding and rows ``1 … num_oov_buckets`` are out-of-vocabulary buckets (see
    ``ItemVocabulary``); neither is ever retrieved.
    """

    num_items: int
    num_oov_buckets: int = 16
    num_actions: int = NUM_ACTIONS
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 32
    max_seq_len: int = 200
    num_time_buckets: int = 32
    # Width of one time bucket in log1p(seconds); 31 buckets of 0.6 reach ~4 years.
    time_bucket_width: float = 0.6
    task_names: tuple[str, ...] = ("complete", "skip", "like")
    task_hidden: int = 64
    dropout: float = 0.0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        positive = {
            "num_oov_buckets": self.num_oov_buckets,
            "num_actions": self.num_actions,
            "d_model": self.d_model,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "max_seq_len": self.max_seq_len,
            "num_time_buckets": self.num_time_buckets,
            "task_hidden": self.task_hidden,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"HSTUConfig.{name}={value!r} must be a positive int")
        if not isinstance(self.num_items, int) or self.num_items < self.num_oov_buckets + 2:
            raise ConfigError(
                f"HSTUConfig.num_items={self.num_items!r} must count padding, "
                f"{self.num_oov_buckets} OOV rows and at least one item "
                f"(>= {self.num_oov_buckets + 2})"
            )
        if not (self.time_bucket_width > 0 and math.isfinite(self.time_bucket_width)):
            raise ConfigError(
                f"HSTUConfig.time_bucket_width={self.time_bucket_width!r} must be > 0"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"HSTUConfig.dropout={self.dropout!r} must be in [0, 1)")
        if self.dtype not in DTYPES:
            raise ConfigError(f"HSTUConfig.dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        names = tuple(self.task_names)
        if not names or len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
            raise ConfigError(
                f"HSTUConfig.task_names={self.task_names!r} must be unique non-empty strings"
            )
        object.__setattr__(self, "task_names", names)

    @property
    def first_item_row(self) -> int:
        """Index of the first retrievable row (after padding and the OOV buckets)."""
        return 1 + self.num_oov_buckets

    @property
    def num_tasks(self) -> int:
        return len(self.task_names)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["task_names"] = list(self.task_names)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HSTUConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"HSTUConfig: unknown field(s) {unknown}")
        if "num_items" not in data:
            raise ConfigError("HSTUConfig: missing field 'num_items'")
        values = dict(data)
        if "task_names" in values:
            values["task_names"] = tuple(values["task_names"])
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"HSTUConfig: {exc}") from exc
