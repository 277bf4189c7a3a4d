"""The metric names are a contract with deploy/ (alerts, dashboard)."""

from __future__ import annotations

import re
from pathlib import Path

from streamrec.worker.metrics import WorkerMetrics

README = Path(__file__).resolve().parents[2] / "deploy" / "README.md"


def test_exports_exactly_the_documented_names() -> None:
    documented = set(re.findall(r"^\| `(streamrec_[a-z_]+)` \|", README.read_text(), re.M))
    metrics = WorkerMetrics()
    metrics.set_backend("eager")
    text = metrics.render()[0].decode()
    exposed = set(re.findall(r"^# HELP (streamrec_\w+) ", text, re.M))
    assert {name for name in exposed if not name.endswith("_created")} == documented


def test_cumulative_stats_become_counter_increments() -> None:
    metrics = WorkerMetrics()
    metrics.set_backend("aoti")
    assert metrics.sample("streamrec_model_backend", {"backend": "aoti"}) == 1.0
    assert metrics.sample("streamrec_model_backend", {"backend": "eager"}) == 0.0
    metrics.set_lag({("pb", 0): 5, ("pb", 1): 2})
    metrics.set_lag({("pb", 1): 3})
    assert metrics.sample("streamrec_consumer_lag", {"topic": "pb", "partition": "0"}) is None
    assert metrics.sample("streamrec_consumer_lag", {"topic": "pb", "partition": "1"}) == 3.0
