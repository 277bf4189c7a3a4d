"""``streamrec demo`` (issue 17, items 2 and 11): MovieLens with titles when present,
synthetic otherwise, the configuration layers of ``run``, and the closing table."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from streamrec.offline.datasets import read_movielens
from streamrec.schemas.events import InteractionEvent, PlaybackEvent
from streamrec.schemas.records import CacheOutcome, Recommendation
from streamrec.tools import demo_data
from streamrec.tools.cli import main
from streamrec.tools.demo_data import (
    DemoSource,
    load_source,
    log_to_events,
    read_titles,
    replay_users,
)
from streamrec.tools.demo_report import Exactness, Recorder
from streamrec.tools.update_cost import UpdateCosts


def write_movielens(directory: Path, users: int = 40, per_user: int = 30) -> Path:
    """A small MovieLens-format data set with planted sequences and real-looking titles."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    movies = 60
    with (directory / "movies.csv").open("w") as fh:
        fh.write("movieId,title,genres\n")
        for m in range(1, movies + 1):
            fh.write(f'{m},"Film Number {m}, The ({1950 + m})",Drama\n')
    with (directory / "ratings.csv").open("w") as fh:
        fh.write("userId,movieId,rating,timestamp\n")
        for u in range(1, users + 1):
            movie = int(rng.integers(1, movies + 1))
            for e in range(per_user):
                movie = movie % movies + 1 if rng.random() < 0.8 else int(rng.integers(movies))
                rating = 4.5 if movie % 3 else 2.0
                fh.write(f"{u},{max(movie, 1)},{rating},{964_980_000 + 3_600 * e + u}\n")
    return directory / "ratings.csv"


def test_titles_come_from_movies_csv_and_are_shortened(tmp_path: Path) -> None:
    ratings = write_movielens(tmp_path / "ml")
    titles = read_titles(tmp_path / "ml" / "movies.csv")
    assert titles["7"] == "Film Number 7, The (1957)"
    source = DemoSource("movielens", read_movielens(ratings), titles, ratings)
    assert source.title("7") == "Film Number 7, The (1957)"
    assert source.title("unknown-id") == "unknown-id"
    long = DemoSource("movielens", source.log, {"1": "x" * 80})
    assert len(long.title("1")) == 26 and long.title("1").endswith("…")
    assert read_titles(tmp_path / "absent.csv") == {}


def test_source_falls_back_to_synthetic_only_without_movielens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ratings = write_movielens(tmp_path / "ml")
    monkeypatch.setattr(demo_data, "MOVIELENS_DIRS", (tmp_path / "ml",))
    assert load_source(None, synthetic=False, users=10, events_per_user=5).name == "movielens"
    assert load_source(None, synthetic=True, users=10, events_per_user=5).name == "synthetic"
    assert load_source(ratings, synthetic=False, users=10, events_per_user=5).path == ratings
    monkeypatch.setattr(demo_data, "MOVIELENS_DIRS", (tmp_path / "nowhere",))
    fallback = load_source(None, synthetic=False, users=12, events_per_user=7)
    assert (fallback.name, fallback.log.num_users) == ("synthetic", 12)
    assert set(fallback.log.lengths()) == {7}


def test_replay_interleaves_the_chosen_users_in_their_own_order(tmp_path: Path) -> None:
    log = read_movielens(write_movielens(tmp_path / "ml", users=10, per_user=6))
    users = replay_users(log, 4, min_events=6)
    assert users == [0, 1, 2, 3]
    events = log_to_events(log, 20, seed=0, users=users)
    assert len(events) == 20
    assert {e.user_id for e in events} == {log.users[u] for u in users}
    assert {e.user_id for e in events[:4]} == {log.users[u] for u in users}  # round 1 first
    for u in users:
        mine = [e.ts_ms for e in events if e.user_id == log.users[u]]
        assert mine == sorted(mine) and len(mine) == 5
    assert all(isinstance(e, PlaybackEvent | InteractionEvent) for e in events)


def rec(user: str, version: int, items: list[tuple[str, float]], at: int, **ms: float):
    return Recommendation(
        user_id=user, items=tuple(items), model_name="m", model_version="v", version=version,
        last_event_ts_ms=1, generated_at_ms=at, cache_outcome=CacheOutcome.GPU_HIT,
        timings_ms=ms,
    )  # fmt: skip


def test_recorder_keeps_one_timing_per_batch_and_exactness_compares_scores() -> None:
    recorder = Recorder()
    one = {"append": 1.0, "extend": 4.0, "rank": 2.0}
    recorder(rec("a", 1, [("x", 0.5)], 10, **one), 0.01)
    recorder(rec("b", 1, [("y", 0.4)], 10, **one), 0.02)  # same batch as a
    recorder(rec("a", 2, [("x", 0.7), ("y", 0.3)], 11, append=1.0, extend=1.0, rank=1.0), 0.03)
    assert recorder.latest["a"].version == 2 and len(recorder.latencies_s) == 3
    assert recorder.phase_ms() == {"append": [1.0, 1.0], "extend": [4.0, 1.0], "rank": [2.0, 1.0]}
    exact = Exactness.compare(
        recorder.latest,
        {"a": [("x", 0.7 + 2e-7), ("y", 0.3)], "b": [("z", 0.4)]},
        UpdateCosts(incremental_ms=[2.0, 3.0], recompute_ms=[10.0, 30.0], max_abs_diff=1e-7),
        events=[2, 1],
    )
    assert (exact.users, exact.same_top_k) == (2, 1)
    assert exact.max_abs_diff == pytest.approx(2e-7)
    assert (exact.incremental_ms_per_user, exact.recompute_ms_per_user) == (2.5, 20.0)
    assert exact.offline_max_abs_diff == 1e-7


@pytest.mark.broker
@pytest.mark.slow
def test_demo_on_movielens_shows_titles_the_claim_and_honours_the_config_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ratings = write_movielens(tmp_path / "ml")
    monkeypatch.chdir(tmp_path)  # the demo keeps its model under ./.streamrec-cache/demo
    monkeypatch.setenv("STREAMREC_SCORING__TOP_K", "2")  # an environment layer it must honour
    argv = ["demo", "--ratings", str(ratings), "--num-events", "300", "--unpaced-events",
            "500", "--users", "30", "--rate", "1500",
            "--set", "batching.max_batch_users=16"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "data: MovieLens (40 users, 1,200 ratings" in out
    assert "training the demo model on movielens data" in out
    watched = [line for line in out.splitlines() if " ms  Film Number " in line]
    assert watched, out
    assert all(line.count(" · ") == 1 for line in watched)  # top_k = 2 from the environment
    diff = re.search(r"max \|score difference\|\s+(\S+)", out)
    assert diff is not None and float(diff.group(1)) < 1e-4
    same = re.search(r"same top-k order for (\d+)/(\d+) users", out)
    assert same is not None and same.group(1) == same.group(2) and int(same.group(2)) > 0
    for needle in ("full recompute", "HR@10", "vs most-popular", "cache hit rate",
                   "throughput paced", "throughput unpaced", "engine phases per batch",
                   "key_mismatch 1", "(p50/p99 ms)"):  # fmt: skip
        assert needle in out, needle

    # The model is kept: a second run reuses it, and STREAMREC_MODEL__BACKEND reaches
    # the loader (no package was exported, so that is a one-line start-up error).
    monkeypatch.setenv("STREAMREC_MODEL__BACKEND", "aoti")
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "training the demo model" not in captured.out
    assert captured.err.startswith("streamrec demo: error: model.backend is 'aoti'")
    assert captured.err.count("\n") == 1
