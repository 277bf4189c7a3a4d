"""Exponential backoff with full jitter: the one retry schedule of the worker.

Every retry loop (the broker absent at start, the cluster id unavailable, a history-store
outage) waits ``uniform(0, min(max_s, initial_s * 2**attempt))`` between tries. Without
the jitter every worker of a consumer group that lost the same broker or Redis would
retry in lockstep and hit it together when it comes back ("full jitter", as in the AWS
architecture blog's comparison of backoff schemes).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from streamrec.errors import ConfigError


@dataclass
class Backoff:
    """Delays for consecutive failures of one operation; ``reset()`` after a success."""

    initial_s: float
    max_s: float
    rng: random.Random = field(default_factory=random.Random, repr=False)
    attempt: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ConfigError(
                f"backoff {self.initial_s}s..{self.max_s}s: need 0 < initial_s <= max_s"
            )

    def ceiling(self) -> float:
        """The largest delay the next failure may wait."""
        return min(self.max_s, self.initial_s * 2.0 ** min(self.attempt, 60))

    def next_delay(self) -> float:
        """The wait before the next try (and one more failure counted)."""
        delay = self.rng.uniform(0.0, self.ceiling())
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0
