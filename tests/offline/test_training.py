"""Training + evaluation end to end (issue 3, acceptance 3) and the MovieLens smoke run."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from streamrec.errors import ConfigError
from streamrec.models.checkpoint import load_checkpoint
from streamrec.offline.datasets import SyntheticSpec, read_movielens, synthetic_log
from streamrec.offline.evaluation import evaluate
from streamrec.offline.training import TrainConfig, train
from tests.models.paged import FakePagedCache

MOVIELENS = Path("/work/shared/data/movielens-small/ratings.csv")

FAST = TrainConfig(
    epochs=4,
    batch_size=12,
    seq_len=30,
    max_seq_len=32,
    d_model=32,
    head_dim=16,
    num_negatives=128,
    lr=5e-3,
    dropout=0.0,
    task_weight=1.0,
)


@pytest.mark.slow
def test_synthetic_training_beats_most_popular(tmp_path) -> None:
    log = synthetic_log(SyntheticSpec(num_users=240, num_items=200, events_per_user=30))
    bar = io.StringIO()
    result = train(log, tmp_path / "m", FAST, progress=bar)
    assert "loss=" in bar.getvalue() and "tok_s=" in bar.getvalue()
    assert result.steps == FAST.epochs * -(-240 // FAST.batch_size)
    out = io.StringIO()
    metrics = evaluate(result.model_dir, log, report=out)
    assert metrics.model_version == result.model_version
    assert "most-pop" in out.getvalue() and "HR@10" in out.getvalue()
    assert metrics.num_users == 240 and metrics.num_items == 200
    assert metrics.model.hr >= 2 * metrics.popular.hr
    assert metrics.model.hr > 0.5
    assert metrics.model.ndcg >= 2 * metrics.popular.ndcg
    assert_like_head_learned(result.model_dir, log)


@torch.no_grad()
def assert_like_head_learned(model_dir: Path, log) -> None:
    """Synthetic items with index % 4 == 0 are LIKEd: rank must score them higher."""
    ckpt = load_checkpoint(model_dir)
    model, vocab = ckpt.model, ckpt.vocab
    span = log.user_slice(0)
    items = torch.from_numpy(vocab.lookup(log.items[span].tolist()))
    actions = torch.from_numpy(log.actions[span])
    ts = torch.from_numpy(log.ts_ms[span])
    cache = FakePagedCache(model, num_blocks=8, block_size=8, seed=0)
    cache.add_users(1)
    k, v, _ = model.prefill(items, actions, ts, torch.tensor([0, len(items)]))
    cache.write(cache.slots(0, len(items)), k, v, ts)
    cands = torch.arange(vocab.first_item_row, vocab.size)
    tables, lens = cache.batch_tables()
    scores = model.rank(cands[None], ts[-1:], cache.kv, cache.ts, tables, lens)[0]
    like = scores[:, model.config.task_names.index("like")]
    liked = torch.tensor([int(vocab.external(int(c))[1:]) % 4 == 0 for c in cands])
    assert like[liked].mean() > like[~liked].mean() + 0.15


@pytest.mark.slow
def test_training_is_deterministic(tmp_path) -> None:
    log = synthetic_log(SyntheticSpec(num_users=20, num_items=40, events_per_user=8))
    cfg = TrainConfig(**{**FAST.__dict__, "epochs": 1})
    a = train(log, tmp_path / "a", cfg, progress=None)
    b = train(log, tmp_path / "b", cfg, progress=None)
    assert a.model_version == b.model_version
    assert load_checkpoint(a.model_dir).meta["training"]["steps"] == a.steps


def test_bad_train_config_is_named() -> None:
    with pytest.raises(ConfigError, match="seq_len=300"):
        TrainConfig(seq_len=300, max_seq_len=200)
    with pytest.raises(ConfigError, match="lr=0"):
        TrainConfig(lr=0)


@pytest.mark.slow
@pytest.mark.skipif(not MOVIELENS.exists(), reason=f"{MOVIELENS} absent")
def test_movielens_smoke_train_and_eval(tmp_path) -> None:
    """One short epoch on 60 users: checks the real-data path, not the quality.

    The quality run (HR@10 and NDCG@10 ≥ 2× most-popular) takes minutes; its command
    and figures are in BENCHMARKS.md.
    """
    log = read_movielens(MOVIELENS)
    keep = 60
    small = type(log)(
        users=log.users[:keep],
        offsets=log.offsets[: keep + 1],
        items=log.items[: log.offsets[keep]],
        actions=log.actions[: log.offsets[keep]],
        ts_ms=log.ts_ms[: log.offsets[keep]],
    )
    cfg = TrainConfig(**{**FAST.__dict__, "epochs": 1, "seq_len": 32})
    result = train(small, tmp_path / "ml", cfg, progress=None)
    metrics = evaluate(result.model_dir, small, report=None)
    assert metrics.num_users == keep
    assert 0.0 <= metrics.model.hr <= 1.0 and metrics.popular.hr > 0.0
