import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from streamrec.cache.retrieval_set import RetrievalSet
from streamrec.errors import ConfigError
from streamrec.pipeline.item_catalog import retrieve_members

FIRST = 3  # padding + 2 OOV rows


def _table(rows: int = 40, dim: int = 8) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(1))


def test_retrieve_is_exact_over_the_members_and_masks_excluded_rows() -> None:
    table = _table()
    members = np.array([5, 9, 12, 20, 33, 7], dtype=np.int64)
    rset = RetrievalSet(table, "cpu", 6, FIRST, initial=members)
    user = F.normalize(torch.randn(2, 8, generator=torch.Generator().manual_seed(2)), dim=-1)
    exclude = np.array([[9, -1, 30], [-1, -1, -1]])  # 30 is no member: nothing to mask
    scores, items = retrieve_members(rset, user, 4, rset.excluded_rows(exclude))
    exact = user @ F.normalize(table, dim=-1)[members].t()  # [2, 6]
    exact[0, 1] = float("-inf")
    want_scores, want_pos = torch.topk(exact, 4, dim=1)
    assert torch.equal(items, torch.from_numpy(members)[want_pos])
    torch.testing.assert_close(scores, want_scores)
    assert 9 not in items[0].tolist()
    _, all_items = retrieve_members(
        rset, user, 10, rset.excluded_rows(np.zeros((2, 0), np.int64))
    )  # k clamps to N
    assert all_items.shape == (2, 6)


def test_refresh_swaps_in_the_most_played_items_with_hysteresis() -> None:
    rset = RetrievalSet(_table(), "cpu", 4, FIRST, half_life_events=1e9)  # members 3..6
    rset.observe(np.array([3, 3, 4, 4, 5, 5, 6, 6]))  # every member played twice
    rset.observe(np.array([30, 30, 31, 31, 31, 32]))  # 30 ties a member: no swap
    plan = rset.refresh()
    assert sorted(plan.enter.tolist()) == [31]
    assert sorted(rset.members.tolist()) == [4, 5, 6, 31]  # the first of the tied weakest
    assert rset.stats().swapped == 1
    pos = int(np.flatnonzero(rset.members == 31)[0])
    torch.testing.assert_close(rset.table[pos + 1], F.normalize(_table()[31], dim=-1))
    assert int(rset.items[pos + 1]) == 31
    stats = rset.stats()
    assert stats.events == 14 and stats.events_in_set == 8 and stats.refreshes == 1


def test_decay_lets_recent_items_overtake_old_favourites() -> None:
    rset = RetrievalSet(_table(), "cpu", 2, FIRST, half_life_events=10)
    rset.observe(np.repeat(np.array([3, 4]), 20))  # old favourites, members already
    rset.observe(np.array([25] * 15 + [26] * 15))  # three half-lives later: 8x heavier each
    rset.refresh()
    assert sorted(rset.members.tolist()) == [25, 26]
    rset.observe(np.zeros(0, np.int64))


def test_tick_plans_in_the_background_and_applies_on_the_caller() -> None:
    rset = RetrievalSet(_table(), "cpu", 3, FIRST, refresh_events=5)
    rset.observe(np.array([20, 20, 21, 21, 22, 22]))
    assert rset.tick() is False  # plan started
    deadline = time.monotonic() + 10
    while not rset.tick():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sorted(rset.members.tolist()) == [20, 21, 22]
    rset.close()


def test_retrieval_set_misuse() -> None:
    with pytest.raises(ConfigError, match=r"size=38 must be in 1\.\.37"):
        RetrievalSet(_table(), "cpu", 38, FIRST)
    with pytest.raises(ConfigError, match="distinct rows"):
        RetrievalSet(_table(), "cpu", 2, FIRST, initial=np.array([1, 5]))
    with pytest.raises(ConfigError, match="2-D host tensor"):
        RetrievalSet(torch.zeros(4), "cpu", 1, 0)
