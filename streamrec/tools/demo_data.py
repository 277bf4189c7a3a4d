"""What the demo replays: MovieLens-small when the shared data is there, synthetic otherwise.

MovieLens comes with titles (``movies.csv`` beside ``ratings.csv``), which the demo prints
instead of ids. The replay takes ``users`` users with enough ratings and interleaves them
(every user's n-th event before anyone's (n+1)-th), so a short replay already gives each
user a history, and no user's replayed history outgrows the model's window (where
incremental and full recompute agree exactly). No torch here: ``--help`` imports this.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

from streamrec.errors import ConfigError, ModelError
from streamrec.offline.datasets import InteractionLog, SyntheticSpec, read_movielens, synthetic_log
from streamrec.schemas.events import Action, Event, InteractionEvent, PlaybackEvent

_REPO: Final = Path(__file__).resolve().parents[2]
# The shared data beside the checkout (../shared), or inside a copy of it (shared/).
MOVIELENS_DIRS: Final = (
    _REPO.parent / "shared" / "data" / "movielens-small",
    _REPO / "shared" / "data" / "movielens-small",
)
DEFAULT_MOVIELENS: Final = MOVIELENS_DIRS[0] / "ratings.csv"

_DURATION_MS: Final = 200_000
_PLAYED_MS: Final = {Action.COMPLETE: 190_000, Action.PARTIAL: 100_000, Action.SKIP: 10_000}
_INTERACTION: Final = {Action.LIKE: "like", Action.SAVE: "save", Action.SHARE: "share"}
_TITLE_CHARS: Final = 26


# The demo's defaults: below the config file, the environment and the flags.
DEMO_DEFAULTS: Final[dict[str, object]] = {
    "kafka.client_id": "streamrec-demo",
    "group.group_id": "streamrec-demo",
    "group.commit_interval_ms": 200,
    "cache.kv_budget_bytes": 32 << 20,
    "cache.host_tier_bytes": 0,
    "scoring.top_k": 10,
    "http.host": "127.0.0.1",
    "http.port": 0,
    "log.format": "text",
    "log.level": "ERROR",  # the demo prints what matters itself; --log-level for more
}


@dataclass(frozen=True)
class DemoConfig:
    """What the demo replays and how fast."""

    paced_events: int = 3_000
    unpaced_events: int = 7_000
    rate: float = 1_000.0
    users: int = 200
    partitions: int = 4
    watch_users: int = 3
    malformed_every: int = 200  # one malformed record per this many events (0 = none)
    compare_users: int = 32
    seed: int = 1
    ratings: Path | None = None
    synthetic: bool = False
    retrain: bool = False

    def __post_init__(self) -> None:
        counts = (self.paced_events, self.unpaced_events, self.users, self.partitions)
        if min(counts) < 0 or self.users < 1 or self.partitions < 1:
            raise ConfigError(
                f"demo: --num-events {self.paced_events}, --unpaced-events "
                f"{self.unpaced_events}, --users {self.users}, --partitions "
                f"{self.partitions}: need >= 0, >= 0, >= 1, >= 1"
            )
        if self.paced_events + self.unpaced_events < 1:
            raise ConfigError("demo: --num-events + --unpaced-events must be >= 1")
        if self.rate <= 0 or self.watch_users < 0 or self.malformed_every < 0:
            raise ConfigError(
                f"demo: --rate {self.rate} must be > 0, --watch {self.watch_users} >= 0"
            )

    @property
    def events_per_user(self) -> int:
        return -(-(self.paced_events + self.unpaced_events) // self.users)


@dataclass(frozen=True)
class DemoSource:
    """A data set: the log to train on and replay, and display names of its items."""

    name: str  # "movielens" or "synthetic"
    log: InteractionLog
    titles: dict[str, str]
    path: Path | None = None

    def title(self, item_id: str) -> str:
        text = self.titles.get(item_id, item_id)
        return text if len(text) <= _TITLE_CHARS else text[: _TITLE_CHARS - 1] + "…"

    def describe(self) -> str:
        log = self.log
        items = len(np.unique(log.items))
        if self.name == "movielens":
            return (
                f"MovieLens ({log.num_users} users, {log.num_events:,} ratings, {items:,} "
                f"movies) from {self.path}"
            )
        return f"synthetic ({log.num_users} users, {log.num_events:,} events, {items} items)"


def find_movielens() -> Path | None:
    for directory in MOVIELENS_DIRS:
        if (directory / "ratings.csv").is_file():
            return directory / "ratings.csv"
    return None


def read_titles(movies_csv: Path) -> dict[str, str]:
    """``movieId -> title`` from a MovieLens ``movies.csv``; empty if there is none."""
    if not movies_csv.is_file():
        return {}
    try:
        with movies_csv.open(newline="", encoding="utf-8") as fh:
            return {row["movieId"]: row["title"] for row in csv.DictReader(fh)}
    except (OSError, KeyError, csv.Error) as exc:
        raise ModelError(f"cannot read titles from {movies_csv}: {exc}") from exc


def synthetic_source(num_users: int, events_per_user: int, seed: int = 0) -> DemoSource:
    spec = SyntheticSpec(
        num_users=num_users, num_items=200, events_per_user=events_per_user, seed=seed
    )
    return DemoSource("synthetic", synthetic_log(spec), {})


def load_source(
    ratings: Path | None, *, synthetic: bool, users: int, events_per_user: int
) -> DemoSource:
    """``--ratings``, else the shared MovieLens, else (or with ``synthetic``) synthetic."""
    if synthetic:
        return synthetic_source(users, events_per_user)
    path = ratings if ratings is not None else find_movielens()
    if path is None:
        return synthetic_source(users, events_per_user)
    if not path.is_file():
        raise ConfigError(f"--ratings {str(path)!r}: no such file")
    titles = read_titles(path.parent / "movies.csv")
    return DemoSource("movielens", read_movielens(path), titles, path)


def replay_users(log: InteractionLog, users: int, min_events: int) -> list[int]:
    """Up to ``users`` user indices with at least ``min_events`` events (the most active
    ones when too few qualify), in log order."""
    lengths = log.lengths()
    eligible = np.flatnonzero(lengths >= min_events)
    if len(eligible) < users:
        eligible = np.sort(np.argsort(-lengths, kind="stable")[:users])
    return [int(u) for u in eligible[:users]]


def log_to_events(
    log: InteractionLog, limit: int, seed: int = 0, users: list[int] | None = None
) -> list[Event]:
    """At most ``limit`` of the log's tokens (of ``users`` only, if given) as wire events.

    Every user's n-th event comes before anyone's (n+1)-th (random order within a round),
    so a short replay still reaches many users; each user's own events stay in order.
    """
    lengths = log.lengths()
    owner = np.repeat(np.arange(log.num_users), lengths)  # [E]
    rank = np.arange(log.num_events) - np.repeat(log.offsets[:-1], lengths)  # [E]
    chosen = np.arange(log.num_events) if users is None else np.flatnonzero(np.isin(owner, users))
    jitter = np.random.default_rng(seed).random(len(chosen))
    order = chosen[np.lexsort((jitter, rank[chosen]))][:limit]
    return [_event(log, int(owner[i]), i) for i in order.tolist()]


def _event(log: InteractionLog, user: int, i: int) -> Event:
    """Token ``i`` (of ``user``) as a wire event: playback actions become playbacks with a
    matching fraction played, likes/saves/shares interactions, MovieLens VIEW a partial
    playback."""
    name, item = log.users[user], str(log.items[i])
    action, ts = Action(int(log.actions[i])), int(log.ts_ms[i])
    if action in _INTERACTION:
        return InteractionEvent(name, item, ts, _INTERACTION[action])
    played = _PLAYED_MS.get(action, _PLAYED_MS[Action.PARTIAL])
    return PlaybackEvent(name, item, ts, played, _DURATION_MS)
