"""Prometheus metrics of one worker: the only module that imports ``prometheus_client``.

The names are a contract with ``deploy/`` (alerts and the dashboard use exactly these; see
deploy/README.md, "Metrics contract"). Two kinds of sources feed them:

- events the worker itself sees (a record consumed, a dead letter acked, a commit) are
  counted where they happen, through the small methods below;
- the core layers (engine, caches, batcher) keep cumulative stats dataclasses and know
  nothing of Prometheus; ``observe_*``/``sync_*`` turn a snapshot into counter increments
  (the delta since the previous snapshot) and histogram observations.

Every ``WorkerMetrics`` owns its ``CollectorRegistry``, so several workers in one process
(the rebalance tests, the demo) never share or collide on global state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from streamrec.cache.history_store import HistoryStore
from streamrec.cache.stats import (
    EmbeddingCacheStats,
    HistoryStoreStats,
    KVTiersStats,
    RetrievalSetStats,
)
from streamrec.pipeline.engine import Engine, EngineStats
from streamrec.pipeline.generator import GenerationStats
from streamrec.pipeline.graphed_model import GraphedModel, GraphStats
from streamrec.pipeline.micro_batcher import Batch

# Latency buckets from 1 ms to 30 s; batch sizes in powers of two up to 1,024 users.
_LATENCY_BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_BATCH_BUCKETS: Final = tuple(float(2**i) for i in range(11))
BACKENDS: Final = ("aoti", "eager", "eager_fallback")  # model_loader's names


class WorkerMetrics:
    """The worker's metric families on a private registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "streamrec_"
        self.events_consumed = Counter(
            p + "events_consumed", "Records read from an input topic", ["topic"], registry=r
        )
        self.events_invalid = Counter(
            p + "events_invalid",
            "Undecodable, invalid or oversized input records",
            ["topic", "kind"],
            registry=r,
        )
        self.dead_letters = Counter(
            p + "dead_letters", "Records acknowledged on the dead-letter topic", registry=r
        )
        self.batch_users = Histogram(
            p + "batch_users", "Users per micro-batch", buckets=_BATCH_BUCKETS, registry=r
        )
        self.batches_released = Counter(
            p + "batches_released",
            "Micro-batches by release reason: size (full), time (max_wait_ms behind a busy "
            "engine), idle (the engine was free), close",
            ["reason"],
            registry=r,
        )
        self.queue_delay = Histogram(
            p + "queue_delay_seconds",
            "Time a user's oldest event of a batch waited in the batcher queue",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.pipeline_stage = Histogram(
            p + "pipeline_stage_seconds",
            "Time a batch spent per pipeline stage (prepare, pipeline_wait, execute)",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            p + "step_seconds",
            "Engine step time by phase",
            ["phase"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.cache_hits = Counter(p + "cache_hits", "Cache hits per tier", ["tier"], registry=r)
        self.cache_misses = Counter(
            p + "cache_misses", "Cache misses per tier", ["tier"], registry=r
        )
        self.cache_evictions = Counter(
            p + "cache_evictions", "Evictions per tier", ["tier"], registry=r
        )
        self.kv_blocks = Gauge(p + "kv_blocks", "KV pool blocks by state", ["state"], registry=r)
        self.cache_bytes_moved = Counter(
            p + "cache_bytes_moved",
            "Bytes copied into (in) and out of (out) a cache tier",
            ["tier", "direction"],
            registry=r,
        )
        self.disk_tier_bytes = Gauge(
            p + "disk_tier_bytes", "Bytes of KV files the disk tier holds", registry=r
        )
        self.disk_tier_verify_failures = Counter(
            p + "disk_tier_verify_failures",
            "Disk-tier files that failed their checks (torn, stale): answered as misses",
            registry=r,
        )
        self.disk_tier_device_staged_loads = Counter(
            p + "disk_tier_device_staged_loads",
            "Disk hits whose bytes reached the GPU before their step (a device-side scatter)",
            registry=r,
        )
        self.retrieval_set_coverage = Gauge(
            p + "retrieval_set_coverage",
            "Share of new events whose item the retrievable set held (catalogue past the GPU)",
            registry=r,
        )
        self.retrieval_set_refreshes = Counter(
            p + "retrieval_set_refreshes", "Refreshes of the retrievable set", registry=r
        )
        self.published = Counter(
            p + "recommendations_published",
            "Recommendation records acknowledged by the broker",
            registry=r,
        )
        self.event_to_publish = Histogram(
            p + "event_to_publish_seconds",
            "Event arrival to recommendation acknowledged",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.commit_seconds = Histogram(
            p + "commit_seconds", "Offset commit latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.commits = Counter(p + "commits", "Offset commits", registry=r)
        self.consumer_lag = Gauge(
            p + "consumer_lag",
            "End offset minus committed offset, per owned partition",
            ["topic", "partition"],
            registry=r,
        )
        self.rebalances = Counter(p + "rebalances", "Consumer-group rebalances seen", registry=r)
        self.graph_calls = Counter(
            p + "model_graph_calls",
            "extend/rank calls by how they ran: a replayed CUDA graph, or eager (no bucket fits)",
            ["mode"],
            registry=r,
        )
        self.model_backend = Gauge(
            p + "model_backend", "1 for the model backend in use", ["backend"], registry=r
        )
        self.model_info = Gauge(
            p + "model_info",
            "1 for the model this worker serves: its name, version and backend",
            ["name", "version", "backend"],
            registry=r,
        )
        self.generated_items = Counter(
            p + "generated_items", "Items generated as next-k continuations", registry=r
        )
        self.draft_proposed = Counter(
            p + "speculative_proposed",
            "Draft items proposed to the model in speculative generation",
            registry=r,
        )
        self.draft_accepted = Counter(
            p + "speculative_accepted",
            "Draft items the model kept in speculative generation",
            registry=r,
        )
        self.generation_calls = Counter(
            p + "generation_target_calls",
            "Model calls of next-k generation (one per item, or one per speculative round)",
            registry=r,
        )
        self.generation_compactions = Counter(
            p + "generation_compactions",
            "Speculative batches whose live rows moved into a smaller workspace",
            registry=r,
        )
        self.acceptance = Gauge(
            p + "speculative_acceptance_ratio",
            "Kept / proposed draft items since start (0 before the first proposal)",
            registry=r,
        )
        self.last_commit = Gauge(
            p + "last_commit_timestamp_seconds",
            "Unix time of the last successful commit",
            registry=r,
        )
        self.batch_splits = Counter(
            p + "engine_batch_splits",
            "Batches split because the KV pool could not hold them whole",
            registry=r,
        )
        self.rebuilds = Counter(
            p + "engine_rebuilds",
            "Cached users rebuilt from the history store instead of extended, by reason",
            ["reason"],
            registry=r,
        )
        self.store_retries = Counter(
            p + "store_retries", "History-store calls retried after an error", registry=r
        )
        self._seen: dict[tuple[int, str], float] = {}  # last cumulative value per series
        self._phase_seconds: dict[str, float] = {}
        self._lag_series: set[tuple[str, str]] = set()
        self._pool_tier = "gpu"  # the KV pool's tier label; set_model names it by device

    # ------------------------------------------------------------------ exposition

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type (for ``/metrics``)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # ------------------------------------------------------------------ direct events

    def consumed(self, topic: str, n: int) -> None:
        self.events_consumed.labels(topic).inc(n)

    def invalid(self, topic: str, kinds: Mapping[str, int]) -> None:
        for kind, n in kinds.items():
            self.events_invalid.labels(topic, kind).inc(n)

    def dead_letter_acked(self) -> None:
        self.dead_letters.inc()

    def recommendation_acked(self, latency_s: float) -> None:
        self.published.inc()
        self.event_to_publish.observe(max(latency_s, 0.0))

    def committed(self, seconds: float, unix_time: float) -> None:
        self.commits.inc()
        self.commit_seconds.observe(seconds)
        self.last_commit.set(unix_time)

    def rebalanced(self) -> None:
        self.rebalances.inc()

    def set_backend(self, backend: str) -> None:
        for name in BACKENDS:
            self.model_backend.labels(name).set(1.0 if name == backend else 0.0)

    def set_model(self, name: str, version: str, backend: str, device_type: str) -> None:
        """What this worker serves: ``model_info``, ``model_backend`` and the KV pool's tier.

        The pool is tier ``gpu`` on a CUDA device and ``cpu`` on a CPU worker (its blocks
        live in RAM there), so no ``gpu`` series exists where there is no GPU; its series
        start at 0 so that rates are defined from the first scrape.
        """
        self.model_info.clear()
        self.model_info.labels(name, version, backend).set(1.0)
        self.set_backend(backend)
        self._pool_tier = "gpu" if device_type == "cuda" else "cpu"
        for family in (self.cache_hits, self.cache_misses, self.cache_evictions):
            family.labels(self._pool_tier)

    def set_lag(self, lags: Mapping[tuple[str, int], int]) -> None:
        """Replace the lag series: partitions no longer owned disappear."""
        current = {(topic, str(partition)) for topic, partition in lags}
        for topic, label in self._lag_series - current:
            self.consumer_lag.remove(topic, label)
        for (topic, partition), lag in lags.items():
            self.consumer_lag.labels(topic, str(partition)).set(max(lag, 0))
        self._lag_series = current

    # ------------------------------------------------------------------ from stats

    def observe_batch(
        self,
        batch: Batch,
        phase_seconds: Mapping[str, float],
        stages: Mapping[str, float] | None = None,
    ) -> None:
        """One processed batch: its size, its users' queue delays, step time per phase,
        and the pipeline ``stages`` it went through (seconds each).

        ``phase_seconds`` is the engine's cumulative per-phase time; the difference to the
        previous call is this batch's share. The queue delay is observed once per user
        (its oldest event's), not per event: the histogram stays off the per-event path.
        """
        self.batch_users.observe(batch.n_users)
        self.batches_released.labels(batch.reason.value).inc()
        released = batch.released_at
        for user in batch.users:
            self.queue_delay.observe(max(released - user.first_enqueued_at, 0.0))
        for stage, seconds in (stages or {}).items():
            self.pipeline_stage.labels(stage).observe(max(seconds, 0.0))
        for phase, total in phase_seconds.items():
            spent = total - self._phase_seconds.get(phase, 0.0)
            self._phase_seconds[phase] = total
            self.step_seconds.labels(phase).observe(max(spent, 0.0))

    def sync_serving(self, engine: Engine, store: HistoryStore | None) -> None:
        """Every gauge read from the serving objects (at each scrape)."""
        self.sync_caches(engine.tiers.stats(), store.stats() if store is not None else None)
        if engine.catalog is not None:
            self.sync_catalog(*engine.catalog.stats())
        self.sync_engine(engine.stats())
        if isinstance(engine.step.model, GraphedModel):
            self.sync_graphs(engine.step.model.stats)
        if engine.step.generation is not None:
            self.sync_generation(engine.step.generation.stats)

    def sync_caches(self, tiers: KVTiersStats, store: HistoryStoreStats | None) -> None:
        """Cache counters per tier from cumulative snapshots.

        Per tier, a miss is a lookup the tier could not answer: the KV pool (``gpu``, or
        ``cpu`` on a CPU worker) misses whatever it does not hold, the host tier misses what
        falls through to a rebuild, and the history store misses users it has never seen.
        Tiers that do not exist (no host tier, no store stats) get no series at all.
        """
        pool = self._pool_tier
        self._sync(self.cache_hits, pool, tiers.gpu_hits)
        self._sync(self.cache_misses, pool, tiers.host_hits + tiers.disk_hits + tiers.misses)
        self._sync(self.cache_evictions, pool, tiers.pool.evictions)
        if tiers.host is not None:
            self._sync(self.cache_hits, "host", tiers.host_hits)
            self._sync(self.cache_misses, "host", tiers.disk_hits + tiers.misses)
            self._sync(self.cache_evictions, "host", tiers.host.drops)
            self._sync_moved("host", "out", tiers.host.bytes_offloaded)
            self._sync_moved("host", "in", tiers.host.bytes_onloaded)
        disk = tiers.disk
        if disk is not None:
            self._sync(self.cache_hits, "disk", tiers.disk_hits)
            self._sync(self.cache_misses, "disk", tiers.misses)
            self._sync(self.cache_evictions, "disk", disk.evictions)
            self._sync_moved("disk", "out", disk.bytes_written)
            self._sync_moved("disk", "in", disk.bytes_read)
            self._sync_plain(self.disk_tier_verify_failures, disk.verify_failures)
            self._sync_plain(self.disk_tier_device_staged_loads, disk.device_staged_loads)
            self.disk_tier_bytes.set(disk.bytes_used)
        if store is not None:
            self._sync(self.cache_hits, "history", store.get_hits)
            self._sync(self.cache_misses, "history", store.misses)
        self.kv_blocks.labels("used").set(tiers.pool.blocks_used)
        self.kv_blocks.labels("free").set(tiers.pool.blocks_free)

    def sync_catalog(self, embeddings: EmbeddingCacheStats, retrievable: RetrievalSetStats) -> None:
        """The item table past the GPU budget: embedding-cache lookups, copies and the
        retrievable set, from cumulative snapshots (tier ``embedding``)."""
        self._sync(self.cache_hits, "embedding", embeddings.hits)
        self._sync(self.cache_misses, "embedding", embeddings.misses)
        self._sync(self.cache_evictions, "embedding", embeddings.evictions)
        self._sync_moved("embedding", "in", embeddings.bytes_copied)
        self.retrieval_set_coverage.set(retrievable.coverage)
        self._sync_plain(self.retrieval_set_refreshes, retrievable.refreshes)

    def _sync_moved(self, tier: str, direction: str, cumulative: float) -> None:
        key = (id(self.cache_bytes_moved), f"{tier}/{direction}")
        delta = cumulative - self._seen.get(key, 0.0)
        if delta > 0:
            self.cache_bytes_moved.labels(tier, direction).inc(delta)
            self._seen[key] = cumulative

    def sync_engine(self, stats: EngineStats) -> None:
        """Engine counters (batch splits, rebuilds by reason, store retries), cumulative."""
        self._sync_plain(self.batch_splits, stats.batch_splits)
        self._sync_plain(self.store_retries, stats.store_retries)
        self._sync(self.rebuilds, "redelivery", stats.rebuilds_after_redelivery)
        self._sync(self.rebuilds, "burst", stats.rebuilds_after_burst)
        self._sync(self.rebuilds, "lost", stats.rebuilds_after_loss)

    def _sync_plain(self, family: Counter, cumulative: float) -> None:
        key = (id(family), "")
        delta = cumulative - self._seen.get(key, 0.0)
        if delta > 0:
            family.inc(delta)
            self._seen[key] = cumulative

    def sync_graphs(self, stats: GraphStats) -> None:
        """CUDA-graph replays and the calls that fell back to eager, from cumulative stats."""
        self._sync(self.graph_calls, "graph", stats.replays)
        self._sync(self.graph_calls, "eager", stats.eager_calls)

    def sync_generation(self, stats: GenerationStats) -> None:
        """Generated items and the draft's acceptance, from the generator's cumulative stats."""
        self._sync(self.generated_items, None, stats.tokens)
        self._sync(self.draft_proposed, None, stats.proposed)
        self._sync(self.draft_accepted, None, stats.accepted)
        self._sync(self.generation_calls, None, stats.target_calls)
        self._sync(self.generation_compactions, None, stats.compactions)
        self.acceptance.set(stats.acceptance_rate)

    def _sync(self, family: Counter, tier: str | None, cumulative: float) -> None:
        """Increment ``family`` (its ``tier`` label, if it has one) up to ``cumulative``."""
        key = (id(family), tier or "")
        delta = cumulative - self._seen.get(key, 0.0)
        if delta > 0:
            (family if tier is None else family.labels(tier)).inc(delta)
            self._seen[key] = cumulative

    def sample(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """Current value of one sample (tests and the demo summary read metrics back)."""
        value = self.registry.get_sample_value(name, dict(labels or {}))
        return None if value is None else float(value)

    def invalid_counts(self) -> dict[str, int]:
        """Rejected input records by error kind, over all topics (the demo's summary)."""
        out: dict[str, int] = {}
        for metric in self.events_invalid.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    kind = sample.labels["kind"]
                    out[kind] = out.get(kind, 0) + int(sample.value)
        return out

    def families(self) -> Iterable[str]:
        return [metric.name for metric in self.registry.collect()]
