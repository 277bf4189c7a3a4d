"""Draft distillation: the draft learns the target's next-item choice, records its target,
and a mismatched pair is refused at load (``models.draft``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from streamrec.errors import ConfigError, ModelError
from streamrec.models.checkpoint import load_checkpoint
from streamrec.models.draft import load_draft
from streamrec.offline.datasets import SyntheticSpec, synthetic_log
from streamrec.offline.distillation import DraftConfig, train_draft
from streamrec.offline.training import TrainConfig, train
from streamrec.tools.cli import main

pytestmark = pytest.mark.slow
LOG = synthetic_log(SyntheticSpec(num_users=160, num_items=120, events_per_user=24))
FAST = TrainConfig(
    epochs=4, batch_size=16, seq_len=24, max_seq_len=32, d_model=32, num_layers=3,
    head_dim=16, lr=5e-3, dropout=0.0, task_weight=0.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("target") / "m"
    train(LOG, out, FAST, progress=None)
    return out


@torch.no_grad()
def top1_agreement(target_dir: Path, draft_dir: Path) -> float:
    """Share of positions of the training windows where the draft's top item is the
    target's (the greedy acceptance rate of a one-item draft)."""
    target = load_checkpoint(target_dir).model
    draft = load_checkpoint(draft_dir).model
    rows = torch.from_numpy(load_checkpoint(target_dir).vocab.lookup(LOG.items.tolist()))
    agree, total = 0, 0
    for u in range(0, LOG.num_users, 8):
        span = LOG.user_slice(u)
        inputs = (rows[span][None], torch.from_numpy(LOG.actions[span])[None],
                  torch.from_numpy(LOG.ts_ms[span])[None])  # fmt: skip
        valid = torch.ones_like(inputs[0], dtype=torch.bool)
        first = target.config.first_item_row
        picks = []
        for model in (target, draft):
            user, _ = model.train_forward(*inputs, valid, None)  # [1, L, D]
            picks.append((user[0] @ model.item_table()[first:].t()).argmax(-1))
        agree += int((picks[0] == picks[1]).sum())
        total += picks[0].numel()
    return agree / total


def test_distilled_draft_agrees_with_its_target(target_dir: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(**{**FAST.__dict__, "epochs": 3})
    result = train_draft(LOG, target_dir, tmp_path / "draft", cfg, DraftConfig(), progress=None)
    draft = load_draft(result.model_dir, load_checkpoint(target_dir))
    assert (
        draft.config.num_layers == 1
        and draft.config.num_items == load_checkpoint(target_dir).config.num_items
    )
    assert draft.meta["draft_of"]["model_version"] == load_checkpoint(target_dir).version
    untrained = train_draft(
        LOG, target_dir, tmp_path / "raw", TrainConfig(**{**cfg.__dict__, "lr": 1e-9}),
        DraftConfig(init_embeddings=False, init_layers=False, rollout_k=0), progress=None,
    )  # fmt: skip
    trained_rate = top1_agreement(target_dir, result.model_dir)
    raw_rate = top1_agreement(target_dir, untrained.model_dir)
    print(f"top-1 agreement: distilled {trained_rate:.3f}, untrained {raw_rate:.3f}")
    assert trained_rate > 0.5 and trained_rate > raw_rate + 0.3


def test_a_draft_starts_as_the_target_cut_short(target_dir: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(**{**FAST.__dict__, "epochs": 1, "lr": 1e-12, "weight_decay": 0.0})
    out = train_draft(LOG, target_dir, tmp_path / "d", cfg, DraftConfig(num_layers=2,
                      max_seq_len=40, rollout_k=0), progress=None).model_dir  # fmt: skip
    draft, target = load_checkpoint(out).model, load_checkpoint(target_dir).model
    for mine, theirs in zip(draft.layers, target.layers[:2], strict=True):
        torch.testing.assert_close(mine.uvqk.weight, theirs.uvqk.weight, atol=1e-6, rtol=0)
        torch.testing.assert_close(mine.pos_bias[:32], theirs.pos_bias, atol=1e-6, rtol=0)
    assert draft.config.max_seq_len == 40
    torch.testing.assert_close(draft.item_emb.weight, target.item_emb.weight, atol=1e-6, rtol=0)


def test_a_draft_of_another_model_is_refused(target_dir: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(**{**FAST.__dict__, "epochs": 1})
    draft = train_draft(LOG, target_dir, tmp_path / "draft", cfg, progress=None).model_dir
    other = train(
        LOG, tmp_path / "other", TrainConfig(**{**cfg.__dict__, "seed": 3}), progress=None
    )
    with pytest.raises(ModelError, match="distilled from model_version"):
        load_draft(draft, load_checkpoint(other.model_dir))
    with pytest.raises(ModelError, match="not a draft model"):
        load_draft(other.model_dir, load_checkpoint(target_dir))
    shifted = synthetic_log(SyntheticSpec(num_users=160, num_items=130, events_per_user=24))
    alien = train(shifted, tmp_path / "alien", cfg, progress=None).model_dir
    meta_path = Path(draft) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["draft_of"]["model_version"] = load_checkpoint(alien).version  # lie about the target
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ModelError, match="another vocabulary"):
        load_draft(draft, load_checkpoint(alien))


def test_cli_train_draft_of(target_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli-draft"
    code = main(["train", "--synthetic", "--draft-of", str(target_dir), "--draft-layers", "2",
                 "--epochs", "1", "--out", str(out), "--max-seq-len", "32",
                 "--rollout-k", "0"])  # fmt: skip
    assert code == 0 and "wrote" in capsys.readouterr().out
    assert load_draft(out, load_checkpoint(target_dir)).config.num_layers == 2
    training = load_checkpoint(out).meta["training"]
    assert training["on_policy"] == {}  # --rollout-k 0: none
    assert training["draft_rollout_exclude_recent"] == 16  # the worker's default window
    assert main(["train", "--synthetic", "--draft-of", str(tmp_path / "none"), "--out",
                 str(out)]) == 1  # fmt: skip
    assert "does not exist" in capsys.readouterr().err


def test_bad_draft_config_is_named() -> None:
    with pytest.raises(ConfigError, match="num_layers=0"):
        DraftConfig(num_layers=0)
    with pytest.raises(ConfigError, match="distill_weight=2"):
        DraftConfig(distill_weight=2)
