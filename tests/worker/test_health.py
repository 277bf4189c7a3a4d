"""Probe semantics: liveness survives a dependency outage, readiness follows the broker."""

from __future__ import annotations

import dataclasses

from streamrec.worker.health import Health, HealthState

STALL = 10.0
SERVING = HealthState(
    now=1_000.0,
    fatal=None,
    stopping=False,
    model_loaded=True,
    owned_partitions=4,
    last_fetch=999.0,
    last_step=999.0,
    queued_events=0,
    last_store_retry=0.0,
    broker_down_since=None,
)


def probe(**changes: object) -> Health:
    state = dataclasses.replace(SERVING, **changes)  # type: ignore[arg-type]
    return Health(STALL, lambda: state)


def test_a_serving_worker_is_live_and_ready() -> None:
    health = probe()
    assert health.live().ok and health.ready().ok


def test_a_store_outage_being_retried_keeps_the_pod_alive() -> None:
    # Events wait, no batch finished for longer than the stall bound, but the engine is
    # retrying the store right now: restarting the pod would not help.
    health = probe(queued_events=500, last_step=900.0, last_store_retry=999.5)
    answer = health.live()
    assert answer.ok and "outage" in answer.reason
    assert health.ready().ok


def test_a_stuck_pipeline_without_retries_is_not_live() -> None:
    health = probe(queued_events=500, last_step=900.0, last_store_retry=800.0)
    answer = health.live()
    assert not answer.ok and "500 events queued" in answer.reason


def test_an_unreachable_broker_makes_the_pod_unready_but_not_dead() -> None:
    health = probe(broker_down_since=990.0, last_step=900.0, queued_events=3)
    assert health.live().ok
    answer = health.ready()
    assert not answer.ok and "broker unreachable for 10s" in answer.reason


def test_fatal_errors_and_a_stopped_fetch_loop_fail_liveness() -> None:
    assert "fatal" in probe(fatal=RuntimeError("boom")).live().reason
    assert "no fetch for 100s" in probe(last_fetch=900.0).live().reason


def test_readiness_reasons() -> None:
    assert probe(model_loaded=False).ready().reason == "not ready: model not loaded"
    assert probe(owned_partitions=0).ready().reason == "not ready: no partitions assigned"
    assert probe(stopping=True).ready().reason == "not ready: shutting down"
