from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from streamrec.errors import ModelError
from streamrec.offline.datasets import SyntheticSpec, read_movielens, synthetic_log
from streamrec.schemas.events import Action

MOVIELENS = Path("/work/shared/data/movielens-small/ratings.csv")


def test_movielens_csv_is_grouped_sorted_and_mapped(tmp_path) -> None:
    csv = tmp_path / "ratings.csv"
    csv.write_text(
        "userId,movieId,rating,timestamp\n7,10,4.0,300\n3,11,3.5,50\n7,12,2.0,100\n7,13,5.0,100\n"
    )
    log = read_movielens(csv)
    assert log.users == ("7", "3")
    np.testing.assert_array_equal(log.offsets, [0, 3, 4])
    assert log.items.tolist() == ["12", "13", "10", "11"]  # by time, ties in file order
    np.testing.assert_array_equal(log.ts_ms, [100_000, 100_000, 300_000, 50_000])
    assert log.actions.tolist() == [Action.VIEW, Action.LIKE, Action.LIKE, Action.VIEW]


def test_movielens_errors_name_the_file(tmp_path) -> None:
    bad = tmp_path / "r.csv"
    bad.write_text("user,item\n1,2\n")
    with pytest.raises(ModelError, match=r"r\.csv"):
        read_movielens(bad)
    with pytest.raises(ModelError, match=r"missing\.csv"):
        read_movielens(tmp_path / "missing.csv")


def test_leave_last_out_splits_each_user() -> None:
    log = synthetic_log(SyntheticSpec(num_users=5, num_items=40, events_per_user=6, seed=3))
    train, test = log.leave_last_out()
    assert train.num_users == test.num_users == 5
    assert (train.lengths() == 5).all() and (test.lengths() == 1).all()
    assert test.items.tolist() == [log.items[log.offsets[u + 1] - 1] for u in range(5)]


def test_subset_keeps_the_chosen_users_histories_in_the_order_given() -> None:
    log = synthetic_log(SyntheticSpec(num_users=5, num_items=30, events_per_user=4))
    part = log.subset(np.array([3, 1]))
    assert part.users == (log.users[3], log.users[1])
    assert part.offsets.tolist() == [0, 4, 8]
    for mine, theirs in ((0, 3), (1, 1)):
        span, src = part.user_slice(mine), log.user_slice(theirs)
        assert part.items[span].tolist() == log.items[src].tolist()
        assert part.ts_ms[span].tolist() == log.ts_ms[src].tolist()
    assert log.subset(np.array([], np.int64)).num_events == 0


def test_synthetic_is_deterministic_and_sequential() -> None:
    spec = SyntheticSpec(num_users=50, num_items=100, chain_len=10, seed=1)
    a, b = synthetic_log(spec), synthetic_log(spec)
    assert a.items.tolist() == b.items.tolist() and np.array_equal(a.ts_ms, b.ts_ms)
    assert synthetic_log(SyntheticSpec(num_users=50, seed=2)).items.tolist() != a.items.tolist()
    rows = np.array([int(i[1:]) for i in a.items])
    same_user = np.diff(np.arange(a.num_events)[:, None] >= a.offsets[None, 1:-1], axis=0)
    follows = rows[1:] == (rows[:-1] // 10) * 10 + (rows[:-1] % 10 + 1) % 10
    assert follows[~same_user.any(axis=1)].mean() > 0.8
    assert all(np.all(np.diff(a.ts_ms[a.user_slice(u)]) > 0) for u in range(a.num_users))


@pytest.mark.skipif(not MOVIELENS.exists(), reason=f"{MOVIELENS} absent")
def test_real_movielens_parses() -> None:
    log = read_movielens(MOVIELENS)
    assert log.num_users == 610 and log.num_events == 100_836
    assert all(np.all(np.diff(log.ts_ms[log.user_slice(u)]) >= 0) for u in range(610))
    assert set(log.actions.tolist()) == {Action.LIKE, Action.VIEW}
