"""Paired bootstrap confidence interval of a metric difference between two models.

Both models rank the same held-out item of the same users, so their per-user figures are
paired: resampling users (with replacement, the same draw for both models) keeps the
pairing and measures how much the difference would move on another sample of users of
this kind. On MovieLens-small one user is 1/610 of HR@10, so that noise is large.

With several training seeds per model the seeds are resampled too, independently for
each model (seed s of one model has nothing to do with seed s of the other): the
interval then covers the run-to-run spread of training as well as the user sample. With
one run per model (most-popular is deterministic) it is the classic paired bootstrap.
The interval is the percentile interval of the resampled mean differences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamrec.errors import ConfigError


@dataclass(frozen=True)
class BootstrapConfig:
    samples: int = 2000
    confidence: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.samples, int) or self.samples < 10:
            raise ConfigError(f"BootstrapConfig.samples={self.samples!r} must be an int >= 10")
        if not 0.0 < self.confidence < 1.0:
            raise ConfigError(f"BootstrapConfig.confidence={self.confidence!r} not in (0, 1)")


@dataclass(frozen=True)
class Interval:
    """Mean difference (a − b) and its bootstrap interval [low, high]."""

    diff: float
    low: float
    high: float
    confidence: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0.0 or self.high < 0.0

    def __str__(self) -> str:
        pct = round(100 * self.confidence)
        return f"{self.diff:+.4f} [{self.low:+.4f}, {self.high:+.4f}] ({pct}%)"

    def to_dict(self) -> dict[str, float | bool]:
        return {
            "diff": self.diff,
            "low": self.low,
            "high": self.high,
            "confidence": self.confidence,
            "excludes_zero": self.excludes_zero,
        }


def _as_runs(values: np.ndarray, what: str) -> np.ndarray:
    runs = np.asarray(values, dtype=np.float64)
    runs = runs[None] if runs.ndim == 1 else runs
    if runs.ndim != 2 or runs.shape[0] < 1 or runs.shape[1] < 1:
        raise ConfigError(f"bootstrap: {what} must be [users] or [runs, users], got {runs.shape}")
    return runs


def paired_bootstrap(
    a: np.ndarray, b: np.ndarray, config: BootstrapConfig | None = None
) -> Interval:
    """Interval of mean(a) − mean(b); a [S_a, U] or [U], b [S_b, U] or [U], same users."""
    cfg = config or BootstrapConfig()
    runs_a, runs_b = _as_runs(a, "a"), _as_runs(b, "b")
    users = runs_a.shape[1]
    if runs_b.shape[1] != users:
        raise ConfigError(f"bootstrap: {users} users in a but {runs_b.shape[1]} in b")
    rng = np.random.default_rng(cfg.seed)
    # user draws as counts: weights [B, U], each row sums to U (the same draw for a and b)
    weights = rng.multinomial(users, np.full(users, 1.0 / users), size=cfg.samples)
    weights = weights.astype(np.float64) / users

    def resampled(runs: np.ndarray) -> np.ndarray:
        per_run = runs @ weights.T  # [S, B]: each run's mean over the drawn users
        s = runs.shape[0]
        if s == 1:
            return per_run[0]
        picks = rng.multinomial(s, np.full(s, 1.0 / s), size=cfg.samples) / s  # [B, S]
        return (picks * per_run.T).sum(axis=1)  # [B]

    diffs = resampled(runs_a) - resampled(runs_b)  # [B]
    tail = (1.0 - cfg.confidence) / 2.0
    low, high = np.quantile(diffs, [tail, 1.0 - tail])
    return Interval(
        diff=float(runs_a.mean() - runs_b.mean()),
        low=float(low),
        high=float(high),
        confidence=cfg.confidence,
    )
