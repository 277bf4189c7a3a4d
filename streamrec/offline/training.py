"""Training: sampled-softmax next-item loss plus the multi-task heads, AdamW.

Each user's training part is cut into windows of at most ``seq_len + 1`` tokens starting
at position 0, the positions the cache uses when serving: the model reads the first
``seq_len`` and predicts the next token at every one of them, so the last position an
evaluation or a serving prefill reads (``max_seq_len - 1`` for a long history) is trained
as a target too. At position i the model predicts item i+1 (retrieval: cosine score over
the normalised item table / temperature, against uniformly sampled negatives without
logQ correction, or against the whole catalog with ``num_negatives=0``) and scores item
i+1 as a ranking candidate against the action the user actually took on it (task heads,
BCE).

Splits (``validation=True``, the default): each user's last event is the test target and
never trained on; the second-to-last is the validation target, ranked after every epoch
by the same code as the test (``ranking.py``); the weights of the epoch with the best
validation NDCG@10 are kept, and training stops ``patience`` epochs after it.

A run is a function of its config on the CPU: Python, NumPy and torch are seeded from
``seed``, shuffling and negatives draw from their own generators, the thread count is
fixed (``threads``) and torch's deterministic algorithms are on while it trains.
"""

from __future__ import annotations

import copy
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

import numpy as np
import torch
import torch.nn.functional as F

from streamrec.errors import ConfigError
from streamrec.models.checkpoint import save_checkpoint
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU, HSTULayer
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.offline.datasets import InteractionLog
from streamrec.offline.progress import ProgressBar
from streamrec.offline.ranking import Ranker, UserMetrics, rank_held_out
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
    # Hold out each user's second-to-last event; keep the best epoch by its NDCG@10 and
    # stop ``patience`` epochs after it (0: run every epoch, still keep the best). 3, not
    # 2: on MovieLens-small's 610 users the validation figure dips for an epoch or two
    # early on (SASRec seed 1: 0.0134, 0.0074, 0.0102, ...) before it climbs again.
    validation: bool = True
    patience: int = 3
    time_bias: bool = True  # False: the layers' time bias is zero and frozen (ablation)
    # torch CPU threads while training (0 = leave torch's setting). 1 by default: the
    # weights then do not depend on the machine's core count (a reduction's order does),
    # and this model size gains little from more (2 threads beside a busy core: 40x
    # slower, OpenMP waits for the descheduled thread).
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "seq_len", "num_negatives", "patience", "threads"):
            value = getattr(self, name)
            low = 0 if name in ("num_negatives", "patience", "threads") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"TrainConfig.{name}={value!r} must be an int >= {low}")
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
    best_epoch: int = 0  # 1-based epoch kept by validation (0: no validation split)

    @classmethod
    def of(
        cls, out_dir: Path | str, version: str, stats: FitStats, vocab: ItemVocabulary,
        num_users: int, epochs: int | None = None,
    ) -> TrainResult:  # fmt: skip
        """The result of a run whose ``fit`` returned ``stats`` (epochs: ``stats``' own
        unless given)."""
        return cls(
            model_dir=Path(out_dir),
            model_version=version,
            epochs=stats.epochs if epochs is None else epochs,
            steps=stats.steps,
            final_loss=stats.final_loss,
            seconds=stats.seconds,
            tokens_per_s=stats.tokens / max(stats.seconds, 1e-9),
            num_users=num_users,
            num_items=vocab.size - vocab.first_item_row,
            best_epoch=stats.best_epoch,
        )


def _windows(lengths: np.ndarray, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """(user, start, end) windows of at most ``seq_len + 1`` tokens covering every transition.

    A window's tokens start..end-2 are the inputs (positions 0..), start+1..end-1 the
    targets. The newest window of a user ends at the user's last token with a full
    context, as evaluation reads it; the next one overlaps it by ``1 + shift`` tokens
    (``shift`` drawn per user and epoch), all older ones by one token, so the cut points
    move between epochs while every transition is still trained (the ``shift`` in the
    first overlap twice, with different contexts).
    """
    out: list[tuple[int, int, int]] = []
    for user, n in enumerate(lengths.tolist()):
        end = n
        shift = int(rng.integers(seq_len - 1)) if n > seq_len + 1 else 0
        while end >= 2:
            start = max(0, end - seq_len - 1)
            out.append((user, start, end))
            if start == 0:
                break
            end = min(start + 1 + shift, end - 1)
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
    width = int((windows[:, 2] - windows[:, 1]).max()) - 1
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
        n = hi - lo - 1  # inputs; each has its next token as target
        out["items"][r, :n] = rows[lo : hi - 1]
        out["actions"][r, :n] = actions[lo : hi - 1]
        out["ts"][r, :n] = ts[lo : hi - 1]
        out["next_items"][r, :n] = rows[lo + 1 : hi]
        out["next_actions"][r, :n] = actions[lo + 1 : hi]
        out["valid"][r, :n] = True
        out["target"][r, :n] = True
    return {k: torch.from_numpy(v) for k, v in out.items()}


class ModelShape(Protocol):
    @property
    def num_items(self) -> int: ...

    @property
    def first_item_row(self) -> int: ...

    @property
    def task_names(self) -> tuple[str, ...]: ...


class NextItemModel(Protocol):
    """What the loss needs: HSTU, or the SASRec-style baseline (which has no task heads)."""

    @property
    def config(self) -> ModelShape: ...

    def train_forward(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        valid: torch.Tensor,
        next_items: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def item_table(self) -> torch.Tensor: ...


def next_item_loss(
    model: NextItemModel, batch: dict[str, torch.Tensor], cfg: TrainConfig, gen: torch.Generator
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


LossFn = Callable[[Any, dict[str, torch.Tensor], torch.Generator], torch.Tensor]
Validator = Callable[[], float]


@dataclass(frozen=True)
class FitStats:
    steps: int
    tokens: int
    final_loss: float
    seconds: float
    epochs: int = 0  # epochs run (early stopping may end before cfg.epochs)
    best_epoch: int = 0  # 1-based epoch whose weights were kept (0: the last, unvalidated)
    validation: tuple[float, ...] = ()  # validation NDCG@10 after each epoch


class TrainingSteps:
    """AdamW over a model's trainable parameters, and the running figures every training
    loop here reports (steps, tokens, the loss's moving average, time): one place for the
    update, whatever each loop batches and minimises."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        self._opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        self._started = time.monotonic()
        self.steps = 0
        self.tokens = 0
        self.loss_avg = float("nan")

    def step(self, loss: torch.Tensor, tokens: int) -> None:
        self._opt.zero_grad(set_to_none=True)
        loss.backward()
        self._opt.step()
        self.steps += 1
        self.tokens += tokens
        value = float(loss.detach())
        self.loss_avg = value if self.steps == 1 else 0.95 * self.loss_avg + 0.05 * value

    def tokens_per_s(self) -> float:
        return self.tokens / max(time.monotonic() - self._started, 1e-9)

    def stats(self, epochs: int, **extra: Any) -> FitStats:
        seconds = time.monotonic() - self._started
        return FitStats(self.steps, self.tokens, self.loss_avg, seconds, epochs=epochs, **extra)


@contextmanager
def deterministic(seed: int, threads: int, device: str) -> Iterator[None]:
    """Seed every RNG from ``seed``, fix the thread count, and (CPU) allow only
    deterministic kernels; the previous thread count and algorithm mode come back after.

    Without this a run's weights depended on whatever the process had drawn before and on
    how many threads torch picked (issue 22: same seed, two model versions).
    """
    prev_threads = torch.get_num_threads()
    prev_mode = torch.are_deterministic_algorithms_enabled()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if threads:
        torch.set_num_threads(threads)
    if torch.device(device).type == "cpu":
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev_mode)
        torch.set_num_threads(prev_threads)


def fit(
    model: torch.nn.Module,
    part: InteractionLog,
    rows: np.ndarray,
    cfg: TrainConfig,
    loss_fn: LossFn,
    progress: TextIO | None,
    validate: Validator | None = None,
) -> FitStats:
    """AdamW over up to ``cfg.epochs`` of shuffled windows of ``part`` (item rows ``rows``).

    The loop of every training here (HSTU, the SASRec baseline, a distilled draft):
    windows are cut afresh each epoch from ``cfg.seed``'s generator. With ``validate``
    (a score, higher is better) the best epoch's weights are loaded back at the end and
    the loop stops ``cfg.patience`` epochs after it (never, with patience 0).
    """
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    run = TrainingSteps(model, cfg.lr, cfg.weight_decay)
    scores: list[float] = []
    best_state: dict[str, torch.Tensor] | None = None
    best_epoch = 0
    for epoch in range(cfg.epochs):
        windows = _windows(part.lengths(), cfg.seq_len, rng)
        windows = windows[rng.permutation(len(windows))]
        n_batches = -(-len(windows) // cfg.batch_size)
        bar = ProgressBar(n_batches, f"epoch {epoch + 1}/{cfg.epochs}", progress)
        model.train()
        for i in range(n_batches):
            chunk = windows[i * cfg.batch_size : (i + 1) * cfg.batch_size]
            batch = _batch(chunk, part.offsets, rows, part.actions, part.ts_ms)
            batch = {k: v.to(device) for k, v in batch.items()}
            run.step(loss_fn(model, batch, gen), int(batch["valid"].sum()))
            bar.update(i + 1, loss=run.loss_avg, tok_s=run.tokens_per_s())
        bar.close()
        if validate is None:
            continue
        model.eval()
        scores.append(validate())
        if progress is not None:
            progress.write(f"epoch {epoch + 1}: validation NDCG@10 {scores[-1]:.4f}\n")
        if best_state is None or scores[-1] > scores[best_epoch - 1]:
            best_epoch = epoch + 1
            best_state = copy.deepcopy(model.state_dict())
        elif cfg.patience and epoch + 1 - best_epoch >= cfg.patience:
            break
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    return run.stats(epochs=epoch + 1, best_epoch=best_epoch, validation=tuple(scores))


@dataclass(frozen=True)
class TrainingData:
    """What one run trains and validates on (``prepare``)."""

    vocab: ItemVocabulary
    part: InteractionLog  # the events trained on
    rows: np.ndarray  # [E] item rows of ``part``
    validation: InteractionLog | None  # leave_last_out of it: history = part, target = val


def prepare(log: InteractionLog, cfg: TrainConfig) -> TrainingData:
    """Vocabulary of the whole log (the catalog) and the split ``cfg`` asks for."""
    vocab = ItemVocabulary.build(log.items.tolist(), cfg.num_oov_buckets)
    validation = log.without_last() if cfg.validation else None
    part = (validation if validation is not None else log).without_last()
    return TrainingData(vocab, part, vocab.lookup(part.items.tolist()), validation)


def validator(model: Ranker, data: TrainingData, cfg: TrainConfig, k: int = 10) -> Validator | None:
    """Validation NDCG@k of ``model`` as it is now (None without a validation split)."""
    validation = data.validation
    if validation is None:
        return None

    def score() -> float:
        ranks = rank_held_out(
            model, data.vocab, validation, max_seq_len=cfg.max_seq_len, device=cfg.device
        )
        return float(UserMetrics.from_ranks(ranks.model, k).ndcg.mean())

    return score


def training_meta(cfg: TrainConfig, stats: FitStats, data: TrainingData) -> dict[str, Any]:
    """``meta.json``'s ``training`` entry: the config and what the run did."""
    return {
        **asdict(cfg),
        "steps": stats.steps,
        "final_loss": stats.final_loss,
        "seconds": round(stats.seconds, 2),
        "epochs_run": stats.epochs,
        "best_epoch": stats.best_epoch,
        "validation_ndcg10": list(stats.validation),
        "threads_used": torch.get_num_threads(),
        "num_users": data.part.num_users,
        "num_train_events": data.part.num_events,
    }


def train(
    log: InteractionLog,
    out_dir: Path | str,
    config: TrainConfig | None = None,
    *,
    progress: TextIO | None = sys.stderr,
) -> TrainResult:
    """Train an HSTU on ``log`` minus its held-out events and write a model directory.

    The vocabulary is the whole log's item set (the catalog); items seen only in the
    held-out events keep their untrained initial embedding.
    """
    cfg = config or TrainConfig()
    with deterministic(cfg.seed, cfg.threads, cfg.device):
        data = prepare(log, cfg)
        model_cfg = cfg.model_config(data.vocab.size)
        unknown = [t for t in model_cfg.task_names if t not in TASK_ACTIONS]
        if unknown:
            raise ConfigError(
                f"task(s) {unknown} have no label rule; known: {sorted(TASK_ACTIONS)}"
            )
        model = HSTU(model_cfg).to(torch.device(cfg.device)).train()
        if not cfg.time_bias:
            for layer in model.layers:
                assert isinstance(layer, HSTULayer)
                layer.time_bias.data.zero_()
                layer.time_bias.requires_grad_(False)

        def loss_fn(m: HSTU, batch: dict[str, torch.Tensor], gen: torch.Generator) -> torch.Tensor:
            return next_item_loss(m, batch, cfg, gen)

        validate = validator(model, data, cfg)
        stats = fit(model, data.part, data.rows, cfg, loss_fn, progress, validate)
        meta = {"model_name": cfg.model_name, "training": training_meta(cfg, stats, data)}
    version = save_checkpoint(out_dir, model.eval().to("cpu"), data.vocab, meta)
    return TrainResult.of(out_dir, version, stats, data.vocab, data.part.num_users)
