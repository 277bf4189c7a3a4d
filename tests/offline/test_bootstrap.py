from __future__ import annotations

import numpy as np
import pytest

from streamrec.errors import ConfigError
from streamrec.offline.bootstrap import BootstrapConfig, paired_bootstrap


def test_identical_models_differ_by_exactly_zero() -> None:
    a = np.random.default_rng(0).random(200)
    interval = paired_bootstrap(a, a.copy())
    assert (interval.diff, interval.low, interval.high) == (0.0, 0.0, 0.0)
    assert not interval.excludes_zero


def test_seeds_are_resampled_per_model() -> None:
    """Three runs each, the same three: seed s of one is no partner of seed s of the
    other, so the seed spread widens the interval, which still holds zero."""
    runs = np.random.default_rng(0).random((3, 200))
    interval = paired_bootstrap(runs, runs.copy())
    assert interval.diff == 0.0 and interval.low < 0.0 < interval.high


def test_pairing_removes_the_user_noise() -> None:
    """b = a - 0.01 for every user: unpaired the noise would swamp 0.01, paired it cannot."""
    a = np.random.default_rng(1).random(500)
    interval = paired_bootstrap(a, a - 0.01)
    assert interval.low == pytest.approx(0.01) and interval.high == pytest.approx(0.01)
    assert interval.excludes_zero and "+0.0100" in str(interval)


def test_interval_covers_the_true_difference_and_widens_with_seed_noise() -> None:
    rng = np.random.default_rng(2)
    users = rng.random(600) < 0.07  # HR-like 0/1 per user
    a = np.stack([(users | (rng.random(600) < 0.02)).astype(float) for _ in range(5)])
    b = users.astype(float)
    one = paired_bootstrap(a[:1], b, BootstrapConfig(samples=500))
    five = paired_bootstrap(a, b, BootstrapConfig(samples=500))
    assert five.low <= five.diff <= five.high and five.low > 0
    shifted = a + rng.normal(0, 0.02, size=(5, 1))  # each seed off by its own constant
    noisy = paired_bootstrap(shifted, b, BootstrapConfig(samples=500))
    assert noisy.high - noisy.low > five.high - five.low
    assert one.confidence == 0.95


def test_mistakes_are_named() -> None:
    with pytest.raises(ConfigError, match="5 users in a but 4 in b"):
        paired_bootstrap(np.zeros(5), np.zeros(4))
    with pytest.raises(ConfigError, match="samples=3"):
        BootstrapConfig(samples=3)
    with pytest.raises(ConfigError, match=r"confidence=1\.5"):
        BootstrapConfig(confidence=1.5)
