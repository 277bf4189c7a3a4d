"""Next-k generation's knobs (the ``[generation]`` section of the worker's config).

Its own module, free of torch, because the worker's configuration loader reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from streamrec.errors import ConfigError
from streamrec.schemas.events import Action

# Token actions a generated item may be fed back with (not "candidate": that is ranking's).
GENERATION_ACTIONS: tuple[str, ...] = tuple(
    a.name.lower() for a in Action if a is not Action.CANDIDATE
)


@dataclass(frozen=True)
class GenerationConfig:
    """Generation beside the ranked list; ``k = 0`` turns it off.

    Each generated item is fed back as a token ``time_step_ms`` after the previous one,
    with ``action``. With ``draft_model`` (a directory from ``streamrec train --draft-of``)
    generation is speculative: the draft proposes ``gamma`` items per round and the model
    verifies them in one call. ``temperature = 0`` is greedy; otherwise items are sampled
    from the top ``sample_pool`` candidates (nucleus ``top_p``), seeded by ``seed``.
    ``exclude_consumed`` keeps the user's recent items (the ranked list's exclusion
    window) out; generated items never repeat either way. ``draft_catalog = N`` lets the
    draft propose only among the N items its target emitted most often in the draft's
    training rollouts (``pipeline/draft_catalog.py``): a cheaper proposal, the same output.
    """

    k: int = 0
    draft_model: Path | None = None
    gamma: int = 4
    draft_catalog: int = 0  # 0: the draft proposes from the whole catalog
    temperature: float = 0.0
    top_p: float = 1.0
    sample_pool: int = 64
    seed: int = 0
    time_step_ms: int = 60_000
    action: str = "complete"
    exclude_consumed: bool = True

    def __post_init__(self) -> None:
        checks = (
            (0 <= self.k <= 256, "k", "must be in [0, 256] (0 = off)"),
            (1 <= self.gamma <= 32, "gamma", "must be in [1, 32]"),
            (self.temperature >= 0.0, "temperature", "must be >= 0 (0 = greedy)"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.sample_pool >= 1, "sample_pool", "must be >= 1"),
            (self.time_step_ms >= 0, "time_step_ms", "must be >= 0"),
            (self.action in GENERATION_ACTIONS, "action", f"must be one of {GENERATION_ACTIONS}"),
            (self.draft_model is None or self.k >= 1, "draft_model", "needs k >= 1"),
            (self.draft_catalog >= 0, "draft_catalog", "must be >= 0 (0 = the whole catalog)"),
            (
                self.draft_catalog == 0 or self.draft_model is not None,
                "draft_catalog",
                "needs generation.draft_model",
            ),
            (self.draft_model is None or str(self.draft_model) != "", "draft_model", "is empty"),
        )
        for ok, name, problem in checks:
            if not ok:
                raise ConfigError(f"{name} = {getattr(self, name)!r}: {problem}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def candidates(self) -> int:
        """Retrieval width per position: 1 when greedy, ``sample_pool`` when sampling."""
        return 1 if self.greedy else self.sample_pool

    @property
    def action_id(self) -> int:
        return int(Action[self.action.upper()])
