"""A draft model for speculative generation, distilled from a trained target.

The draft is an HSTU with fewer layers over the target's exact vocabulary (same rows, so
its guesses are item rows the target can verify). It learns from the same windows of the
same data as the target: cross-entropy on the true next item, plus the KL divergence from
the target's next-item distribution (cosine / temperature over the whole catalog) to its
own, which is what the speculative acceptance rate rewards (Hinton et al. 2015). It starts
from the target's item and action embeddings when the widths match.

The model directory records what it was distilled from (``meta.json`` ``draft_of``: the
target's model version and vocabulary hash); ``models.draft.load_draft`` refuses a pair
that does not match.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TextIO

import numpy as np
import torch
import torch.nn.functional as F

from streamrec.errors import ConfigError
from streamrec.models.checkpoint import load_checkpoint, save_checkpoint
from streamrec.models.draft import draft_meta
from streamrec.models.hstu import HSTU, HSTULayer
from streamrec.offline.datasets import InteractionLog
from streamrec.offline.progress import ProgressBar
from streamrec.offline.rollouts import Rollouts, batches, roll_out
from streamrec.offline.training import (
    FitStats,
    TrainConfig,
    TrainingSteps,
    TrainResult,
    deterministic,
    fit,
)
from streamrec.pipeline.draft_catalog import save_draft_items
from streamrec.pipeline.generation_config import GenerationConfig


@dataclass(frozen=True)
class DraftConfig:
    """The draft's shape (unset: the target's) and the distillation knobs."""

    num_layers: int = 1
    d_model: int | None = None
    num_heads: int | None = None
    head_dim: int | None = None
    # Positions: a draft re-encodes the last max_seq_len - k - gamma - 1 tokens, so one
    # longer than the target's sees as much history as the target does.
    max_seq_len: int | None = None
    distill_weight: float = 0.8  # share of the KL term; the rest is the true-item CE
    distill_temperature: float = 1.0  # softens both distributions (on top of the cosine one)
    # Start from the target's embeddings, and (init_layers) its first layers and output
    # norm: the draft then begins as the target cut short, where shapes allow.
    init_embeddings: bool = True
    init_layers: bool = True
    # On-policy phase (``offline/rollouts.py``): after distillation on the data, train on
    # the target's own greedy continuations of rollout_k items after cut points every
    # rollout_stride events (at most rollout_contexts of them), rollout_epochs passes at
    # rollout_lr. The contexts the draft serves in are these, not the data's; on
    # MovieLens-small it raised the acceptance on users it never saw from 0.28 to 0.50
    # (BENCHMARKS.md, issue 19). rollout_k = 0 turns the phase off.
    rollout_k: int = 20
    rollout_stride: int = 2
    rollout_contexts: int = 100_000
    rollout_epochs: int = 4
    rollout_lr: float = 1e-3
    # Items the target may not emit at a cut: its newest rollout_exclude_recent items
    # (None: every item of its context, as the offline evaluation excludes). A draft for a
    # worker that excludes scoring.exclude_recent items learns best with the same value.
    rollout_exclude_recent: int | None = None

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ConfigError(f"DraftConfig.num_layers={self.num_layers} must be >= 1")
        for name in ("d_model", "num_heads", "head_dim", "max_seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"DraftConfig.{name}={value} must be >= 1 or unset")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ConfigError(f"DraftConfig.distill_weight={self.distill_weight} not in [0, 1]")
        for name in ("rollout_k", "rollout_epochs"):
            if getattr(self, name) < 0:
                raise ConfigError(f"DraftConfig.{name}={getattr(self, name)} must be >= 0")
        for name in ("rollout_stride", "rollout_contexts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"DraftConfig.{name}={getattr(self, name)} must be >= 1")
        if self.rollout_exclude_recent is not None and self.rollout_exclude_recent < 0:
            raise ConfigError(
                f"DraftConfig.rollout_exclude_recent={self.rollout_exclude_recent} must be "
                ">= 0 or unset"
            )
        if not self.rollout_lr > 0:
            raise ConfigError(f"DraftConfig.rollout_lr={self.rollout_lr} must be > 0")
        if not self.distill_temperature > 0:
            raise ConfigError(
                f"DraftConfig.distill_temperature={self.distill_temperature} must be > 0"
            )


def _draft_loss(
    draft: HSTU,
    target: HSTU,
    batch: dict[str, torch.Tensor],
    train_cfg: TrainConfig,
    draft_cfg: DraftConfig,
) -> torch.Tensor:
    """(1 - w) * CE(true next item) + w * T^2 * KL(target || draft) over retrievable rows."""
    first = draft.config.first_item_row
    # positions with a next item in the vocabulary (an unknown id maps to an OOV row)
    target_mask = batch["target"] & (batch["next_items"] >= first)  # [B, L]
    with torch.no_grad():
        t_user, _ = target.train_forward(
            batch["items"], batch["actions"], batch["ts"], batch["valid"], None
        )  # [B, L, D_t]
        t_logits = (t_user[target_mask] / train_cfg.temperature) @ target.item_table()[first:].t()
    d_user, _ = draft.train_forward(
        batch["items"], batch["actions"], batch["ts"], batch["valid"], None
    )  # [B, L, D_d]
    d_logits = (d_user[target_mask] / train_cfg.temperature) @ draft.item_table()[first:].t()
    ce = F.cross_entropy(d_logits, batch["next_items"][target_mask] - first)
    temp = draft_cfg.distill_temperature
    kl = F.kl_div(
        F.log_softmax(d_logits / temp, dim=-1),
        F.log_softmax(t_logits / temp, dim=-1),
        log_target=True,
        reduction="batchmean",
    )
    w = draft_cfg.distill_weight
    return (1.0 - w) * ce + w * temp * temp * kl


@torch.no_grad()
def _init_from(draft: HSTU, target: HSTU, cfg: DraftConfig) -> None:
    """Copy what fits of the target into the draft (embeddings; first layers and norm)."""
    d, t = draft.config, target.config
    if d.d_model != t.d_model:
        return
    if cfg.init_embeddings:
        draft.item_emb.weight.copy_(target.item_emb.weight)
        draft.action_emb.weight.copy_(target.action_emb.weight)
    if not cfg.init_layers or (d.num_heads, d.head_dim) != (t.num_heads, t.head_dim):
        return
    draft.norm_out.load_state_dict(target.norm_out.state_dict())
    rows = min(d.max_seq_len, t.max_seq_len)  # relative-position rows both have
    for mine, theirs in zip(draft.layers, target.layers, strict=False):
        assert isinstance(mine, HSTULayer) and isinstance(theirs, HSTULayer)
        state = theirs.state_dict()
        pos = mine.pos_bias.detach().clone()
        pos[:rows] = state["pos_bias"][:rows]
        state["pos_bias"] = pos
        mine.load_state_dict(state)


def rollout_window(draft: HSTU, k: int) -> int:
    """History events before a rollout's k items: as many as the generator gives the
    draft at this k and the default gamma (``Generator.window``)."""
    return draft.config.max_seq_len - k - GenerationConfig.gamma - 1


def _fit_rollouts(
    draft: HSTU,
    rollouts: Rollouts,
    cfg: TrainConfig,
    draft_cfg: DraftConfig,
    progress: TextIO | None,
) -> FitStats:
    """Cross-entropy of the target's greedy item at each generated position, over the
    items the generator leaves retrievable there (consumed and emitted ones masked out):
    greedy acceptance is exactly top-1 agreement under that mask."""
    rng = np.random.default_rng(cfg.seed + 1)
    first = draft.config.first_item_row
    device = torch.device(cfg.device)
    run = TrainingSteps(draft, draft_cfg.rollout_lr, cfg.weight_decay)
    n_batches = -(-len(rollouts) // cfg.batch_size)
    draft.train()
    for epoch in range(draft_cfg.rollout_epochs):
        bar = ProgressBar(n_batches, f"on-policy {epoch + 1}/{draft_cfg.rollout_epochs}", progress)
        agree = positions = 0
        for i, batch in enumerate(batches(rollouts, cfg.batch_size, rng)):
            user, _ = draft.train_forward(
                batch.items.to(device), batch.actions.to(device), batch.ts.to(device),
                batch.valid.to(device), None,
            )  # [B, L, D]  # fmt: skip
            mask = batch.target.to(device)
            logits = (user[mask] / cfg.temperature) @ draft.item_table()[first:].t()  # [P, V']
            rows, items = (t.to(device) for t in batch.excluded)
            logits = logits.index_put(
                (rows, items - first), torch.tensor(-torch.inf, device=device)
            )
            labels = batch.next_items.to(device)[mask] - first  # [P]
            run.step(F.cross_entropy(logits, labels), int(batch.valid.sum()))
            agree += int((logits.detach().argmax(1) == labels).sum())
            positions += len(labels)
            bar.update(i + 1, loss=run.loss_avg, top1=agree / max(1, positions))
        bar.close()
    draft.eval()
    return run.stats(epochs=draft_cfg.rollout_epochs)


def train_draft(
    log: InteractionLog,
    target_dir: Path | str,
    out_dir: Path | str,
    config: TrainConfig | None = None,
    draft: DraftConfig | None = None,
    *,
    rollout_log: InteractionLog | None = None,
    progress: TextIO | None = sys.stderr,
) -> TrainResult:
    """Distill a draft of ``target_dir`` on ``log`` (all but each user's last event), then
    (``DraftConfig.rollout_k``) train it on the target's continuations of the histories of
    ``rollout_log`` (default: the same events)."""
    cfg = config or TrainConfig()
    with deterministic(cfg.seed, cfg.threads, cfg.device):  # seeds, threads: as ``train``
        return _distill(
            log, target_dir, out_dir, cfg, draft or DraftConfig(), rollout_log, progress
        )


def _distill(
    log: InteractionLog,
    target_dir: Path | str,
    out_dir: Path | str,
    cfg: TrainConfig,
    draft_cfg: DraftConfig,
    rollout_log: InteractionLog | None,
    progress: TextIO | None,
) -> TrainResult:
    device = torch.device(cfg.device)
    target_ckpt = load_checkpoint(target_dir, device=device, dtype="float32")
    target = target_ckpt.model.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    t_cfg = target.config
    shape = replace(
        t_cfg,
        num_layers=draft_cfg.num_layers,
        d_model=draft_cfg.d_model or t_cfg.d_model,
        num_heads=draft_cfg.num_heads or t_cfg.num_heads,
        head_dim=draft_cfg.head_dim or t_cfg.head_dim,
        max_seq_len=draft_cfg.max_seq_len or t_cfg.max_seq_len,
        dropout=cfg.dropout,
        dtype="float32",
    )
    model = HSTU(shape).to(device).train()
    _init_from(model, target, draft_cfg)
    part, _ = log.leave_last_out()
    rows = target_ckpt.vocab.lookup(part.items.tolist())

    def loss_fn(m: HSTU, batch: dict[str, torch.Tensor], _gen: torch.Generator) -> torch.Tensor:
        return _draft_loss(m, target, batch, cfg, draft_cfg)

    if draft_cfg.rollout_k and rollout_window(model, draft_cfg.rollout_k) < 1:
        raise ConfigError(
            f"draft max_seq_len={shape.max_seq_len} leaves no history before "
            f"rollout_k={draft_cfg.rollout_k} items: it needs max_seq_len > "
            f"{draft_cfg.rollout_k + GenerationConfig.gamma + 1} (or a smaller rollout_k)"
        )
    stats = fit(model, part, rows, cfg, loss_fn, progress)
    on_policy: dict[str, float] = {}
    emitted: np.ndarray | None = None  # the target's items in the rollouts
    if draft_cfg.rollout_k and draft_cfg.rollout_epochs:
        history = part if rollout_log is None else rollout_log.leave_last_out()[0]
        rollouts = roll_out(
            target_ckpt, history, k=draft_cfg.rollout_k,
            window=rollout_window(model, draft_cfg.rollout_k),
            exclude_recent=draft_cfg.rollout_exclude_recent, stride=draft_cfg.rollout_stride,
            limit=draft_cfg.rollout_contexts, seed=cfg.seed, progress=progress,
        )  # fmt: skip
        second = _fit_rollouts(model, rollouts, cfg, draft_cfg, progress)
        emitted = rollouts.items
        on_policy = {
            "contexts": len(rollouts),
            "steps": second.steps,
            "final_loss": second.final_loss,
            "seconds": round(second.seconds, 2),
        }
        stats = replace(
            stats,
            steps=stats.steps + second.steps,
            seconds=stats.seconds + second.seconds,
            final_loss=second.final_loss,  # the phase the draft ends with
        )
    meta = {
        "model_name": f"{target_ckpt.model_name}-draft",
        "draft_of": draft_meta(target_ckpt),
        "training": {
            **asdict(cfg),
            **{f"draft_{k}": v for k, v in asdict(draft_cfg).items()},
            "steps": stats.steps,
            "final_loss": stats.final_loss,
            "seconds": round(stats.seconds, 2),
            "on_policy": on_policy,
        },
    }
    version = save_checkpoint(out_dir, model.eval().to("cpu"), target_ckpt.vocab, meta)
    if emitted is not None:  # what generation.draft_catalog picks from
        save_draft_items(out_dir, emitted)
    return TrainResult.of(
        out_dir, version, stats, target_ckpt.vocab, part.num_users, epochs=cfg.epochs
    )
