import itertools
from collections import Counter

import pytest

from bench.cpu_worker_vs_naive import StreamSpec, make_stream
from streamrec.errors import ConfigError
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.schemas.events import InteractionEvent, PlaybackEvent

VOCAB = ItemVocabulary([f"i{n}" for n in range(50)], num_oov_buckets=2)


def test_stream_is_skewed_capped_and_time_ordered() -> None:
    events = make_stream(StreamSpec(events=2_000, users=100, max_per_user=64, seed=3), VOCAB)
    counts = Counter(e.user_id for e in events)
    assert len(events) == 2_000
    assert max(counts.values()) == 64  # the hottest users hit the cap
    assert min(counts.values()) < 10  # ... and the tail stays quiet
    assert all(a.ts_ms < b.ts_ms for a, b in itertools.pairwise(events))
    assert {e.item_id for e in events} <= set(VOCAB.items)
    kinds = Counter(type(e) for e in events)
    assert kinds[PlaybackEvent] > kinds[InteractionEvent] > 0


def test_stream_without_cap_lets_a_user_exceed_the_window() -> None:
    events = make_stream(StreamSpec(events=2_000, users=100, seed=3), VOCAB)
    assert max(Counter(e.user_id for e in events).values()) > 64


def test_cap_too_small_for_the_stream_is_rejected_with_the_numbers() -> None:
    with pytest.raises(ConfigError, match="100 users x max_per_user=10 cannot carry 2000"):
        StreamSpec(events=2_000, users=100, max_per_user=10)
