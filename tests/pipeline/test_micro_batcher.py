"""MicroBatcher behaviour on a fake clock: nothing here sleeps or reads real time."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrec.errors import PipelineError
from streamrec.pipeline.clock import FakeClock
from streamrec.pipeline.delta import Delta, SourceOffset, event_time_order
from streamrec.pipeline.micro_batcher import (
    Batch,
    BatcherClosed,
    BatcherConfig,
    MicroBatcher,
    ReleaseReason,
)

MS = 0.001


def delta(user: str, offset: int, topic: str = "playback", partition: int = 0) -> Delta:
    return Delta(
        user_id=user,
        item_id=f"item-{offset}",
        action=1,
        ts_ms=1_000 + offset,
        topic=topic,
        partition=partition,
        offset=offset,
    )


def make(
    clock: FakeClock,
    max_batch_users: int = 3,
    max_wait_ms: float = 5.0,
    high: int = 100,
    low: int = 10,
    capacity: int | None = None,
    release_when_idle: bool = True,
) -> MicroBatcher:
    config = BatcherConfig(
        max_batch_users=max_batch_users,
        max_wait_ms=max_wait_ms,
        queue_high_watermark=high,
        queue_low_watermark=low,
        max_queue_events=capacity,
        release_when_idle=release_when_idle,
    )
    return MicroBatcher(config, clock)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def test_releases_by_size_as_soon_as_enough_distinct_users_are_pending(clock):
    batcher = make(clock, max_batch_users=3)
    pending = asyncio.create_task(batcher.next_batch())
    batcher.submit(delta("a", 0))
    batcher.submit(delta("a", 1))  # a second event of a pending user does not count
    batcher.submit(delta("b", 2))
    await clock.settle()
    assert not pending.done()
    batcher.submit(delta("c", 3))
    await clock.settle()
    batch = pending.result()
    assert batch.reason is ReleaseReason.SIZE
    assert [u.user_id for u in batch.users] == ["a", "b", "c"]
    assert batch.n_events == 4
    assert batch.released_at == 0.0
    assert batcher.depth == 0


async def test_releases_by_time_when_the_oldest_delta_reaches_max_wait(clock):
    batcher = make(clock, max_batch_users=3, max_wait_ms=5.0)
    pending = asyncio.create_task(batcher.next_batch())
    batcher.submit(delta("a", 0))
    await clock.advance(3 * MS)
    batcher.submit(delta("b", 1))  # a younger delta does not push the deadline back
    await clock.advance(1.999 * MS)
    assert not pending.done()
    await clock.advance(0.001 * MS)
    batch = pending.result()
    assert batch.reason is ReleaseReason.TIME
    assert [u.user_id for u in batch.users] == ["a", "b"]
    assert batch.oldest_wait_s == pytest.approx(5 * MS)
    assert batch.queue_delays_s() == pytest.approx([5 * MS, 2 * MS])


async def test_a_late_consumer_gets_an_overdue_batch_immediately(clock):
    batcher = make(clock, max_wait_ms=5.0)
    batcher.submit(delta("a", 0))
    await clock.advance(20 * MS)
    batch = await batcher.next_batch()
    assert batch.reason is ReleaseReason.TIME
    assert batch.oldest_wait_s == pytest.approx(20 * MS)


async def test_an_idle_consumer_gets_pending_users_without_the_window(clock):
    batcher = make(clock, max_batch_users=3, max_wait_ms=5.0)
    batcher.set_consumer_idle(True)
    pending = asyncio.create_task(batcher.next_batch())
    await clock.settle()
    assert not pending.done()  # nothing pending: idle alone releases nothing
    batcher.submit_many([delta("a", 0), delta("b", 1)])
    await clock.settle()
    batch = pending.result()
    assert (batch.reason, batch.released_at) == (ReleaseReason.IDLE, 0.0)
    assert [u.user_id for u in batch.users] == ["a", "b"]
    assert batcher.stats().released_by_idle == 1


async def test_a_busy_consumer_waits_out_the_window_and_idleness_ends_it(clock):
    batcher = make(clock, max_batch_users=3, max_wait_ms=5.0)
    batcher.set_consumer_idle(False)  # a step is running: coalesce behind it
    pending = asyncio.create_task(batcher.next_batch())
    batcher.submit(delta("a", 0))
    await clock.advance(2 * MS)
    batcher.submit(delta("b", 1))
    await clock.advance(1 * MS)
    assert not pending.done()
    batcher.set_consumer_idle(True)  # the step finished at 3 ms: release now, not at 5
    await clock.settle()
    batch = pending.result()
    assert batch.reason is ReleaseReason.IDLE
    assert batch.queue_delays_s() == pytest.approx([3 * MS, 1 * MS])


async def test_release_when_idle_off_keeps_the_window_for_an_idle_consumer(clock):
    batcher = make(clock, max_wait_ms=5.0, release_when_idle=False)
    batcher.set_consumer_idle(True)
    pending = asyncio.create_task(batcher.next_batch())
    batcher.submit(delta("a", 0))
    await clock.advance(4.999 * MS)
    assert not pending.done()
    await clock.advance(0.001 * MS)
    assert pending.result().reason is ReleaseReason.TIME


async def test_zero_max_wait_releases_whatever_is_pending_at_once(clock):
    batcher = make(clock, max_wait_ms=0.0)
    pending = asyncio.create_task(batcher.next_batch())
    await clock.settle()
    assert not pending.done()
    batcher.submit(delta("a", 0))
    await clock.settle()
    assert pending.result().reason is ReleaseReason.TIME


async def test_coalesces_each_users_events_in_event_time_order_with_their_sources(clock):
    batcher = make(clock, max_batch_users=5)
    arrivals = [
        delta("a", 10, "playback", 1),
        delta("b", 11, "playback", 2),
        delta("a", 7, "interaction", 1),
        delta("c", 12, "playback", 0),
        delta("a", 11, "playback", 1),
    ]
    for d in arrivals:
        batcher.submit(d)
    await clock.advance(5 * MS)
    batch = await batcher.next_batch()
    assert [u.user_id for u in batch.users] == ["a", "b", "c"]
    a = batch.users[0]
    assert a.n_events == 3
    # The interaction arrived second but happened first: the two partitions merge by time.
    assert a.item_ids == ("item-7", "item-10", "item-11")
    assert a.ts_ms == (1_007, 1_010, 1_011)
    assert a.newest_ts_ms == 1_011
    assert a.sources == (
        SourceOffset("interaction", 1, 7),
        SourceOffset("playback", 1, 10),
        SourceOffset("playback", 1, 11),
    )
    assert sorted(batch.sources()) == sorted(d.source for d in arrivals)


def test_event_time_merge_keeps_each_partitions_offset_order() -> None:
    """An event time that goes back inside one partition stays where the producer put it
    (the store's per-partition watermarks need offset order); only partitions interleave."""
    late = delta("a", 2)._replace(ts_ms=10)  # playback offset 2 happened before offset 1
    early = delta("a", 1)._replace(ts_ms=50)
    other = delta("a", 1, "interaction")._replace(ts_ms=20)
    merged = event_time_order([early, late, other])
    assert [(d.topic, d.offset) for d in merged] == [
        ("interaction", 1),
        ("playback", 1),
        ("playback", 2),
    ]
    # The same events fetched in another interleaving give the same order.
    assert event_time_order([other, early, late]) == merged


async def test_more_users_than_a_batch_holds_are_split_oldest_first_in_sequence(clock):
    batcher = make(clock, max_batch_users=2)
    for i, user in enumerate(["u0", "u1", "u2", "u3", "u4", "u0"]):
        batcher.submit(delta(user, i))
    first, second = await batcher.next_batch(), await batcher.next_batch()
    assert (first.seq, second.seq) == (0, 1)
    assert [u.user_id for u in first.users] == ["u0", "u1"]
    assert first.users[0].n_events == 2  # u0's later event joins its pending delta
    assert [u.user_id for u in second.users] == ["u2", "u3"]
    assert batcher.stats().queue_depth_users == 1
    # A user's events arriving after its batch left go to a later batch, never an earlier one.
    batcher.submit(delta("u0", 99))
    await clock.advance(5 * MS)
    third = await batcher.next_batch()
    assert [u.user_id for u in third.users] == ["u4", "u0"]
    assert third.users[1].sources == (SourceOffset("playback", 0, 99),)


async def test_watermarks_pause_at_high_and_resume_at_low_without_flapping(clock):
    batcher = make(clock, max_batch_users=1, max_wait_ms=0.0, high=4, low=1, capacity=6)
    signals: list[bool] = []
    batcher.on_pressure(signals.append)
    for i in range(3):
        batcher.submit(delta(f"u{i}", i))
    assert signals == [] and not batcher.paused
    batcher.submit(delta("u3", 3))
    assert signals == [True] and batcher.paused
    batcher.submit(delta("u4", 4))
    await batcher.next_batch()  # depth 5 -> 4: still above low, and no second pause
    batcher.submit(delta("u5", 5))  # back to 5, above high again: no repeated signal
    for _ in range(3):
        await batcher.next_batch()
    assert batcher.depth == 2
    assert signals == [True]
    await batcher.next_batch()  # depth 1 == low: resume
    assert signals == [True, False] and not batcher.paused
    batcher.submit(delta("u6", 6))  # between low and high: no pause
    assert signals == [True, False]
    stats = batcher.stats()
    assert (stats.pauses, stats.resumes, stats.max_queue_depth_events) == (1, 1, 5)


async def test_wait_resumed_blocks_while_paused(clock):
    batcher = make(clock, max_batch_users=1, max_wait_ms=0.0, high=2, low=0, capacity=4)
    await batcher.wait_resumed()  # not paused: returns at once
    batcher.submit(delta("a", 0))
    batcher.submit(delta("b", 1))
    waiter = asyncio.create_task(batcher.wait_resumed())
    await clock.settle()
    assert not waiter.done()
    await batcher.next_batch()
    await clock.settle()
    assert not waiter.done()  # depth 1 > low 0
    await batcher.next_batch()
    await clock.settle()
    assert waiter.done()


async def test_submit_rejects_at_capacity_and_accepts_again_after_a_release(clock):
    batcher = make(clock, max_batch_users=1, high=2, low=0, capacity=3)
    assert all(batcher.submit(delta("a", i)) for i in range(3))
    rejected = delta("b", 3)
    assert batcher.submit(rejected) is False
    assert batcher.submit(rejected) is False
    stats = batcher.stats()
    assert (stats.rejected, stats.submitted, stats.queue_depth_events) == (2, 3, 3)
    batch = await batcher.next_batch()
    assert batch.n_events == 3
    assert batcher.submit(rejected) is True
    assert batcher.stats().rejected == 2


async def test_close_drains_pending_at_once_then_raises(clock):
    batcher = make(clock, max_batch_users=2, max_wait_ms=50.0)
    for i, user in enumerate(["a", "b", "c"]):
        batcher.submit(delta(user, i))
    batcher.close()
    with pytest.raises(BatcherClosed):
        batcher.submit(delta("d", 9))
    batches = [b async for b in batcher]
    assert [b.reason for b in batches] == [ReleaseReason.SIZE, ReleaseReason.CLOSE]
    assert [u.user_id for b in batches for u in b.users] == ["a", "b", "c"]
    with pytest.raises(BatcherClosed):
        await batcher.next_batch()


async def test_close_wakes_a_consumer_waiting_on_an_empty_queue(clock):
    batcher = make(clock)
    consumer = asyncio.create_task(batcher.next_batch())
    await clock.settle()
    batcher.close()
    await clock.settle()
    with pytest.raises(BatcherClosed):
        consumer.result()
    assert clock.pending_timers == 0


async def test_only_one_consumer_may_wait(clock):
    batcher = make(clock)
    first = asyncio.create_task(batcher.next_batch())
    await clock.settle()
    with pytest.raises(PipelineError, match="one consumer"):
        await batcher.next_batch()
    batcher.close()
    await clock.settle()
    assert isinstance(first.exception(), BatcherClosed)


async def test_discard_drops_revoked_partitions_and_may_resume(clock):
    batcher = make(clock, max_batch_users=10, high=3, low=1, capacity=5)
    signals: list[bool] = []
    batcher.on_pressure(signals.append)
    batcher.submit(delta("a", 0, "playback", 0))
    batcher.submit(delta("b", 1, "playback", 1))
    batcher.submit(delta("a", 2, "interaction", 0))
    batcher.submit(delta("c", 3, "playback", 2))
    assert signals == [True]
    dropped = batcher.discard([("playback", 0), ("interaction", 0), ("playback", 2)])
    assert dropped == 3
    assert signals == [True, False]
    await clock.advance(5 * MS)
    batch = await batcher.next_batch()
    assert [u.user_id for u in batch.users] == ["b"]
    assert batcher.stats().discarded == 3


async def test_stats_count_releases_sizes_and_delays(clock):
    batcher = make(clock, max_batch_users=2, max_wait_ms=4.0)
    batcher.submit(delta("a", 0))
    batcher.submit(delta("b", 1))
    await batcher.next_batch()  # by size, no delay
    batcher.submit(delta("c", 2))
    await clock.advance(1 * MS)
    batcher.submit(delta("c", 3))
    await clock.advance(3 * MS)
    await batcher.next_batch()  # by time: delays 4 ms and 3 ms
    stats = batcher.stats()
    assert (stats.batches, stats.released_by_size, stats.released_by_time) == (2, 1, 1)
    assert (stats.users_released, stats.events_released) == (3, 4)
    assert stats.mean_batch_users == 1.5
    assert stats.queue_delay_sum_s == pytest.approx(7 * MS)
    assert stats.queue_delay_max_s == pytest.approx(4 * MS)
    assert stats.oldest_wait_sum_s == pytest.approx(4 * MS)
    assert stats.mean_queue_delay_s == pytest.approx(7 * MS / 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_users": 0}, "max_batch_users = 0"),
        ({"max_wait_ms": -1.0}, "max_wait_ms = -1.0"),
        ({"queue_high_watermark": 5, "queue_low_watermark": 5}, "queue_low_watermark = 5"),
        (
            {"queue_high_watermark": 8, "queue_low_watermark": 1, "max_queue_events": 7},
            "max_queue_events = 7",
        ),
    ],
)
def test_config_rejects_inconsistent_knobs_naming_the_values(kwargs, message):
    with pytest.raises(PipelineError, match=message):
        BatcherConfig(**kwargs)


def test_default_capacity_leaves_room_above_the_high_watermark():
    config = BatcherConfig(queue_high_watermark=100, queue_low_watermark=10)
    assert config.capacity == 200


async def _replay(
    arrivals: list[tuple[int, int]], max_users: int, wait_ms: int, step_ms: int
) -> tuple[list[Batch], list[float]]:
    """Feed arrivals (gap ms, user index) while a consumer spends ``step_ms`` per batch."""
    clock = FakeClock()
    batcher = make(clock, max_batch_users=max_users, max_wait_ms=float(wait_ms))
    batches: list[Batch] = []
    delays: list[float] = []

    async def consume() -> None:
        async for batch in batcher:
            batches.append(batch)
            delays.extend(batch.queue_delays_s())
            await clock.sleep(step_ms * MS)

    consumer = asyncio.create_task(consume())
    for offset, (gap_ms, user) in enumerate(arrivals):
        await clock.advance(gap_ms * MS)
        assert batcher.submit(delta(f"u{user}", offset))
    await clock.advance((wait_ms + step_ms + 1) * MS)
    assert batcher.stats().events_released == len(arrivals)  # all released before close
    batcher.close()
    await clock.advance((step_ms + 1) * MS)
    await consumer
    return batches, delays


@settings(max_examples=60, deadline=None)
@given(
    max_users=st.integers(1, 6),
    wait_ms=st.integers(0, 10),
    step_ms=st.integers(0, 10),
    data=st.data(),
)
def test_no_delta_waits_longer_than_max_wait_plus_one_step(max_users, wait_ms, step_ms, data):
    # The users are at most max_batch_users, so every release empties the queue and a
    # delta waits at most for the step in progress and then for its own deadline.
    arrivals = data.draw(
        st.lists(st.tuples(st.integers(0, 8), st.integers(0, max_users - 1)), max_size=40)
    )
    batches, delays = asyncio.run(_replay(arrivals, max_users, wait_ms, step_ms))
    assert len(delays) == len(arrivals)
    assert all(d <= (wait_ms + step_ms) * MS + 1e-9 for d in delays)
    assert all(b.n_users <= max_users for b in batches)
    assert [b.seq for b in batches] == list(range(len(batches)))
    # Every delta released exactly once, each user's in arrival order.
    per_user: dict[str, list[int]] = {}
    for b in batches:
        for u in b.users:
            per_user.setdefault(u.user_id, []).extend(s.offset for s in u.sources)
    assert sorted(o for offs in per_user.values() for o in offs) == list(range(len(arrivals)))
    assert all(offs == sorted(offs) for offs in per_user.values())
