"""The demo's update-cost measurement: both paths on the same histories, same answers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from streamrec.cache.history_store import History
from streamrec.models.checkpoint import load_checkpoint
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.tools.update_cost import measure_update_costs
from streamrec.worker.serving_stack import serving_scoring
from tests.worker.harness import tiny_model_dir


def history(rng: np.random.Generator, n: int, num_items: int) -> History:
    table = np.stack(
        [rng.integers(5, num_items, n), rng.integers(1, 5, n), 1_000 * np.arange(n)], axis=1
    ).astype(np.int64)  # [n, 3]
    return History.from_table(table, {}, n)


def test_incremental_and_recompute_are_timed_for_the_same_users_and_agree(tmp_path: Path) -> None:
    ckpt = load_checkpoint(tiny_model_dir(tmp_path / "m"))
    hstu = ckpt.config
    scoring = serving_scoring(ScoringConfig(num_candidates=16, top_k=5), hstu)
    rng = np.random.default_rng(0)
    histories = {f"u{n}": history(rng, n, hstu.num_items) for n in (1, 7, 16, 17, 40)}
    costs = measure_update_costs(ckpt.model, hstu, scoring, histories, torch.device("cpu"), 8)
    assert len(costs.incremental_ms) == len(costs.recompute_ms) == 4  # one event: no update
    assert all(ms > 0 for ms in costs.incremental_ms + costs.recompute_ms)
    assert costs.max_abs_diff < 1e-5
