"""The target's own greedy continuations, for training a draft on-policy.

A speculative draft is only ever asked to continue what the target generated: after the
user's history, every token it reads is an item the target emitted (a rejected proposal
is replaced by the target's item before the next round). Distillation on the data's
windows teaches it the target's next-item distribution after *real* events, which is
not the context it serves in. ``roll_out`` records the contexts it serves in: for cut
points along each user's history it prefills the target's cache with the window before
the cut and generates the target's greedy continuation with the serving ``Generator``
(same retrieval, same exclusion of consumed and emitted items, same positions and
timestamps), so the draft can learn to predict item j + 1 after items 1..j
(Kim & Rush 2016, sequence-level distillation; Zhou et al. 2024, DistillSpec).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

import numpy as np
import torch

from streamrec.errors import ConfigError
from streamrec.models.checkpoint import Checkpoint
from streamrec.offline.datasets import InteractionLog
from streamrec.offline.generation_evaluation import cached_users, gen_model
from streamrec.offline.progress import ProgressBar
from streamrec.pipeline.generation_config import GenerationConfig
from streamrec.pipeline.generator import GenerationInputs, Generator, consumed_rows


@dataclass(frozen=True)
class Rollouts:
    """``windows[i]``: the last events ``[n_i, 3]`` (item row, action, ts_ms) before the
    i-th cut, as many as the draft reads; ``excluded[i]``: the item rows the generator
    excluded there; ``items[i]``: the k item rows the target generated after it."""

    windows: tuple[np.ndarray, ...]
    excluded: tuple[np.ndarray, ...]
    items: np.ndarray  # [S, k] int64 item rows
    action_id: int  # the action the generated items were fed back with
    time_step_ms: int  # generated item j's timestamp: last_ts + j * time_step_ms

    def __len__(self) -> int:
        return len(self.windows)

    @property
    def last_ts(self) -> np.ndarray:
        """[S] int64: the newest event's timestamp before each cut (its window's last)."""
        return np.array([w[-1, 2] for w in self.windows], np.int64)

    @property
    def k(self) -> int:
        return int(self.items.shape[1])


def cut_points(
    lengths: np.ndarray, stride: int, min_context: int, limit: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(user, cut)`` pairs: each history's end, then every ``stride`` events back while
    at least ``min_context`` events remain; a seeded sample of ``limit`` of them when
    there are more (a catalogue's log can hold far more cut points than a draft needs).
    """
    counts = np.where(lengths >= min_context, (lengths - min_context) // stride + 1, 0)
    ends = np.cumsum(counts)  # [U]
    total = int(ends[-1]) if len(ends) else 0
    picks = np.arange(total)
    if total > limit:
        picks = np.sort(np.random.default_rng(seed).choice(total, limit, replace=False))
    users = np.searchsorted(ends, picks, side="right")
    back = picks - (ends[users] - counts[users])  # which cut of the user's, newest first
    return users, lengths[users] - back * stride


@torch.no_grad()
def roll_out(
    target: Checkpoint,
    log: InteractionLog,
    *,
    k: int,
    window: int,
    exclude_recent: int | None = None,
    stride: int = 2,
    min_context: int = 5,
    limit: int = 100_000,
    seed: int = 0,
    action: str = "like",
    batch_size: int = 64,
    progress: TextIO | None = None,
) -> Rollouts:
    """The target's greedy k-item continuation after each cut point (``cut_points``).

    The target sees the last ``max_seq_len`` events before the cut (what the evaluation's
    cache holds, ``generation_evaluation.cached_users``) and never emits the newest
    ``exclude_recent`` of their items (None: all of them, as the offline evaluation
    excludes; a worker excludes its ``scoring.exclude_recent`` newest). Only the last
    ``window`` events and the excluded items are kept, so the memory per rollout does not
    grow with the target's context.
    """
    if stride < 1 or min_context < 1 or limit < 1 or window < 1:
        raise ConfigError(
            f"rollouts: stride={stride}, min_context={min_context}, limit={limit} and "
            f"window={window} must be >= 1"
        )
    if exclude_recent is not None and exclude_recent < 0:
        raise ConfigError(f"rollouts: exclude_recent={exclude_recent} must be >= 0 or None")
    n = target.config.max_seq_len
    rows = target.vocab.lookup(log.items.tolist())
    users, cuts = cut_points(log.lengths(), stride, min_context, limit, seed)
    gen_cfg = GenerationConfig(k=k, action=action)
    windows: list[np.ndarray] = []
    excluded: list[np.ndarray] = []
    generated: list[np.ndarray] = []
    ends = log.offsets[users] + cuts  # [S] one past each context's last event
    starts = np.maximum(log.offsets[users], ends - n)  # [S]
    spans = list(zip(starts.tolist(), ends.tolist(), strict=True))
    keep = len(rows) if exclude_recent is None else exclude_recent  # newest items excluded
    bar = ProgressBar(-(-len(spans) // batch_size), "rollouts", progress)
    for i, lo in enumerate(range(0, len(spans), batch_size)):
        contexts, bans = [], []
        for start, end in spans[lo : lo + batch_size]:
            ctx = np.stack([rows[start:end], log.actions[start:end], log.ts_ms[start:end]], 1)
            contexts.append(ctx)
            bans.append(ctx[max(0, len(ctx) - keep) :, 0])
        generated.append(_generate(target, contexts, bans, gen_cfg))
        windows.extend(c[-window:].copy() for c in contexts)
        excluded.extend(b.copy() for b in bans)
        bar.update(i + 1)
    bar.close()
    return Rollouts(
        windows=tuple(windows),
        excluded=tuple(excluded),
        items=np.concatenate(generated) if generated else np.zeros((0, k), np.int64),
        action_id=gen_cfg.action_id,
        time_step_ms=gen_cfg.time_step_ms,
    )


def _generate(
    target: Checkpoint,
    contexts: list[np.ndarray],
    bans: list[np.ndarray],
    gen_cfg: GenerationConfig,
) -> np.ndarray:
    cache, user_emb = cached_users(target.model, contexts)
    tables, lens = cache.batch_tables([str(b) for b in range(len(contexts))])
    consumed = consumed_rows(bans)  # [B, E]
    last_ts = torch.tensor([int(c[-1, 2]) for c in contexts])
    generator = Generator(gen_model(target), cache.kv, cache.ts, gen_cfg)
    inputs = GenerationInputs(user_emb, tables, lens, last_ts, torch.from_numpy(consumed))
    return generator.generate(inputs).items  # [B, k]


@dataclass(frozen=True)
class RolloutBatch:
    """Draft inputs [B, L] (each context's last ``window`` events, then its generated
    items) and the positions trained: generated item j predicts item j + 1."""

    items: torch.Tensor  # [B, L]
    actions: torch.Tensor  # [B, L]
    ts: torch.Tensor  # [B, L]
    valid: torch.Tensor  # [B, L] bool
    target: torch.Tensor  # [B, L] bool: positions with a next generated item
    next_items: torch.Tensor  # [B, L] the target's item after each position
    excluded: tuple[torch.Tensor, torch.Tensor]  # (row, item) pairs no position may emit


def batches(
    rollouts: Rollouts, batch_size: int, rng: np.random.Generator
) -> Iterator[RolloutBatch]:
    """One shuffled pass over ``rollouts`` in draft training batches.

    ``excluded`` indexes the [P, V] logits of the trained positions (P = ``target.sum()``,
    row-major): position j excludes the rollout's excluded items and generated items
    1..j, which is what the generator's retrieval excludes when the draft proposes j + 1.
    """
    k = rollouts.k
    order = rng.permutation(len(rollouts))
    width = max((len(w) for w in rollouts.windows), default=0) + k
    for lo in range(0, len(order), batch_size):
        picked = order[lo : lo + batch_size]
        b = len(picked)
        items = np.zeros((b, width), np.int64)
        actions = np.zeros((b, width), np.int64)
        ts = np.zeros((b, width), np.int64)
        valid = np.zeros((b, width), bool)
        target = np.zeros((b, width), bool)
        next_items = np.zeros((b, width), np.int64)
        ex_rows: list[np.ndarray] = []
        ex_items: list[np.ndarray] = []
        position = 0  # index of the next trained position in row-major order
        for r, i in enumerate(picked.tolist()):
            win, gen = rollouts.windows[i], rollouts.items[i]
            n = len(win)
            items[r, :n], actions[r, :n], ts[r, :n] = win[:, 0], win[:, 1], win[:, 2]
            items[r, n : n + k] = gen
            actions[r, n : n + k] = rollouts.action_id
            ts[r, n : n + k] = win[-1, 2] + np.arange(1, k + 1) * rollouts.time_step_ms
            valid[r, : n + k] = True
            target[r, n : n + k - 1] = True
            next_items[r, n : n + k - 1] = gen[1:]
            for j in range(1, k):
                banned = np.concatenate([rollouts.excluded[i], gen[:j]])
                ex_rows.append(np.full(len(banned), position, np.int64))
                ex_items.append(banned)
                position += 1
        yield RolloutBatch(
            items=torch.from_numpy(items),
            actions=torch.from_numpy(actions),
            ts=torch.from_numpy(ts),
            valid=torch.from_numpy(valid),
            target=torch.from_numpy(target),
            next_items=torch.from_numpy(next_items),
            excluded=(
                torch.from_numpy(np.concatenate(ex_rows)),
                torch.from_numpy(np.concatenate(ex_items)),
            ),
        )
