"""The one retry schedule: exponential ceiling, full jitter, reset after success."""

from __future__ import annotations

import random

import pytest

from streamrec.backoff import Backoff
from streamrec.errors import ConfigError


def test_delays_stay_under_a_doubling_ceiling_capped_at_max() -> None:
    backoff = Backoff(0.1, 1.0, rng=random.Random(7))
    ceilings = []
    for _ in range(8):
        ceiling = backoff.ceiling()
        delay = backoff.next_delay()
        assert 0.0 <= delay <= ceiling
        ceilings.append(ceiling)
    assert ceilings == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0]
    backoff.reset()
    assert backoff.ceiling() == 0.1


def test_two_workers_do_not_retry_in_lockstep() -> None:
    a = Backoff(0.1, 10.0, rng=random.Random(1))
    b = Backoff(0.1, 10.0, rng=random.Random(2))
    delays_a = [a.next_delay() for _ in range(6)]
    delays_b = [b.next_delay() for _ in range(6)]
    assert all(abs(x - y) > 1e-9 for x, y in zip(delays_a, delays_b, strict=True))


@pytest.mark.parametrize(("initial", "maximum"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 1.0)])
def test_bad_bounds_name_the_values(initial: float, maximum: float) -> None:
    with pytest.raises(ConfigError, match=str(initial)):
        Backoff(initial, maximum)
