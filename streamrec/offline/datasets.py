"""Offline interaction logs: per-user token sequences for training and evaluation.

Both sources (MovieLens-format CSV and the synthetic generator) produce the same
``InteractionLog``: one jagged array of tokens ``(item id, action, ts_ms)`` per user,
oldest first, using the same ``Action`` values the live worker derives from events.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamrec.errors import ConfigError, ModelError
from streamrec.schemas.events import Action, rating_action


@dataclass(frozen=True)
class InteractionLog:
    """Users' token sequences as one jagged batch; user u owns offsets[u]:offsets[u+1]."""

    users: tuple[str, ...]
    offsets: np.ndarray  # [U+1] int64
    items: np.ndarray  # [E] str (external item ids)
    actions: np.ndarray  # [E] int64 (Action values)
    ts_ms: np.ndarray  # [E] int64

    def __post_init__(self) -> None:
        n = len(self.items)
        if self.offsets.shape != (len(self.users) + 1,) or self.offsets[0] != 0:
            raise ModelError(
                f"InteractionLog: offsets shape {self.offsets.shape} for {len(self.users)} users"
            )
        if int(self.offsets[-1]) != n or len(self.actions) != n or len(self.ts_ms) != n:
            raise ModelError(
                f"InteractionLog: offsets end {int(self.offsets[-1])}, items {n}, "
                f"actions {len(self.actions)}, ts {len(self.ts_ms)} must agree"
            )

    @property
    def num_users(self) -> int:
        return len(self.users)

    @property
    def num_events(self) -> int:
        return len(self.items)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def user_slice(self, u: int) -> slice:
        return slice(int(self.offsets[u]), int(self.offsets[u + 1]))

    def leave_last_out(self) -> tuple[InteractionLog, InteractionLog]:
        """(all but each user's last event, the last events) for users with ≥ 2 events."""
        lens = self.lengths()
        keep = np.flatnonzero(lens >= 2)
        ends = self.offsets[keep + 1]
        mask = np.zeros(self.num_events, dtype=bool)
        for u in keep:
            mask[self.offsets[u] : self.offsets[u + 1] - 1] = True
        users = tuple(self.users[u] for u in keep)
        train = InteractionLog(
            users=users,
            offsets=np.concatenate([[0], np.cumsum(lens[keep] - 1)]).astype(np.int64),
            items=self.items[mask],
            actions=self.actions[mask],
            ts_ms=self.ts_ms[mask],
        )
        last = ends - 1
        test = InteractionLog(
            users=users,
            offsets=np.arange(len(keep) + 1, dtype=np.int64),
            items=self.items[last],
            actions=self.actions[last],
            ts_ms=self.ts_ms[last],
        )
        return train, test

    def subset(self, users: np.ndarray) -> InteractionLog:
        """The histories of ``users`` (indices, in the order given)."""
        lens = self.lengths()[users]
        index = np.concatenate(
            [np.arange(self.offsets[u], self.offsets[u + 1]) for u in users.tolist()]
            or [np.zeros(0, np.int64)]
        )
        return InteractionLog(
            users=tuple(self.users[u] for u in users.tolist()),
            offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            items=self.items[index],
            actions=self.actions[index],
            ts_ms=self.ts_ms[index],
        )

    def without_last(self) -> InteractionLog:
        """Each user's events but the last (users with ≥ 2 events): the validation log.

        Its ``leave_last_out`` holds out the second-to-last event of every user (the
        validation target) and leaves the events training may see; the last event stays
        untouched for the test figures.
        """
        return self.leave_last_out()[0]


def _from_events(
    users: np.ndarray, items: np.ndarray, actions: np.ndarray, ts_ms: np.ndarray
) -> InteractionLog:
    """Group flat events by user (first-seen user order), each user sorted by time (stable)."""
    names, first, codes = np.unique(users, return_index=True, return_inverse=True)
    rank = np.empty(len(names), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(names))
    user_rank = rank[codes]
    order = np.lexsort((np.arange(len(items)), ts_ms, user_rank))
    counts = np.bincount(user_rank, minlength=len(names))
    return InteractionLog(
        users=tuple(str(n) for n in names[np.argsort(first, kind="stable")]),
        offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        items=items[order],
        actions=actions[order].astype(np.int64),
        ts_ms=ts_ms[order].astype(np.int64),
    )


def read_movielens(path: Path | str) -> InteractionLog:
    """MovieLens ``ratings.csv`` (userId,movieId,rating,timestamp in seconds).

    rating ≥ 4 is LIKE, anything lower VIEW; timestamps become milliseconds.
    """
    src = Path(path)
    users: list[str] = []
    items: list[str] = []
    actions: list[int] = []
    ts: list[int] = []
    try:
        with src.open(newline="") as fh:
            reader = csv.DictReader(fh)
            need = {"userId", "movieId", "rating", "timestamp"}
            if reader.fieldnames is None or not need <= set(reader.fieldnames):
                raise ModelError(f"{src}: header {reader.fieldnames} lacks {sorted(need)}")
            for line, row in enumerate(reader, start=2):
                try:
                    action = int(rating_action(float(row["rating"])))
                    stamp = int(row["timestamp"]) * 1000
                except ValueError as exc:
                    raise ModelError(f"{src}:{line}: bad rating/timestamp in {row}") from exc
                users.append(row["userId"])
                items.append(row["movieId"])
                actions.append(action)
                ts.append(stamp)
    except OSError as exc:
        raise ModelError(f"cannot read ratings file {src}: {exc}") from exc
    return _from_events(
        np.array(users), np.array(items), np.array(actions), np.array(ts, dtype=np.int64)
    )


@dataclass(frozen=True)
class SyntheticSpec:
    """A catalog cut into chains; users walk their favourite chains item by item.

    The next item is the chain successor with probability ``follow``, so a sequence model
    can predict it from the previous item while a popularity ranking cannot. Chains are
    picked with a Zipf skew so the popularity baseline is not trivially zero. Actions
    depend on the item (LIKE / COMPLETE / SKIP) so the task heads have signal too.
    """

    num_users: int = 400
    num_items: int = 300
    chain_len: int = 10
    events_per_user: int = 40
    chains_per_user: int = 3
    follow: float = 0.9
    zipf: float = 1.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_items < self.chain_len or self.chain_len < 2:
            raise ConfigError(
                f"SyntheticSpec: num_items={self.num_items} chain_len={self.chain_len} "
                "needs num_items >= chain_len >= 2"
            )
        if self.num_users < 1 or self.events_per_user < 2 or self.chains_per_user < 1:
            raise ConfigError(
                f"SyntheticSpec: num_users={self.num_users} events_per_user="
                f"{self.events_per_user} chains_per_user={self.chains_per_user} too small"
            )
        if not 0.0 <= self.follow <= 1.0:
            raise ConfigError(f"SyntheticSpec: follow={self.follow} must be in [0, 1]")


def synthetic_log(spec: SyntheticSpec | None = None) -> InteractionLog:
    """Deterministic (from ``spec.seed``) log with planted sequential structure."""
    spec = spec or SyntheticSpec()
    rng = np.random.default_rng(spec.seed)
    num_chains = spec.num_items // spec.chain_len
    weights = 1.0 / np.arange(1, num_chains + 1) ** spec.zipf
    weights /= weights.sum()
    item_action = np.array([Action.LIKE, Action.COMPLETE, Action.COMPLETE, Action.SKIP])
    n = spec.events_per_user
    users, items, actions, stamps = [], [], [], []
    for u in range(spec.num_users):
        chains = rng.choice(num_chains, size=spec.chains_per_user, replace=False, p=weights)
        chain = int(rng.choice(chains))
        step = int(rng.integers(spec.chain_len))
        ts = 1_600_000_000_000 + int(rng.integers(10**10))
        for e in range(n):
            if e > 0 and rng.random() < spec.follow:
                step = (step + 1) % spec.chain_len
                ts += int(rng.integers(60_000, 600_000))
            elif e > 0:
                chain = int(rng.choice(chains))
                step = int(rng.integers(spec.chain_len))
                ts += int(rng.integers(3_600_000, 86_400_000))
            item = chain * spec.chain_len + step
            action = item_action[item % 4] if rng.random() < 0.9 else Action.PARTIAL
            users.append(f"u{u}")
            items.append(f"s{item}")
            actions.append(int(action))
            stamps.append(ts)
    return _from_events(
        np.array(users), np.array(items), np.array(actions), np.array(stamps, dtype=np.int64)
    )
