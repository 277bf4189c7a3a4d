import numpy as np

from bench.event_producer import Job
from bench.worker_phases import EventBook


def test_event_book_maps_versions_past_the_preload_to_timed_events() -> None:
    book = EventBook(np.array([10, 3], dtype=np.int64))  # u0 preloaded 10 tokens, u1 3
    book.add(Job(np.array([0, 1], dtype=np.int64)))  # untimed (a backlog)
    book.add(Job(np.array([0, 0, 1], dtype=np.int64), np.array([1_000, 1_010, 1_020])))
    # u0 version 12 covers its first two events: the untimed one and the one at 1,000 ms.
    assert book.latencies_ms([("u0", 12, 1.050, 0.0)]) == [50.0]
    # A redelivered (lower) version covers nothing new; version 13 covers the event at 1,010.
    assert book.latencies_ms([("u0", 11, 1.060, 0.0), ("u0", 13, 1.070, 0.0)]) == [60.0]
    assert book.latencies_ms([("u1", 5, 1.100, 0.0)]) == [80.0]
