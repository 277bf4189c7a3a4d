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

import torch
import torch.nn.functional as F

from streamrec.errors import ConfigError
from streamrec.models.checkpoint import load_checkpoint, save_checkpoint
from streamrec.models.draft import draft_meta
from streamrec.models.hstu import HSTU, HSTULayer
from streamrec.offline.datasets import InteractionLog
from streamrec.offline.training import TrainConfig, TrainResult, deterministic, fit


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

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ConfigError(f"DraftConfig.num_layers={self.num_layers} must be >= 1")
        for name in ("d_model", "num_heads", "head_dim", "max_seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"DraftConfig.{name}={value} must be >= 1 or unset")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ConfigError(f"DraftConfig.distill_weight={self.distill_weight} not in [0, 1]")
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


def train_draft(
    log: InteractionLog,
    target_dir: Path | str,
    out_dir: Path | str,
    config: TrainConfig | None = None,
    draft: DraftConfig | None = None,
    *,
    progress: TextIO | None = sys.stderr,
) -> TrainResult:
    """Distill a draft of ``target_dir`` on ``log`` (all but each user's last event)."""
    cfg = config or TrainConfig()
    with deterministic(cfg.seed, cfg.threads, cfg.device):  # seeds, threads: as ``train``
        return _distill(log, target_dir, out_dir, cfg, draft or DraftConfig(), progress)


def _distill(
    log: InteractionLog,
    target_dir: Path | str,
    out_dir: Path | str,
    cfg: TrainConfig,
    draft_cfg: DraftConfig,
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

    stats = fit(model, part, rows, cfg, loss_fn, progress)
    meta = {
        "model_name": f"{target_ckpt.model_name}-draft",
        "draft_of": draft_meta(target_ckpt),
        "training": {
            **asdict(cfg),
            **{f"draft_{k}": v for k, v in asdict(draft_cfg).items()},
            "steps": stats.steps,
            "final_loss": stats.final_loss,
            "seconds": round(stats.seconds, 2),
        },
    }
    version = save_checkpoint(out_dir, model.eval().to("cpu"), target_ckpt.vocab, meta)
    return TrainResult.of(
        out_dir, version, stats, target_ckpt.vocab, part.num_users, epochs=cfg.epochs
    )
