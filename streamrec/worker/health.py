"""What ``/healthz`` (liveness) and ``/readyz`` (readiness) answer, and why.

Kubernetes restarts a pod whose liveness probe fails and stops routing to one whose
readiness probe fails, so the two must mean different things (deploy/README.md, "Probes"):

- **Live** unless the worker is broken in a way a restart fixes: a fatal error, or a loop
  that stopped moving. Waiting out a dependency outage is *not* broken: while the history
  store is retried or the broker is unreachable the loops keep trying, and restarting
  every pod of the group at once would only add a rebalance storm to the outage.
- **Ready** when the model is loaded, partitions are assigned, the broker answers, and
  the worker is not shutting down.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class HealthState:
    """A snapshot of what the probes look at (monotonic seconds)."""

    now: float
    fatal: BaseException | None
    stopping: bool
    model_loaded: bool
    owned_partitions: int
    last_fetch: float
    last_step: float
    queued_events: int
    last_store_retry: float  # 0.0: never
    broker_down_since: float | None


@dataclass(frozen=True)
class ProbeAnswer:
    ok: bool
    reason: str


class Health:
    def __init__(self, stall_timeout_s: float, state: Callable[[], HealthState]) -> None:
        self._stall = stall_timeout_s
        self._state = state

    def live(self) -> ProbeAnswer:
        s = self._state()
        problems = []
        if s.fatal is not None:
            problems.append(f"fatal error: {s.fatal!r}")
        if s.model_loaded and s.owned_partitions and s.now - s.last_fetch > self._stall:
            problems.append(f"no fetch for {s.now - s.last_fetch:.0f}s")
        waiting_out = s.broker_down_since is not None or (
            s.last_store_retry and s.now - s.last_store_retry <= self._stall
        )
        if s.queued_events and s.now - s.last_step > self._stall and not waiting_out:
            problems.append(f"{s.queued_events} events queued, no batch for {self._stall:.0f}s")
        if problems:
            return ProbeAnswer(False, "; ".join(problems))
        if waiting_out:
            return ProbeAnswer(True, "ok (waiting out a dependency outage)")
        return ProbeAnswer(True, "ok")

    def ready(self) -> ProbeAnswer:
        s = self._state()
        if s.stopping:
            return ProbeAnswer(False, "not ready: shutting down")
        if not s.model_loaded:
            return ProbeAnswer(False, "not ready: model not loaded")
        if s.broker_down_since is not None:
            down = s.now - s.broker_down_since
            return ProbeAnswer(False, f"not ready: broker unreachable for {down:.0f}s")
        if not s.owned_partitions:
            return ProbeAnswer(False, "not ready: no partitions assigned")
        return ProbeAnswer(True, "ready")
