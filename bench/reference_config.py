"""The reference configurations of the performance work (issue 8), fixed in one place.

Every H200 figure in BENCHMARKS.md names one of these, so a number can always be traced
back to the exact model shape and workload that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ReferenceWorkload:
    """Model shape and traffic shape of one reference benchmark."""

    name: str
    num_layers: int
    d_model: int = 512
    num_heads: int = 4
    head_dim: int = 128
    max_seq_len: int = 4096
    num_items: int = 1_000_000
    num_candidates: int = 256
    new_events_per_step: int = 1
    dtype: str = "bfloat16"
    # History lengths: log-normal with this median, capped at max_seq_len.
    history_median: int = 1000
    history_sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.num_heads * self.head_dim <= 0 or self.num_layers <= 0:
            raise ValueError(
                f"bad reference shape: layers={self.num_layers} heads={self.num_heads} "
                f"head_dim={self.head_dim}"
            )
        if not 0 < self.history_median <= self.max_seq_len:
            raise ValueError(
                f"history_median={self.history_median} must be in (0, {self.max_seq_len}]"
            )

    def history_lengths(self, n_users: int, seed: int = 0) -> np.ndarray:
        """Skewed per-user history lengths: many short users, a long tail up to the cap."""
        rng = np.random.default_rng(seed)
        raw = rng.lognormal(
            mean=np.log(self.history_median), sigma=self.history_sigma, size=n_users
        )
        return np.clip(np.rint(raw), 1, self.max_seq_len).astype(np.int64)


HSTU_3L = ReferenceWorkload(name="HSTU-3L", num_layers=3)
HSTU_8L = ReferenceWorkload(name="HSTU-8L", num_layers=8)
REFERENCE_WORKLOADS = (HSTU_3L, HSTU_8L)
# The fixed history length of the cache-speedup comparison (issue 8, target 1).
SPEEDUP_HISTORY_LEN = 2048
BATCH_SIZES = (1, 8, 64)
