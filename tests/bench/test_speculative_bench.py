"""The speculative benchmark's own logic on the CPU: forced acceptance and its rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench import speculative_bench
from bench.reference_config import ReferenceWorkload
from bench.speculative_bench import (
    _configs,
    _histories,
    _model,
    _one,
    first_divergence_gap,
    per_position,
)
from streamrec.offline.generation_evaluation import cached_users
from streamrec.pipeline.draft_catalog import DraftCatalog
from streamrec.pipeline.generation_config import GenerationConfig
from streamrec.pipeline.generation_workspace import ModelGeometry
from streamrec.pipeline.generator import Generated

TINY = ReferenceWorkload(
    name="tiny", num_layers=2, d_model=16, num_heads=2, head_dim=16, max_seq_len=64,
    num_items=400, dtype="float32", history_median=12,
)  # fmt: skip


def test_the_divergence_gap_is_taken_where_each_user_first_differs() -> None:
    ref = Generated(np.array([[1, 2, 3], [4, 5, 6]]), np.array([[0.9, 0.8, 0.7], [0.6, 0.5, 0.4]]))
    same = Generated(ref.items.copy(), ref.scores.copy())
    assert first_divergence_gap(ref, same) is None
    other = Generated(
        np.array([[1, 9, 8], [4, 5, 6]]), np.array([[0.9, 0.79, 0.1], [0.6, 0.5, 0.4]])
    )
    assert first_divergence_gap(ref, other) == 0.01  # position 1, not the later 0.6 gap


def test_the_forced_rate_is_the_held_out_one_of_the_same_gamma(tmp_path, monkeypatch) -> None:
    rows = [
        {"k": 20, "gamma": 4, "population": "all", "draft_catalog": 0, "acceptance": 0.55},
        {"k": 20, "gamma": 4, "population": "held_out", "draft_catalog": 0, "acceptance": 0.5},
        {"k": 20, "gamma": 2, "population": "held_out", "draft_catalog": 0, "acceptance": 0.63},
        {"k": 20, "gamma": 4, "population": "held_out", "draft_catalog": 500, "acceptance": 0.6},
        {"k": 10, "gamma": 4, "population": "held_out", "draft_catalog": 0, "acceptance": 0.4},
    ]
    path = tmp_path / "movielens_speculative.json"
    path.write_text(json.dumps({"rows": rows}))
    monkeypatch.setattr(speculative_bench, "MOVIELENS_RESULTS", path)
    assert speculative_bench._acceptance_from_movielens(20, 4) == 0.5
    assert speculative_bench._acceptance_from_movielens(16, 2) == 0.63  # the nearest k
    assert speculative_bench._acceptance_from_movielens(20, 3) == speculative_bench.DEFAULT_RATE


def test_per_position_rate_inverts_the_acceptance_rate() -> None:
    for rate in (0.1, 0.5, 0.9):
        a = per_position(rate, 4)
        assert abs(sum(a**i for i in range(1, 5)) / 4 - rate) < 1e-9
    assert per_position(1.0, 3) > 0.999 and per_position(0.0, 3) < 1e-9


@pytest.mark.slow
def _tiny_rows(catalog: bool) -> list[dict[str, object]]:
    t_cfg, d_cfg = _configs(TINY, draft_layers=1, draft_len=40)
    target, draft = _model(t_cfg, "cpu", 0), _model(d_cfg, "cpu", 1)
    histories = _histories(TINY, 8, t_cfg.num_items, seed=0)
    cache, user_emb = cached_users(target, histories, chunk=8)
    geo_t = ModelGeometry(t_cfg, torch.float32)
    geo_d = ModelGeometry(d_cfg, torch.float32)
    cfg = GenerationConfig(k=12, gamma=4)
    rows_from = DraftCatalog(draft, np.arange(100, 200)) if catalog else None
    return _one(target, draft, geo_t, geo_d, cache, user_emb, histories, cfg, 8,
                per_position(0.6, 4), False, 1, "cpu", catalog=rows_from)  # fmt: skip


def test_rows_are_identical_and_forced_acceptance_is_near_the_wanted_rate() -> None:
    rows = _tiny_rows(catalog=True)
    raw, forced, uncompacted, with_catalog = rows
    # forced draws decide acceptance; the catalog changes only the draft's work
    assert with_catalog["mode"] == "forced-catalog" and with_catalog["identical"] == 1.0
    assert with_catalog["acceptance"] == forced["acceptance"]
    assert raw["mode"] == "raw" and forced["mode"] == "forced"
    assert uncompacted["mode"] == "forced-uncompacted" and uncompacted["compactions"] == 0
    # the same draws per (row, position): compaction changes no row's accepted prefix
    assert forced["acceptance"] == uncompacted["acceptance"] and uncompacted["identical"] == 1.0
    assert forced["row_rounds"] < uncompacted["row_rounds"] == 8 * uncompacted["spec_rounds"]
    assert raw["identical"] == 1.0 and forced["identical"] == 1.0
    assert raw["acceptance"] < 0.1  # random weights: the draft is almost never right
    assert 0.45 < forced["acceptance"] < 0.75  # the reference rows follow a compaction
    assert forced["compactions"] >= 1 and raw["compactions"] == 0
    assert forced["spec_rounds"] < raw["spec_rounds"] <= 12 - 1
    assert forced["reference_passes"] == 1 and raw["reference_passes"] == 0  # fp32: no tie


def test_forced_items_follow_a_run_that_left_them(monkeypatch) -> None:
    """A user whose output leaves the forced sequence (on the GPU a bf16 near-tie; here
    a wrong reference for every other user) is re-seated on its own output before the
    timed runs, so the acceptance reached is the one forced."""
    seat = speculative_bench.ForcedAcceptance.set_reference

    def wrong_for_half(self, items: torch.Tensor, alpha: float, seed: int) -> None:
        items = items.clone()
        items[::2, 1:] = (items[::2, 1:] + 7) % TINY.num_items
        seat(self, items, alpha, seed)

    monkeypatch.setattr(speculative_bench.ForcedAcceptance, "set_reference", wrong_for_half)
    _, forced, uncompacted = _tiny_rows(catalog=False)
    for row in (forced, uncompacted):
        assert row["reference_passes"] >= 2 and row["identical"] == 1.0
        assert 0.45 < row["acceptance"] < 0.75
