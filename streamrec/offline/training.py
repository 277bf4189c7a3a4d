"""Training: sampled-softmax next-item loss plus the multi-task heads, AdamW.

Each user's training part (all but the last event, which evaluation holds out) is cut
into windows of at most ``seq_len`` tokens starting at position 0, the same positions the
cache uses when serving. At position i the model predicts item i+1 (retrieval: cosine
score over the normalised item table / temperature, against uniformly sampled negatives
without logQ correction, or against the whole catalog with ``num_negatives=0``) and
scores item i+1 as a ranking candidate against the action the user actually took on it
(task heads, BCE).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import torch
import torch.nn.functional as F

from streamrec.errors import ConfigError
from streamrec.models.checkpoint import save_checkpoint
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.offline.datasets import InteractionLog
from streamrec.offline.progress import ProgressBar
from streamrec.schemas.events import Action

# Which next-token actions make a task's label 1.
TASK_ACTIONS: dict[str, frozenset[int]] = {
    "complete": frozenset({int(Action.COMPLETE)}),
    "skip": frozenset({int(Action.SKIP)}),
    "like": frozenset({int(Action.LIKE)}),
    "save": frozenset({int(Action.SAVE), int(Action.ADD_TO_PLAYLIST)}),
    "share": frozenset({int(Action.SHARE)}),
}


@dataclass(frozen=True)
class TrainConfig:
    """Model shape and optimisation knobs of one training run."""

    # Defaults are the MovieLens-small run of BENCHMARKS.md (HR@10, NDCG@10 > 2x most-pop).
    epochs: int = 10
    batch_size: int = 32
    seq_len: int = 50
    lr: float = 5e-3
    weight_decay: float = 0.01
    num_negatives: int = 0  # uniform sampled negatives per step; 0 = full softmax
    temperature: float = 0.05
    task_weight: float = 0.2
    seed: int = 0
    device: str = "cpu"
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 32
    max_seq_len: int = 50
    dropout: float = 0.2
    num_oov_buckets: int = 16
    model_name: str = "hstu"

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "seq_len", "num_negatives"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "num_negatives" else 1):
                raise ConfigError(f"TrainConfig.{name}={value!r} must be a positive int")
        if self.seq_len < 2 or self.seq_len > self.max_seq_len:
            raise ConfigError(
                f"TrainConfig.seq_len={self.seq_len} must be in [2, max_seq_len={self.max_seq_len}]"
            )
        for name in ("lr", "temperature"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"TrainConfig.{name}={getattr(self, name)!r} must be > 0")
        if self.weight_decay < 0 or self.task_weight < 0:
            raise ConfigError(
                f"TrainConfig.weight_decay={self.weight_decay} task_weight={self.task_weight}"
                " must be >= 0"
            )

    def model_config(self, num_items: int) -> HSTUConfig:
        return HSTUConfig(
            num_items=num_items,
            num_oov_buckets=self.num_oov_buckets,
            d_model=self.d_model,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            max_seq_len=self.max_seq_len,
            task_hidden=self.d_model,
            dropout=self.dropout,
        )


@dataclass(frozen=True)
class TrainResult:
    model_dir: Path
    model_version: str
    epochs: int
    steps: int
    final_loss: float
    seconds: float
    tokens_per_s: float
    num_users: int
    num_items: int


def _windows(lengths: np.ndarray, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """(user, start, end) windows covering every transition; the cut points move per epoch.

    Consecutive windows overlap by one token so the pair across a cut is still trained.
    """
    out: list[tuple[int, int, int]] = []
    for user, n in enumerate(lengths.tolist()):
        end = n
        shift = int(rng.integers(seq_len - 1)) if n > seq_len else 0
        while end >= 2:
            start = max(0, end - seq_len)
            out.append((user, start, end))
            end = start + 1 - (shift if start > 0 else 0)
            shift = 0
    return np.array(out, dtype=np.int64).reshape(-1, 3)


def _batch(
    windows: np.ndarray,
    offsets: np.ndarray,
    rows: np.ndarray,
    actions: np.ndarray,
    ts: np.ndarray,
) -> dict[str, torch.Tensor]:
    """Left-aligned padded batch: inputs [B, L] and the next token at each position."""
    width = int((windows[:, 2] - windows[:, 1]).max())
    b = len(windows)
    out = {
        "items": np.zeros((b, width), np.int64),
        "actions": np.zeros((b, width), np.int64),
        "ts": np.zeros((b, width), np.int64),
        "next_items": np.zeros((b, width), np.int64),
        "next_actions": np.zeros((b, width), np.int64),
        "valid": np.zeros((b, width), bool),
        "target": np.zeros((b, width), bool),
    }
    for r, (user, start, end) in enumerate(windows.tolist()):
        lo, hi = offsets[user] + start, offsets[user] + end
        n = hi - lo
        out["items"][r, :n] = rows[lo:hi]
        out["actions"][r, :n] = actions[lo:hi]
        out["ts"][r, :n] = ts[lo:hi]
        out["next_items"][r, : n - 1] = rows[lo + 1 : hi]
        out["next_actions"][r, : n - 1] = actions[lo + 1 : hi]
        out["valid"][r, :n] = True
        out["target"][r, : n - 1] = True
    return {k: torch.from_numpy(v) for k, v in out.items()}


def _loss(
    model: HSTU, batch: dict[str, torch.Tensor], cfg: TrainConfig, gen: torch.Generator
) -> torch.Tensor:
    with_tasks = cfg.task_weight > 0
    user, task_logits = model.train_forward(
        batch["items"],
        batch["actions"],
        batch["ts"],
        batch["valid"],
        batch["next_items"] if with_tasks else None,
    )  # [B, L, D], [B, L, tasks] | None
    target = batch["target"]
    u = user[target]  # [P, D]
    tgt = batch["next_items"][target]  # [P]
    table = model.item_table()  # [V, D]
    first = model.config.first_item_row
    if cfg.num_negatives == 0:  # full softmax over every retrievable row
        logits = (u / cfg.temperature) @ table[first:].t()  # [P, V - first]
        retrieval = F.cross_entropy(logits, tgt - first)
    else:
        negs = torch.randint(first, model.config.num_items, (cfg.num_negatives,), generator=gen)
        negs = negs.to(u.device)
        pos_logit = (u * table[tgt]).sum(-1, keepdim=True)  # [P, 1]
        neg_logit = u @ table[negs].t()  # [P, R]
        neg_logit = neg_logit.masked_fill(negs.unsqueeze(0) == tgt.unsqueeze(1), float("-inf"))
        logits = torch.cat([pos_logit, neg_logit], dim=1) / cfg.temperature
        zero = torch.zeros(len(tgt), dtype=torch.int64, device=u.device)
        retrieval = F.cross_entropy(logits, zero)
    if task_logits is None:
        return retrieval
    next_actions = batch["next_actions"][target]  # [P]
    labels = torch.stack(
        [
            torch.isin(next_actions, torch.tensor(sorted(TASK_ACTIONS[t]), device=u.device))
            for t in model.config.task_names
        ],
        dim=1,
    ).to(task_logits.dtype)  # [P, tasks]
    tasks = F.binary_cross_entropy_with_logits(task_logits[target], labels)
    return retrieval + cfg.task_weight * tasks


LossFn = Callable[[HSTU, dict[str, torch.Tensor], torch.Generator], torch.Tensor]


@dataclass(frozen=True)
class FitStats:
    steps: int
    tokens: int
    final_loss: float
    seconds: float


def fit(
    model: HSTU,
    part: InteractionLog,
    rows: np.ndarray,
    cfg: TrainConfig,
    loss_fn: LossFn,
    progress: TextIO | None,
) -> FitStats:
    """AdamW over ``cfg.epochs`` of shuffled windows of ``part`` (item rows ``rows``).

    The loop of every training here (the model, and a draft distilled from it): windows
    are cut afresh each epoch from ``cfg.seed``'s generator, so a run is deterministic.
    """
    started = time.monotonic()
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = 0
    tokens = 0
    loss_avg = float("nan")
    for epoch in range(cfg.epochs):
        windows = _windows(part.lengths(), cfg.seq_len, rng)
        windows = windows[rng.permutation(len(windows))]
        n_batches = -(-len(windows) // cfg.batch_size)
        bar = ProgressBar(n_batches, f"epoch {epoch + 1}/{cfg.epochs}", progress)
        for i in range(n_batches):
            chunk = windows[i * cfg.batch_size : (i + 1) * cfg.batch_size]
            batch = _batch(chunk, part.offsets, rows, part.actions, part.ts_ms)
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = loss_fn(model, batch, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
            tokens += int(batch["valid"].sum())
            value = float(loss.detach())
            loss_avg = value if steps == 1 else 0.95 * loss_avg + 0.05 * value
            elapsed = max(time.monotonic() - started, 1e-9)
            bar.update(i + 1, loss=loss_avg, tok_s=tokens / elapsed)
        bar.close()
    return FitStats(steps, tokens, loss_avg, time.monotonic() - started)


def train(
    log: InteractionLog,
    out_dir: Path | str,
    config: TrainConfig | None = None,
    *,
    progress: TextIO | None = sys.stderr,
) -> TrainResult:
    """Train on every user's events but the last (held out) and write a model directory.

    The vocabulary is the whole log's item set (the catalog); items seen only in the
    held-out events keep their untrained initial embedding.
    """
    cfg = config or TrainConfig()
    torch.manual_seed(cfg.seed)
    vocab = ItemVocabulary.build(log.items.tolist(), cfg.num_oov_buckets)
    model_cfg = cfg.model_config(vocab.size)
    unknown = [t for t in model_cfg.task_names if t not in TASK_ACTIONS]
    if unknown:
        raise ConfigError(f"task(s) {unknown} have no label rule; known: {sorted(TASK_ACTIONS)}")
    part, _ = log.leave_last_out()
    rows = vocab.lookup(part.items.tolist())
    model = HSTU(model_cfg).to(torch.device(cfg.device)).train()

    def loss_fn(m: HSTU, batch: dict[str, torch.Tensor], gen: torch.Generator) -> torch.Tensor:
        return _loss(m, batch, cfg, gen)

    stats = fit(model, part, rows, cfg, loss_fn, progress)
    meta = {
        "model_name": cfg.model_name,
        "training": {
            **asdict(cfg),
            "steps": stats.steps,
            "final_loss": stats.final_loss,
            "seconds": round(stats.seconds, 2),
            "num_users": part.num_users,
            "num_train_events": part.num_events,
        },
    }
    version = save_checkpoint(out_dir, model.eval().to("cpu"), vocab, meta)
    return TrainResult(
        model_dir=Path(out_dir),
        model_version=version,
        epochs=cfg.epochs,
        steps=stats.steps,
        final_loss=stats.final_loss,
        seconds=stats.seconds,
        tokens_per_s=stats.tokens / max(stats.seconds, 1e-9),
        num_users=part.num_users,
        num_items=vocab.size - vocab.first_item_row,
    )
