"""The tiers benchmark's embedding section on the CPU at toy shapes: every mode's task
scores equal its all-GPU baseline, and the pinned-set mode runs where the cache has room."""

from __future__ import annotations

import torch

from bench.tiers_bench import SMOKE, embedding_section


def test_embedding_section_rows_equal_their_baselines_and_include_the_pinned_set() -> None:
    torch.set_num_threads(1)
    rows: list[dict[str, object]] = []
    embedding_section(SMOKE, torch.device("cpu"), 1.05, rows)
    modes = [r["mode"] for r in rows if r["section"] == "embedding"]
    assert modes.count("embedding cache") == len(SMOKE.slot_fractions)
    pinned = [r for r in rows if r.get("mode") == "embedding cache, set pinned"]
    # SMOKE: 2,000 members; only the 20 % fraction (4,000 slots) leaves room to pin them
    assert [r["slots"] for r in pinned] == [4_000]
    for row in rows:
        if "identical" in row:
            assert row["identical"] is True, row
    assert pinned[0]["mb_copied_per_step"] >= 0
