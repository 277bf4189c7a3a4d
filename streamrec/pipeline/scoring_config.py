"""How a step turns a user embedding into the published list (the ``[scoring]`` section).

Its own module, free of torch, because the worker's configuration loader (and with it
``streamrec --help``) reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from streamrec.errors import ConfigError


def _default_weights() -> dict[str, float]:
    return {"complete": 1.0, "like": 1.0, "skip": -1.0}


@dataclass(frozen=True)
class ScoringConfig:
    """How many items come out, how many are ranked, how task scores combine.

    With ``num_candidates == 0`` ranking is off and the retrieval score orders the list.
    The ranking score of a candidate is ``Σ weight[task] · p(task)`` over the model's
    tasks; tasks without a weight count 0. ``exclude_recent`` of the user's newest items
    are never retrieved again.
    """

    top_k: int = 20
    num_candidates: int = 200
    exclude_recent: int = 16
    task_weights: Mapping[str, float] = field(default_factory=_default_weights)

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ConfigError(f"top_k = {self.top_k}: must be >= 1")
        if self.num_candidates and self.num_candidates < self.top_k:
            raise ConfigError(
                f"num_candidates = {self.num_candidates}: must be 0 (no ranking) or >= "
                f"top_k ({self.top_k})"
            )
        if self.num_candidates < 0:
            raise ConfigError(f"num_candidates = {self.num_candidates}: must be >= 0")
        if self.exclude_recent < 0:
            raise ConfigError(f"exclude_recent = {self.exclude_recent}: must be >= 0")
