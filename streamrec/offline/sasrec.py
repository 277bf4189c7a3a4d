"""A SASRec-style baseline: causal softmax Transformer with learned absolute positions.

The question issue 22 asks is whether HSTU's architecture (SiLU attention without softmax,
relative position and time biases, task heads) earns its place over the plain sequential
Transformer recommender (Kang & McAuley 2018). To make that comparison about the
architecture alone, everything else is HSTU's: the same tokens (item + action embedding;
time is not an input), the same shared, L2-normalised item table and cosine / temperature
next-item loss, the same windows, optimiser, validation split, early stopping and
evaluation code (``training.fit``, ``ranking.rank_held_out``), the same width, depth and
head count. Positions are absolute and left-aligned (position 0 = the oldest token read),
which the training windows cover up to ``max_seq_len - 1``.

A model directory holds ``weights.safetensors``, ``config.json`` (with ``"kind":
"sasrec"``, so the worker's loader refuses it), ``vocab.json`` and ``meta.json``; its
``model_version`` is the same content hash as an HSTU's.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from streamrec.errors import ConfigError, ModelError
from streamrec.models.checkpoint import CONFIG, META, VOCAB, WEIGHTS, model_version
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.offline.datasets import InteractionLog
from streamrec.offline.training import (
    TrainConfig,
    TrainResult,
    deterministic,
    fit,
    next_item_loss,
    prepare,
    training_meta,
    validator,
)
from streamrec.schemas.events import NUM_ACTIONS

KIND = "sasrec"


@dataclass(frozen=True)
class SASRecConfig:
    """Shape of the baseline; ``num_items`` counts padding and OOV rows as in HSTU."""

    num_items: int
    num_oov_buckets: int = 16
    num_actions: int = NUM_ACTIONS
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    ffn_hidden: int = 64  # SASRec's point-wise feed-forward keeps the width
    max_seq_len: int = 50
    dropout: float = 0.2
    use_actions: bool = True  # the action embedding joins the input, as in HSTU
    task_names: tuple[str, ...] = ()  # no task heads: retrieval only

    def __post_init__(self) -> None:
        for name in ("num_oov_buckets", "num_actions", "d_model", "num_layers", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"SASRecConfig.{name}={value!r} must be a positive int")
        if self.ffn_hidden < 1 or self.max_seq_len < 1:
            raise ConfigError(
                f"SASRecConfig.ffn_hidden={self.ffn_hidden} max_seq_len={self.max_seq_len}"
                " must be >= 1"
            )
        if self.d_model % self.num_heads:
            raise ConfigError(
                f"SASRecConfig.d_model={self.d_model} must be a multiple of "
                f"num_heads={self.num_heads}"
            )
        if self.num_items < self.num_oov_buckets + 2:
            raise ConfigError(
                f"SASRecConfig.num_items={self.num_items} must count padding, "
                f"{self.num_oov_buckets} OOV rows and one item"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"SASRecConfig.dropout={self.dropout!r} must be in [0, 1)")
        object.__setattr__(self, "task_names", tuple(self.task_names))

    @property
    def first_item_row(self) -> int:
        return 1 + self.num_oov_buckets

    @classmethod
    def from_train_config(cls, cfg: TrainConfig, num_items: int) -> SASRecConfig:
        """HSTU's width, depth, heads, window and dropout (the 'same size' baseline)."""
        return cls(
            num_items=num_items,
            num_oov_buckets=cfg.num_oov_buckets,
            d_model=cfg.d_model,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            ffn_hidden=cfg.d_model,
            max_seq_len=cfg.max_seq_len,
            dropout=cfg.dropout,
        )


class SASRecBlock(nn.Module):
    """Pre-norm causal multi-head softmax attention, then a point-wise feed-forward."""

    def __init__(self, config: SASRecConfig) -> None:
        super().__init__()
        d = config.d_model
        self.num_heads = config.num_heads
        self.p = config.dropout
        self.norm_attn = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm_ffn = nn.LayerNorm(d)
        self.ffn = nn.Sequential(
            nn.Linear(d, config.ffn_hidden), nn.ReLU(), nn.Linear(config.ffn_hidden, d)
        )
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """x [B, L, D]; allowed [B, 1, L, L] (causal and key valid). Returns [B, L, D]."""
        b, n, d = x.shape
        qkv = self.qkv(self.norm_attn(x)).view(b, n, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, L, d_h]
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=self.p if self.training else 0.0
        )  # [B, H, L, d_h]
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(b, n, d)))
        return x + self.dropout(self.ffn(self.norm_ffn(x)))


class SASRec(nn.Module):
    """Item (+ action) + absolute position embeddings, causal blocks, final LayerNorm."""

    def __init__(self, config: SASRecConfig) -> None:
        super().__init__()
        self.config = config
        self.item_emb = nn.Embedding(config.num_items, config.d_model, padding_idx=0)
        self.action_emb = nn.Embedding(config.num_actions, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList(SASRecBlock(config) for _ in range(config.num_layers))
        self.norm_out = nn.LayerNorm(config.d_model)
        self.emb_dropout = nn.Dropout(config.dropout)
        for emb in (self.item_emb, self.action_emb, self.pos_emb):
            nn.init.normal_(emb.weight, std=config.d_model**-0.5)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()

    def encode(
        self, items: torch.Tensor, actions: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """Left-aligned [B, L] inputs -> normalised outputs [B, L, D]; position i reads 0..i."""
        n = items.shape[1]
        if n > self.config.max_seq_len:
            raise ModelError(f"SASRec: {n} tokens past max_seq_len={self.config.max_seq_len}")
        pos = torch.arange(n, device=items.device)  # [L]
        x = self.item_emb(items) + self.pos_emb(pos)[None]  # [B, L, D]
        if self.config.use_actions:
            x = x + self.action_emb(actions)
        x = self.emb_dropout(x * valid.unsqueeze(-1))
        causal = torch.ones(n, n, dtype=torch.bool, device=items.device).tril()  # [L, L]
        allowed = (causal[None] & valid[:, None, :]).unsqueeze(1)  # [B, 1, L, L]
        for block in self.blocks:
            x = block(x, allowed)
        return F.normalize(self.norm_out(x), dim=-1)

    def train_forward(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        valid: torch.Tensor,
        next_items: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """HSTU's training signature: user vectors [B, L, D] and no task logits."""
        del ts, next_items
        return self.encode(items, actions, valid), None

    def user_embedding(
        self, items: torch.Tensor, actions: torch.Tensor, ts: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Jagged histories (values [T], offsets [B+1]) -> [B, D] after each last token."""
        del ts
        lens = offsets[1:] - offsets[:-1]  # [B]
        b, width = len(lens), max(int(lens.max()), 1)
        user = torch.repeat_interleave(torch.arange(b, device=items.device), lens)  # [T]
        pos = torch.arange(len(items), device=items.device) - offsets[user]  # [T]
        grid = torch.zeros(b, width, dtype=torch.int64, device=items.device)
        act = torch.zeros_like(grid)
        valid = torch.zeros(b, width, dtype=torch.bool, device=items.device)
        grid[user, pos], act[user, pos], valid[user, pos] = items, actions, True
        out = self.encode(grid, act, valid)  # [B, W, D]
        last = out[torch.arange(b, device=items.device), (lens - 1).clamp(min=0)]  # [B, D]
        return torch.where((lens > 0).unsqueeze(-1), last, torch.zeros_like(last))

    def item_table(self) -> torch.Tensor:
        """Normalised item rows [V, D] (the cosine score's other side, as in HSTU)."""
        return F.normalize(self.item_emb.weight, dim=-1)


@dataclass(frozen=True)
class SASRecCheckpoint:
    model: SASRec
    vocab: ItemVocabulary
    version: str
    meta: dict[str, Any]


def _read_config(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_sasrec_dir(path: Path | str) -> bool:
    data = _read_config(Path(path))
    return data is not None and data.get("kind") == KIND


def save_sasrec(
    path: Path | str, model: SASRec, vocab: ItemVocabulary, meta: dict[str, Any]
) -> str:
    """Write a baseline model directory; returns its ``model_version``."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS))
    config = {"kind": KIND, **asdict(model.config), "task_names": []}
    (out / CONFIG).write_text(json.dumps(config, indent=1, sort_keys=True))
    vocab.save(out / VOCAB)
    version = model_version(out)
    info = {"model_name": KIND, **meta, "model_version": version}
    (out / META).write_text(json.dumps(info, indent=1, sort_keys=True))
    return version


def load_sasrec(path: Path | str, device: str = "cpu") -> SASRecCheckpoint:
    src = Path(path)
    data = _read_config(src)
    if data is None or data.get("kind") != KIND:
        raise ModelError(f"{src / CONFIG}: not a SASRec model directory")
    known = {f.name for f in fields(SASRecConfig)}
    values = {k: v for k, v in data.items() if k in known}
    try:
        config = SASRecConfig(**values)
        weights = load_file(str(src / WEIGHTS))
    except (TypeError, ConfigError) as exc:
        raise ModelError(f"{src / CONFIG}: {exc}") from exc
    except (OSError, SafetensorError) as exc:
        raise ModelError(f"cannot read {src / WEIGHTS}: {exc}") from exc
    model = SASRec(config)
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        raise ModelError(f"{src / WEIGHTS}: {exc}") from exc
    meta = json.loads((src / META).read_text()) if (src / META).exists() else {}
    vocab = ItemVocabulary.load(src / VOCAB)
    return SASRecCheckpoint(model.to(device).eval(), vocab, model_version(src), meta)


def train_sasrec(
    log: InteractionLog,
    out_dir: Path | str,
    config: TrainConfig | None = None,
    *,
    progress: TextIO | None = sys.stderr,
) -> TrainResult:
    """Train the baseline exactly as ``training.train`` trains an HSTU, minus task heads."""
    cfg = replace(config or TrainConfig(), task_weight=0.0, model_name=KIND)
    with deterministic(cfg.seed, cfg.threads, cfg.device):
        data = prepare(log, cfg)
        model = SASRec(SASRecConfig.from_train_config(cfg, data.vocab.size))
        model = model.to(torch.device(cfg.device)).train()

        def loss_fn(
            m: SASRec, batch: dict[str, torch.Tensor], gen: torch.Generator
        ) -> torch.Tensor:
            return next_item_loss(m, batch, cfg, gen)

        validate = validator(model, data, cfg)
        stats = fit(model, data.part, data.rows, cfg, loss_fn, progress, validate)
        meta = {"training": training_meta(cfg, stats, data)}
    version = save_sasrec(out_dir, model.eval().to("cpu"), data.vocab, meta)
    return TrainResult.of(out_dir, version, stats, data.vocab, data.part.num_users)
