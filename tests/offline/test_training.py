"""Training + evaluation end to end (issue 3, acceptance 3) and the MovieLens smoke run."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrec.errors import ConfigError
from streamrec.models.checkpoint import load_checkpoint
from streamrec.models.hstu import HSTU
from streamrec.offline.datasets import SyntheticSpec, read_movielens, synthetic_log
from streamrec.offline.evaluation import evaluate
from streamrec.offline.training import (
    TrainConfig,
    _batch,
    _windows,
    deterministic,
    fit,
    next_item_loss,
    prepare,
    train,
)
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


TINY = TrainConfig(
    epochs=1, batch_size=8, seq_len=12, max_seq_len=12, d_model=16, num_heads=2, head_dim=8,
    num_negatives=0, dropout=0.2, task_weight=0.5, threads=2,
)  # fmt: skip
TINY_LOG = synthetic_log(SyntheticSpec(num_users=24, num_items=40, events_per_user=20))


def test_windows_put_a_target_at_every_position_evaluation_reads() -> None:
    """Issue 22: a 12-token history read at evaluation has its last position trained."""
    lengths = np.array([30, 13, 5, 1])
    windows = _windows(lengths, 12, np.random.default_rng(0))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    rows = np.arange(int(offsets[-1])) + 17
    zeros = np.zeros_like(rows)
    batch = _batch(windows, offsets, rows, zeros, zeros)
    assert batch["items"].shape[1] == 12 and bool(batch["target"][:, 11].any())
    assert torch.equal(batch["target"], batch["valid"])  # every input predicts its next
    for user, n in enumerate(lengths.tolist()):
        mine = windows[windows[:, 0] == user]
        pairs = {(int(s) + i, int(s) + i + 1) for _, s, e in mine for i in range(int(e - s) - 1)}
        assert pairs == {(i, i + 1) for i in range(n - 1)}  # every transition, none past n
        if n > 12:
            assert (user, n - 13, n) in {tuple(w) for w in mine.tolist()}  # newest: full


def test_validation_split_holds_out_the_second_to_last_event() -> None:
    data = prepare(TINY_LOG, TINY)
    assert data.validation is not None
    assert (data.part.lengths() == 18).all()
    history, target = data.validation.leave_last_out()
    assert np.array_equal(history.items, data.part.items)
    assert target.items.tolist() == [TINY_LOG.items[e - 2] for e in TINY_LOG.offsets[1:]]
    no_val = prepare(TINY_LOG, TrainConfig(**{**TINY.__dict__, "validation": False}))
    assert no_val.validation is None and (no_val.part.lengths() == 19).all()


def test_same_seed_same_model_version_with_dropout_and_threads(tmp_path) -> None:
    """Issue 22 target: same seed -> identical model on the CPU (dropout on, 2 threads)."""
    before = torch.get_num_threads()
    a = train(TINY_LOG, tmp_path / "a", TINY, progress=None)
    torch.rand(7)  # whatever the process drew in between must not matter
    b = train(TINY_LOG, tmp_path / "b", TINY, progress=None)
    c = train(TINY_LOG, tmp_path / "c", TrainConfig(**{**TINY.__dict__, "seed": 1}), progress=None)
    assert a.model_version == b.model_version != c.model_version
    assert torch.get_num_threads() == before  # restored
    assert not torch.are_deterministic_algorithms_enabled()
    meta = load_checkpoint(a.model_dir).meta["training"]
    assert meta["threads_used"] == 2 and meta["best_epoch"] == 1
    assert len(meta["validation_ndcg10"]) == 1


def test_early_stopping_keeps_the_best_epoch() -> None:
    data = prepare(TINY_LOG, TINY)
    model = HSTU(TINY.model_config(data.vocab.size))
    scores = iter([0.1, 0.3, 0.2, 0.25, 0.9])
    kept: list[dict[str, torch.Tensor]] = []

    def validate() -> float:
        kept.append({k: v.clone() for k, v in model.state_dict().items()})
        return next(scores)

    def loss_fn(m, batch, gen):
        return next_item_loss(m, batch, TINY, gen)

    cfg = TrainConfig(**{**TINY.__dict__, "epochs": 5, "patience": 2, "threads": 1})
    with deterministic(cfg.seed, cfg.threads, cfg.device):
        stats = fit(model, data.part, data.rows, cfg, loss_fn, None, validate)
    assert (stats.epochs, stats.best_epoch, stats.validation) == (4, 2, (0.1, 0.3, 0.2, 0.25))
    state = model.state_dict()
    assert all(torch.equal(state[k], kept[1][k]) for k in state)
    assert not all(torch.equal(state[k], kept[3][k]) for k in state)


def test_time_bias_ablation_keeps_the_bias_at_zero(tmp_path) -> None:
    cfg = TrainConfig(**{**TINY.__dict__, "time_bias": False})
    result = train(TINY_LOG, tmp_path / "m", cfg, progress=None)
    model = load_checkpoint(result.model_dir).model
    assert all(float(layer.time_bias.detach().abs().max()) == 0.0 for layer in model.layers)
    assert any(float(layer.pos_bias.detach().abs().max()) > 0.0 for layer in model.layers)


def test_bad_patience_and_threads_are_named() -> None:
    with pytest.raises(ConfigError, match="patience=-1"):
        TrainConfig(patience=-1)
    with pytest.raises(ConfigError, match="threads=-2"):
        TrainConfig(threads=-2)
