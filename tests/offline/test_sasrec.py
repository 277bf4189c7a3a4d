"""The SASRec-style baseline: causal, trained and scored by HSTU's own code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrec.errors import ConfigError, ModelError
from streamrec.models.checkpoint import load_checkpoint
from streamrec.offline.datasets import SyntheticSpec, synthetic_log
from streamrec.offline.evaluation import evaluate
from streamrec.offline.sasrec import SASRec, SASRecConfig, is_sasrec_dir, load_sasrec, train_sasrec
from streamrec.offline.training import TrainConfig

CFG = SASRecConfig(num_items=60, num_oov_buckets=4, d_model=16, num_heads=2, max_seq_len=10)
TRAIN = TrainConfig(
    epochs=3, batch_size=16, seq_len=16, max_seq_len=16, d_model=32, num_heads=2,
    num_negatives=0, dropout=0.1, lr=5e-3, num_oov_buckets=4,
)  # fmt: skip
LOG = synthetic_log(SyntheticSpec(num_users=120, num_items=100, events_per_user=24))


@torch.no_grad()
def test_position_i_reads_only_positions_up_to_i() -> None:
    torch.manual_seed(0)
    model = SASRec(CFG).eval()
    items = torch.randint(5, 60, (2, 8))
    actions = torch.randint(0, 3, (2, 8))
    valid = torch.ones(2, 8, dtype=torch.bool)
    out = model.encode(items, actions, valid)  # [2, 8, D]
    changed = items.clone()
    changed[:, 5:] = 7
    again = model.encode(changed, actions, valid)
    torch.testing.assert_close(out[:, :5], again[:, :5])
    assert not torch.allclose(out[:, 5:], again[:, 5:])
    with pytest.raises(ModelError, match="max_seq_len=10"):
        model.encode(torch.ones(1, 11, dtype=torch.int64), torch.zeros(1, 11, dtype=torch.int64),
                     torch.ones(1, 11, dtype=torch.bool))  # fmt: skip


@torch.no_grad()
def test_user_embedding_is_the_last_position_of_each_jagged_history() -> None:
    torch.manual_seed(0)
    model = SASRec(CFG).eval()
    a, b = torch.tensor([5, 9, 11]), torch.tensor([20, 21, 22, 23, 24])
    acts = torch.zeros(8, dtype=torch.int64)
    emb = model.user_embedding(torch.cat([a, b]), acts, acts, torch.tensor([0, 3, 8]))  # [2, D]
    alone = model.encode(a[None], acts[None, :3], torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(emb[0], alone[0, -1])
    full = model.encode(b[None], acts[None, :5], torch.ones(1, 5, dtype=torch.bool))
    torch.testing.assert_close(emb[1], full[0, -1])


def test_trained_baseline_beats_most_popular_and_is_reproducible(tmp_path) -> None:
    a = train_sasrec(LOG, tmp_path / "a", TRAIN, progress=None)
    b = train_sasrec(LOG, tmp_path / "b", TRAIN, progress=None)
    assert a.model_version == b.model_version
    assert is_sasrec_dir(a.model_dir) and a.best_epoch >= 1
    result = evaluate(a.model_dir, LOG, report=None)
    assert result.model_version == a.model_version
    assert result.model.hr > 2 * result.popular.hr
    ckpt = load_sasrec(a.model_dir)
    assert ckpt.meta["training"]["task_weight"] == 0.0 and ckpt.meta["model_name"] == "sasrec"
    with pytest.raises(ModelError):  # the worker's loader refuses it
        load_checkpoint(a.model_dir)


def test_bad_config_is_named() -> None:
    with pytest.raises(ConfigError, match="num_heads=3"):
        SASRecConfig(num_items=60, d_model=16, num_heads=3)
    with pytest.raises(ConfigError, match=r"dropout=1\.0"):
        SASRecConfig(num_items=60, dropout=1.0)
    with pytest.raises(ModelError, match="not a SASRec"):
        load_sasrec(Path("/nonexistent"))
