"""OffsetTracker: exact commit positions under out-of-order completion, gaps and rebalances."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from streamrec.worker.offset_tracker import OffsetTracker

P0 = ("playback", 0)
P1 = ("playback", 1)
I0 = ("interaction", 0)


def test_in_order_completion_commits_one_past_the_last_done():
    tracker = OffsetTracker()
    gens = {tracker.track(P0, o) for o in range(5)}
    assert len(gens) == 1  # one generation until a revoke
    gen = gens.pop()
    assert tracker.committable() == {}  # nothing moved from the starting position 0
    tracker.done(P0, 0, gen)
    tracker.done(P0, 1, gen)
    assert tracker.committable() == {P0: 2}
    for o in range(2, 5):
        tracker.done(P0, o, gen)
    assert tracker.committable() == {P0: 5}


def test_out_of_order_completion_commits_the_lowest_unfinished_offset():
    tracker = OffsetTracker()
    gen = 0
    for o in range(100, 106):
        gen = tracker.track(P0, o)
    for o in (103, 101, 105):
        tracker.done(P0, o, gen)
    assert tracker.committable() == {}  # 100 still unfinished: the position stays at 100
    tracker.done(P0, 100, gen)
    assert tracker.committable() == {P0: 102}
    tracker.done(P0, 102, gen)
    assert tracker.committable() == {P0: 104}
    tracker.done(P0, 104, gen)
    assert tracker.committable() == {P0: 106}
    assert tracker.stats().pending == {P0: 0}


def test_only_partitions_that_moved_since_the_last_commit_are_reported():
    tracker = OffsetTracker()
    g0 = tracker.track(P0, 0)
    g1 = tracker.track(P1, 50)
    tracker.track(P1, 51)
    tracker.done(P0, 0, g0)
    tracker.done(P1, 50, g1)
    positions = tracker.committable()
    assert positions == {P0: 1, P1: 51}
    tracker.mark_committed(positions)
    assert tracker.committable() == {}
    tracker.done(P1, 51, g1)
    assert tracker.committable() == {P1: 52}


def test_gaps_in_offsets_never_hold_the_position_back():
    # Compacted topics and transaction markers: offsets 3, 4, 8, 9 are never delivered.
    tracker = OffsetTracker()
    gen = 0
    for o in (0, 1, 2, 5, 6, 7, 10):
        gen = tracker.track(P0, o)
    for o in (0, 1, 2):
        tracker.done(P0, o, gen)
    assert tracker.committable() == {P0: 5}  # next unfinished, not 3
    for o in (5, 6, 7):
        tracker.done(P0, o, gen)
    assert tracker.committable() == {P0: 10}
    tracker.done(P0, 10, gen)
    assert tracker.committable() == {P0: 11}


def test_partitions_are_independent():
    tracker = OffsetTracker()
    gp = tracker.track(P0, 7)
    gi = tracker.track(I0, 3)
    tracker.track(I0, 4)
    tracker.done(I0, 4, gi)
    tracker.done(P0, 7, gp)
    assert tracker.committable() == {P0: 8}
    assert tracker.position(I0) == 3
    assert tracker.stats().pending == {P0: 0, I0: 1}


def test_revoke_returns_final_positions_and_forgets_the_partitions():
    tracker = OffsetTracker()
    g0 = tracker.track(P0, 0)
    tracker.track(P0, 1)
    g1 = tracker.track(P1, 9)
    tracker.done(P0, 0, g0)
    final = tracker.revoke([P0, P1, ("unknown", 3)])
    assert final == {P0: 1, P1: 9}
    assert tracker.partitions == []
    assert tracker.committable() == {}
    assert tracker.done(P0, 1, g0) is False  # late result for a revoked partition
    assert tracker.done(P1, 9, g1) is False
    stats = tracker.stats()
    assert (stats.stale, stats.revoked, stats.pending) == (2, 2, {})


def test_results_of_a_previous_generation_are_discarded_after_reassignment():
    tracker = OffsetTracker()
    old = tracker.track(P0, 10)
    tracker.track(P0, 11)
    tracker.revoke([P0])
    # Reassigned: the consumer restarts from the committed position and re-reads 10, 11.
    new = tracker.track(P0, 10)
    tracker.track(P0, 11)
    assert new != old
    assert tracker.done(P0, 10, old) is False  # computed before the rebalance
    assert tracker.committable() == {}
    assert tracker.done(P0, 10, new) is True
    assert tracker.committable() == {P0: 11}
    assert tracker.stats().stale == 1


def test_redelivered_offsets_and_repeated_dones_are_ignored_and_counted():
    tracker = OffsetTracker()
    gen = tracker.track(P0, 0)
    tracker.track(P0, 1)
    tracker.track(P0, 1)  # the consumer sought back within the generation
    tracker.done(P0, 1, gen)
    tracker.track(P0, 1)
    assert tracker.done(P0, 1, gen) is False
    assert tracker.done(P0, 0, gen) is True
    assert tracker.done(P0, 0, gen) is False
    assert tracker.done(P0, 42, gen) is False  # never tracked
    assert tracker.committable() == {P0: 2}
    stats = tracker.stats()
    assert (stats.tracked, stats.completed) == (2, 2)
    assert (stats.duplicate_tracks, stats.duplicate_dones) == (2, 3)


def test_many_offsets_complete_in_reverse_order():
    tracker = OffsetTracker()
    n = 20_000
    gen = 0
    for o in range(n):
        gen = tracker.track(P0, 2 * o)  # every other offset is a gap
    for o in reversed(range(1, n)):
        tracker.done(P0, 2 * o, gen)
    assert tracker.committable() == {}
    tracker.done(P0, 0, gen)
    assert tracker.committable() == {P0: 2 * (n - 1) + 1}
    assert tracker.stats().pending_total == 0


class _Model:
    """Brute force: every tracked offset with a done flag, per partition and generation."""

    def __init__(self) -> None:
        self.offsets: dict[tuple[str, int], dict[int, bool]] = {}
        self.committed: dict[tuple[str, int], int] = {}

    def position(self, tp: tuple[str, int]) -> int:
        offsets = self.offsets[tp]
        unfinished = [o for o, done in offsets.items() if not done]
        return min(unfinished) if unfinished else max(offsets) + 1

    def committable(self) -> dict[tuple[str, int], int]:
        return {
            tp: self.position(tp) for tp in self.offsets if self.position(tp) != self.committed[tp]
        }


TPS = [P0, P1, I0]
_ops = st.one_of(
    st.tuples(st.just("track"), st.sampled_from(TPS), st.integers(0, 3)),  # gap before offset
    st.tuples(st.just("done"), st.sampled_from(TPS), st.integers(0, 30)),  # index of pending
    st.tuples(st.just("stale"), st.sampled_from(TPS), st.integers(0, 30)),
    st.tuples(st.just("commit"), st.sampled_from(TPS), st.just(0)),
    st.tuples(st.just("revoke"), st.sampled_from(TPS), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_ops, max_size=120))
def test_positions_match_a_brute_force_model(ops):
    tracker = OffsetTracker()
    model = _Model()
    next_offset = dict.fromkeys(TPS, 0)
    generations: dict[tuple[str, int], int] = {}
    old_generations: dict[tuple[str, int], int] = {}
    for kind, tp, arg in ops:
        if kind == "track":
            offset = next_offset[tp] + arg
            next_offset[tp] = offset + 1
            generations[tp] = tracker.track(tp, offset)
            model.committed.setdefault(tp, offset)
            model.offsets.setdefault(tp, {})[offset] = False
        elif kind == "done" and tp in model.offsets:
            unfinished = sorted(o for o, d in model.offsets[tp].items() if not d)
            if unfinished:
                offset = unfinished[arg % len(unfinished)]
                assert tracker.done(tp, offset, generations[tp]) is True
                model.offsets[tp][offset] = True
        elif kind == "stale" and tp in old_generations and tp in model.offsets:
            offset = sorted(model.offsets[tp])[arg % len(model.offsets[tp])]
            assert tracker.done(tp, offset, old_generations[tp]) is False
        elif kind == "commit":
            positions = tracker.committable()
            tracker.mark_committed(positions)
            model.committed.update(positions)
        elif kind == "revoke":
            final = tracker.revoke([tp])
            if tp in model.offsets:
                assert final == {tp: model.position(tp)}
                del model.offsets[tp]
                del model.committed[tp]
                old_generations[tp] = generations.pop(tp)
                # The next owner resumes at the final position; offsets stay increasing.
                next_offset[tp] = max(next_offset[tp], final[tp])
            else:
                assert final == {}
        assert tracker.committable() == model.committable()
        pending = {tp: sum(not d for d in offs.values()) for tp, offs in model.offsets.items()}
        assert tracker.stats().pending == pending


def test_track_many_and_done_many_match_one_at_a_time() -> None:
    one, many = OffsetTracker(), OffsetTracker()
    tp = ("t", 0)
    gens = [one.track(tp, off) for off in (5, 6, 8, 9)]
    gen = many.track_many(tp, [5, 6, 8, 9])
    assert gens == [gen] * 4
    assert many.track_many(tp, [9, 10]) == gen  # a redelivered 9 is not tracked twice
    one.track(tp, 10)
    for tracker in (one, many):
        assert tracker.stats().duplicate_tracks == (1 if tracker is many else 0)
    assert many.done_many(tp, [5, 6, 8], gen) == 3
    for off in (5, 6, 8):
        one.done(tp, off, gen)
    assert one.committable() == many.committable() == {tp: 9}


def test_committed_reports_only_positions_the_broker_accepted() -> None:
    tracker = OffsetTracker()
    tp = ("t", 1)
    gen = tracker.track_many(tp, [0, 1, 2])
    assert tracker.committed() == {}  # the start position is not a commit of ours
    tracker.done_many(tp, [0, 1], gen)
    tracker.mark_committed(tracker.committable())
    assert tracker.committed() == {tp: 2}
    tracker.revoke([tp])
    assert tracker.committed() == {}
