"""The demo's closing table: the product's claim, measured on the run that just happened.

- **Incremental vs full recompute** for the same users: the worker's last published
  scores against a from-scratch recompute of each user's stored history (the exactness
  oracle ``full_recompute``), and the time of one update of those users both ways, measured
  alike (``update_cost``).
- **Model quality**: HR@10 of the demo's model against most-popular, leave-last-out.
- **Serving**: cache hit rate, p50/p99 of every engine phase and of event-to-publish,
  throughput paced (the replay's rate) and unpaced (as fast as the worker goes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from streamrec.schemas.records import Recommendation
from streamrec.tools.update_cost import UpdateCosts

MODEL_PHASES = ("admit", "prefill", "extend", "retrieve", "rank")  # inside the model step
PHASE_ORDER = ("append", "history_get", *MODEL_PHASES)  # as a batch goes through the engine


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


class Recorder:
    """Every acknowledged recommendation: the latest per user, latencies, batch timings.

    All recommendations of one engine batch carry the same ``timings_ms`` and
    ``generated_at_ms``; grouping by them recovers each batch's phase times.
    """

    def __init__(self) -> None:
        self.latest: dict[str, Recommendation] = {}
        self.latencies_s: list[float] = []
        self.batches: set[tuple[int, tuple[tuple[str, float], ...]]] = set()

    def __call__(self, rec: Recommendation, latency_s: float) -> None:
        self.latencies_s.append(latency_s)
        last = self.latest.get(rec.user_id)
        if last is None or rec.version >= last.version:
            self.latest[rec.user_id] = rec
        if rec.timings_ms:
            self.batches.add((rec.generated_at_ms, tuple(sorted(rec.timings_ms.items()))))

    def phase_ms(self) -> dict[str, list[float]]:
        """Per phase (in pipeline order), one value per batch."""
        out: dict[str, list[float]] = {}
        for _, timings in sorted(self.batches):
            for phase, ms in timings:
                out.setdefault(phase, []).append(ms)
        order = {name: n for n, name in enumerate(PHASE_ORDER)}
        return dict(sorted(out.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


@dataclass(frozen=True)
class Throughput:
    label: str
    records: int
    seconds: float
    latencies_s: Sequence[float]

    @property
    def per_s(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Exactness:
    """The worker's last answer per user against a full recompute of the same history,
    and what one update of those users costs both ways (``update_cost``)."""

    users: int
    same_top_k: int
    max_abs_diff: float
    mean_events: float
    incremental_ms_per_user: float
    recompute_ms_per_user: float
    offline_max_abs_diff: float  # the measured incremental step against the recompute

    @classmethod
    def compare(
        cls,
        published: Mapping[str, Recommendation],
        recomputed: Mapping[str, Sequence[tuple[str, float]]],
        costs: UpdateCosts,
        events: Sequence[int],
    ) -> Exactness:
        same = 0
        worst = 0.0
        for user, expected in recomputed.items():
            got = dict(published[user].items)
            want = dict(expected)
            same += [i for i, _ in published[user].items] == [i for i, _ in expected]
            common = got.keys() & want.keys()
            worst = max([worst, *(abs(got[i] - want[i]) for i in common)])
        return cls(
            users=len(recomputed),
            same_top_k=same,
            max_abs_diff=worst,
            mean_events=float(np.mean(events)) if len(events) else 0.0,
            incremental_ms_per_user=_pct(costs.incremental_ms, 50),
            recompute_ms_per_user=_pct(costs.recompute_ms, 50),
            offline_max_abs_diff=costs.max_abs_diff,
        )


@dataclass(frozen=True)
class Quality:
    k: int
    model_hr: float
    popular_hr: float
    users: int

    @property
    def ratio(self) -> str:
        return f"{self.model_hr / self.popular_hr:.2f}x" if self.popular_hr else "n/a"


@dataclass
class DemoReport:
    source: str
    backend: str
    device: str
    model_version: str
    published: int
    dead_letters: Mapping[str, int]
    hit_rate: float
    phases: Mapping[str, Sequence[float]]
    runs: list[Throughput] = field(default_factory=list)
    exactness: Exactness | None = None
    quality: Quality | None = None

    def render(self) -> str:
        rule = "-" * 72
        lines = [
            f"-- summary ({self.source}, backend {self.backend} on {self.device}, "
            f"model {self.model_version}) " + "-" * 8,
        ]
        e = self.exactness
        if e is not None:
            speedup = (
                f"{e.recompute_ms_per_user / e.incremental_ms_per_user:.1f}x"
                if e.incremental_ms_per_user
                else "n/a"
            )
            lines += [
                f"incremental vs full recompute, {e.users} users "
                f"(histories of {e.mean_events:.0f} events on average):",
                f"  max |score difference|     {e.max_abs_diff:.2e}   "
                f"(same top-k order for {e.same_top_k}/{e.users} users)",
                f"  time per user update       incremental {e.incremental_ms_per_user:.2f} ms"
                f"  full recompute {e.recompute_ms_per_user:.2f} ms  ({speedup} faster)",
                "  (median over the users, one user at a time: the newest event appended to a"
                " cached user,",
                "   or the whole history prefilled; both then retrieve and rank; they agree to"
                f" {e.offline_max_abs_diff:.1e})",
            ]
        q = self.quality
        if q is not None:
            lines.append(
                f"model quality (leave-last-out, {q.users} users)  HR@{q.k} {q.model_hr:.4f}"
                f" vs most-popular {q.popular_hr:.4f} ({q.ratio})"
            )
        lines.append(f"cache hit rate             {self.hit_rate:.1%}")
        for run in self.runs:
            lines.append(
                f"throughput {run.label:<16}{run.per_s:>9,.0f} records/s  ({run.records} in "
                f"{run.seconds:.1f} s; event->publish p50 {_pct(run.latencies_s, 50) * 1e3:.1f}"
                f" ms, p99 {_pct(run.latencies_s, 99) * 1e3:.1f} ms)"
            )
        if self.phases:
            lines.append("engine phases per batch    " + "  ".join(
                f"{name} {_pct(ms, 50):.2f}/{_pct(ms, 99):.2f}" for name, ms in self.phases.items()
            ) + "  (p50/p99 ms)")  # fmt: skip
        letters = sum(self.dead_letters.values())
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.dead_letters.items()))
        lines.append(
            f"published                  {self.published} recommendations; "
            f"dead letters {letters}" + (f" ({kinds})" if kinds else "")
        )
        lines.append(rule)
        return "\n".join(lines)
