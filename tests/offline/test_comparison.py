"""The seeded protocol end to end on a tiny log: variants, reuse, figures, intervals."""

from __future__ import annotations

import io
import json

import pytest

from streamrec.errors import ConfigError
from streamrec.offline.comparison import ComparisonConfig, run_comparison
from streamrec.offline.datasets import SyntheticSpec, synthetic_log
from streamrec.offline.training import TrainConfig

LOG = synthetic_log(SyntheticSpec(num_users=40, num_items=60, events_per_user=16))
TRAIN = TrainConfig(
    epochs=2, batch_size=16, seq_len=14, max_seq_len=14, d_model=16, num_heads=2, head_dim=8,
    num_negatives=0, dropout=0.1, threads=1, num_oov_buckets=4,
)  # fmt: skip


def test_protocol_trains_every_variant_and_reuses_them(tmp_path) -> None:
    cfg = ComparisonConfig(seeds=2, ablations=("no-task-heads", "no-time-bias"), ablation_seeds=1)
    log = io.StringIO()
    report = run_comparison(LOG, tmp_path, TRAIN, cfg, progress=log)
    assert list(report.runs) == [
        "hstu", "sasrec", "hstu-no-task-heads", "hstu-no-time-bias", "most-popular",
    ]  # fmt: skip
    assert [len(r) for r in report.runs.values()] == [2, 2, 1, 1, 1]
    assert set(report.intervals) == {
        "sasrec", "hstu-no-task-heads", "hstu-no-time-bias", "most-popular",
    }  # fmt: skip
    hstu = report.runs["hstu"]
    assert hstu[0].model_version != hstu[1].model_version  # two seeds, two models
    mean, std = report.summary("hstu")["ndcg"]
    assert mean == pytest.approx((hstu[0].test.ndcg + hstu[1].test.ndcg) / 2) and std >= 0
    ndcg = report.intervals["sasrec"]["ndcg"]
    assert ndcg.low <= ndcg.high
    assert ndcg.diff == pytest.approx(mean - report.summary("sasrec")["ndcg"][0])
    table = report.table()
    assert "±" in table and "hstu − sasrec: HR" in table and "no-time-bias" in table
    data = json.loads(json.dumps(report.to_dict()))
    assert data["runs"]["hstu"][0]["model_version"] == hstu[0].model_version
    assert "hstu - most-popular" in data["intervals"]
    assert "hstu seed 1: trained" in log.getvalue()

    again = run_comparison(LOG, tmp_path, TRAIN, cfg, progress=None)
    assert all(r.reused for runs in again.runs.values() for r in runs if r.seed >= 0)
    assert [r.model_version for r in again.runs["hstu"]] == [r.model_version for r in hstu]
    assert again.runs["hstu"][0].test == hstu[0].test


def test_lr_grid_is_decided_on_validation_and_used_for_every_seed(tmp_path) -> None:
    cfg = ComparisonConfig(seeds=2, baselines=("sasrec",), lr_grid=(TRAIN.lr, 0.02))
    report = run_comparison(LOG, tmp_path, TRAIN, cfg, progress=None)
    assert set(report.selection) == {"hstu", "sasrec"}
    for family, sel in report.selection.items():
        assert set(sel["grid"]) == {TRAIN.lr, 0.02}
        assert sel["chosen"] == max(sel["grid"], key=sel["grid"].get)
        assert {r.lr for r in report.runs[family]} == {sel["chosen"]}
    assert (tmp_path / "sasrec-lr0.02-seed0").is_dir() and (tmp_path / "hstu-seed0").is_dir()
    assert "lr chosen on validation (seed 0)" in report.table()
    assert "selection" in report.to_dict()


def test_a_run_that_never_stopped_early_is_reused_under_a_larger_patience(tmp_path) -> None:
    cfg = ComparisonConfig(seeds=1, baselines=())
    first = run_comparison(LOG, tmp_path, TRAIN, cfg, progress=None).runs["hstu"][0]
    assert first.epochs_run == TRAIN.epochs and not first.reused
    for patience, reused in ((TRAIN.patience + 1, True), (0, True), (1, False)):
        more = TrainConfig(**{**TRAIN.__dict__, "patience": patience})
        run = run_comparison(LOG, tmp_path, more, cfg, progress=None).runs["hstu"][0]
        assert (run.reused, run.model_version) == (reused, first.model_version)


def test_unknown_names_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match="--baseline 'bert4rec'"):
        ComparisonConfig(baselines=("bert4rec",))
    with pytest.raises(ConfigError, match="--ablation 'no-layers'"):
        ComparisonConfig(ablations=("no-layers",))
    with pytest.raises(ConfigError, match="--seeds 0"):
        ComparisonConfig(seeds=0)
    with pytest.raises(ConfigError, match="--lr-grid"):
        ComparisonConfig(lr_grid=(0.0,))
