"""The target's greedy rollouts, and the on-policy phase of draft training that uses them.

A rollout's items must be exactly what the serving generator emits (the draft is trained
to predict them), and a training batch must present each generated item with the context,
positions, timestamps and exclusions under which the target chose it: re-scoring the batch
with the target's dense forward picks the same items.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrec.errors import ConfigError
from streamrec.models.checkpoint import load_checkpoint
from streamrec.models.hstu import HSTU
from streamrec.offline.datasets import SyntheticSpec, synthetic_log
from streamrec.offline.distillation import DraftConfig, train_draft
from streamrec.offline.rollouts import RolloutBatch, Rollouts, batches, cut_points, roll_out
from streamrec.offline.training import TrainConfig, train
from streamrec.pipeline.draft_catalog import DRAFT_ITEMS, load_draft_items

LOG = synthetic_log(SyntheticSpec(num_users=96, num_items=120, events_per_user=20))
SHAPE = TrainConfig(
    epochs=3, batch_size=16, seq_len=24, max_seq_len=32, d_model=32, num_layers=2,
    head_dim=16, lr=5e-3, dropout=0.0, task_weight=0.0,
)  # fmt: skip
K = 6
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("target") / "m"
    train(LOG, out, SHAPE, progress=None)
    return out


def test_cut_points_walk_back_from_each_end_and_sample_when_capped() -> None:
    lengths = np.array([3, 10, 7])
    users, cuts = cut_points(lengths, stride=2, min_context=5, limit=100, seed=0)
    assert list(zip(users.tolist(), cuts.tolist(), strict=True)) == [
        (1, 10), (1, 8), (1, 6), (2, 7), (2, 5),
    ]  # fmt: skip
    some = cut_points(lengths, stride=2, min_context=5, limit=3, seed=1)
    assert len(some[0]) == 3
    assert set(zip(*(a.tolist() for a in some), strict=True)) <= set(
        zip(users.tolist(), cuts.tolist(), strict=True)
    )
    again = cut_points(lengths, stride=2, min_context=5, limit=3, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(some, again, strict=True))


@torch.no_grad()
def _target_choices(model: HSTU, batch: RolloutBatch) -> torch.Tensor:
    """The target's greedy item at each trained position of ``batch`` by dense recompute."""
    user, _ = model.train_forward(batch.items, batch.actions, batch.ts, batch.valid, None)
    first = model.config.first_item_row
    scores = user[batch.target] @ model.item_table()[first:].t()  # [P, V']
    rows, items = batch.excluded
    scores = scores.index_put((rows, items - first), torch.tensor(-torch.inf))
    return scores.argmax(1) + first  # [P]


def test_rollouts_are_the_generators_output_and_batches_replay_them(target_dir: Path) -> None:
    target = load_checkpoint(target_dir, dtype="float32")
    # window = the whole context: a batch is what the target saw when it generated
    rollouts = roll_out(target, LOG, k=K, window=SHAPE.max_seq_len, stride=7, min_context=4)
    assert len(rollouts) == 96 * 3 and rollouts.items.shape == (96 * 3, K)  # cuts 20, 13, 6
    assert sorted({len(w) for w in rollouts.windows}) == [6, 13, 20]
    for win, banned, items in zip(rollouts.windows, rollouts.excluded, rollouts.items,
                                  strict=True):  # fmt: skip
        assert np.array_equal(banned, win[:, 0])  # every consumed item
        assert len(set(items.tolist())) == K  # never repeated
        assert not set(items.tolist()) & set(banned.tolist())  # never a consumed item
    checked = 0
    for batch in batches(rollouts, 32, np.random.default_rng(0)):
        picks = _target_choices(target.model, batch)
        assert torch.equal(picks, batch.next_items[batch.target])
        checked += len(picks)
    assert checked == len(rollouts) * (K - 1)


def test_a_batch_excludes_consumed_and_earlier_generated_items() -> None:
    window = np.array([[11, 1, 2_000], [12, 1, 3_000]], np.int64)
    rollouts = Rollouts(
        windows=(window,), excluded=(np.array([10, 11, 12]),), items=np.array([[20, 21, 22]]),
        action_id=3, time_step_ms=500,
    )  # fmt: skip
    (batch,) = batches(rollouts, batch_size=4, rng=np.random.default_rng(0))
    assert batch.items.tolist() == [[11, 12, 20, 21, 22]]  # the window, then the items
    assert batch.ts.tolist() == [[2_000, 3_000, 3_500, 4_000, 4_500]]
    assert batch.actions.tolist() == [[1, 1, 3, 3, 3]]
    assert batch.target.tolist() == [[False, False, True, True, False]]
    assert batch.next_items[batch.target].tolist() == [21, 22]
    rows, items = batch.excluded
    banned = [sorted(items[rows == p].tolist()) for p in range(2)]
    assert banned == [[10, 11, 12, 20], [10, 11, 12, 20, 21]]  # beyond the window, too


def test_rollouts_exclude_only_the_newest_items_when_asked(target_dir: Path) -> None:
    target = load_checkpoint(target_dir, dtype="float32")
    rollouts = roll_out(target, LOG, k=K, window=5, exclude_recent=2, stride=9)
    for win, banned, items in zip(rollouts.windows, rollouts.excluded, rollouts.items,
                                  strict=True):  # fmt: skip
        assert len(win) == 5 and np.array_equal(banned, win[-2:, 0])
        assert not set(items.tolist()) & set(banned.tolist())
    assert rollouts.last_ts.tolist() == [int(w[-1, 2]) for w in rollouts.windows]


def test_on_policy_training_raises_agreement_on_contexts_it_never_saw(
    target_dir: Path, tmp_path: Path
) -> None:
    users = np.arange(LOG.num_users)
    seen, unseen = LOG.subset(users[users % 4 != 0]), LOG.subset(users[users % 4 == 0])
    cfg = replace(SHAPE, epochs=2)
    shape = DraftConfig(num_layers=1, rollout_k=K, rollout_stride=2, rollout_epochs=3,
                        rollout_lr=3e-3)  # fmt: skip
    drafts = {
        name: train_draft(
            LOG, target_dir, tmp_path / name, cfg, draft, rollout_log=seen, progress=None
        ).model_dir
        for name, draft in (("data", replace(shape, rollout_k=0)), ("on_policy", shape))
    }
    target = load_checkpoint(target_dir, dtype="float32")
    held_out = roll_out(target, unseen, k=K, window=SHAPE.max_seq_len - K - 5, stride=3)
    agreement = {}
    for name, path in drafts.items():
        draft = load_checkpoint(path, dtype="float32").model
        hits = total = 0
        for batch in batches(held_out, 64, np.random.default_rng(0)):
            picks = _target_choices(draft, batch)
            hits += int((picks == batch.next_items[batch.target]).sum())
            total += len(picks)
        agreement[name] = hits / total
    print(f"top-1 agreement with the target on held-out rollouts: {agreement}")
    assert agreement["on_policy"] > agreement["data"] + 0.1
    # the items the target emitted in the rollouts, for generation.draft_catalog
    assert not (drafts["data"] / DRAFT_ITEMS).exists()
    items = load_draft_items(drafts["on_policy"], 1_000)
    assert len(items) > K and (items >= target.config.first_item_row).all()
    meta = load_checkpoint(drafts["on_policy"]).meta["training"]
    assert (
        meta["on_policy"]["contexts"] > 0
        and not load_checkpoint(drafts["data"]).meta["training"]["on_policy"]
    )


def test_bad_rollout_settings_are_named(target_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rollout_stride=0"):
        DraftConfig(rollout_stride=0)
    with pytest.raises(ConfigError, match="rollout_lr=0"):
        DraftConfig(rollout_lr=0)
    with pytest.raises(ConfigError, match="rollout_k=30 items: it needs max_seq_len > 35"):
        train_draft(LOG, target_dir, tmp_path / "d", SHAPE, DraftConfig(rollout_k=30),
                    progress=None)  # fmt: skip
    with pytest.raises(ConfigError, match="stride=0"):
        roll_out(load_checkpoint(target_dir), LOG, k=2, window=4, stride=0)
    with pytest.raises(ConfigError, match="exclude_recent=-1"):
        roll_out(load_checkpoint(target_dir), LOG, k=2, window=4, exclude_recent=-1)
    with pytest.raises(ConfigError, match="rollout_exclude_recent=-3"):
        DraftConfig(rollout_exclude_recent=-3)
