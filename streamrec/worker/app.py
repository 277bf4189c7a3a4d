"""The worker process: the composition root that wires Kafka, the pipeline and the caches.

Three loops share one event loop:

- **fetch** (``_fetch_loop``): poll both input topics and hand each partition's records
  to the ``Intake`` (track offsets, decode, dead-letter, submit to the batcher);
- **serve** (``ServingPipeline.run``): batches through prepare (history append), the step
  on the engine thread, and publish, overlapped across consecutive batches;
- **commit** (``Checkpoint.commit_loop``): commit what the ``OffsetTracker`` says is done.

An offset is *done* only when its history append is durable and its recommendation or
dead letter is acknowledged by the broker; ``Checkpoint`` holds the commit and hand-over
protocol (rebalances, a replaced log), ``Health`` what the probes answer. Shutdown: stop
fetching, drain the batcher and the pipeline, flush, commit, leave the group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Set
from dataclasses import dataclass
from typing import Final

from aiokafka.errors import KafkaError

from streamrec.cache.history_backends import open_history_store
from streamrec.cache.history_store import HistoryStore
from streamrec.errors import StreamrecError
from streamrec.pipeline.engine import Engine
from streamrec.pipeline.micro_batcher import MicroBatcher
from streamrec.worker import interpreter
from streamrec.worker.checkpoint import Checkpoint
from streamrec.worker.config import WorkerConfig
from streamrec.worker.consumer import TP, KafkaInput
from streamrec.worker.health import Health, HealthState, ProbeAnswer
from streamrec.worker.http_server import HttpServer, Response
from streamrec.worker.intake import Intake
from streamrec.worker.log_scoped_store import LogScopedStore
from streamrec.worker.metrics import WorkerMetrics
from streamrec.worker.model_loader import LoadedModel, load_model, set_host_threads
from streamrec.worker.offset_tracker import OffsetTracker, OffsetTrackerStats
from streamrec.worker.publisher import Publisher
from streamrec.worker.rebalance import RebalanceListener
from streamrec.worker.serving_pipeline import PublishedHook, ServingPipeline
from streamrec.worker.serving_stack import (
    build_catalog,
    build_tiers,
    engine_config,
    serving_generation,
    serving_model,
    serving_scoring,
)

log = logging.getLogger(__name__)

_FETCH_TIMEOUT_MS: Final = 100


@dataclass(frozen=True)
class AppStats:
    """Counters of one worker since start (tests and the demo summary read them)."""

    consumed: int
    invalid: int
    dead_letters: int
    published: int
    batches: int
    commits: int
    rebalances: int
    owned: frozenset[TP]
    committed: dict[TP, int]
    tracker: OffsetTrackerStats


class App:
    """One worker. ``run()`` until ``stop()``; injectable pieces are for tests and the demo."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        model: LoadedModel | None = None,
        store: HistoryStore | None = None,
        on_published: PublishedHook | None = None,
        freeze_heap: bool = False,
    ) -> None:
        self.config = config
        self._freeze_heap = freeze_heap
        self.metrics = WorkerMetrics()
        self.tracker = OffsetTracker()
        self.batcher = MicroBatcher(config.batching)
        self.batcher.on_pressure(self._on_pressure)
        self.input = KafkaInput(config.kafka, config.topics, config.group, RebalanceListener(self))
        self.publisher = Publisher(config.kafka, config.topics, self._fatal)
        self.health = Health(config.http.stall_timeout_s, self._health_state)
        self.http = HttpServer(
            config.http.host,
            config.http.port,
            {
                "/metrics": self._metrics_route,
                "/healthz": lambda: _probe(self.health.live()),
                "/readyz": lambda: _probe(self.health.ready()),
            },
        )
        self.loaded = model
        self.engine: Engine | None = None
        self.pipeline: ServingPipeline | None = None
        self._store = store
        self._owns_store = store is None  # an injected store is closed by whoever made it
        self._on_published = on_published
        self._stopping = asyncio.Event()
        self._error: BaseException | None = None
        self._last_fetch = time.monotonic()
        self.checkpoint: Checkpoint | None = None
        self.intake: Intake | None = None

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Serve until ``stop()`` (or a fatal error); returns the process exit status."""
        interpreter.set_switch_interval()  # process-wide: this is its root
        await self.http.start()
        try:
            checkpoint, scoped = await self._prepare()
            if not await self.input.start(self._stopping):
                return 0
            scoped.bind(await self.input.cluster_id())
            await self.publisher.start()
            if self._freeze_heap:
                interpreter.freeze_heap()
            assert self.pipeline is not None
            tasks = [
                asyncio.create_task(self._fetch_loop(), name="streamrec-fetch"),
                asyncio.create_task(self._serve(self.pipeline), name="streamrec-serve"),
                asyncio.create_task(checkpoint.commit_loop(), name="streamrec-commit"),
            ]
            await self._stopping.wait()
            await self._shutdown(checkpoint, *tasks)
        finally:
            await self._close()
        if self._error is not None:
            log.error("worker stopped on error", extra={"error": repr(self._error)})
            return 1
        return 0

    def stop(self) -> None:
        """Begin a graceful shutdown (signal handlers call this)."""
        self._stopping.set()

    @property
    def ready(self) -> bool:
        return self.health.ready().ok

    @property
    def owned(self) -> frozenset[TP]:
        return frozenset() if self.checkpoint is None else self.checkpoint.owned

    def stats(self) -> AppStats:
        intake = self.intake.stats if self.intake is not None else None
        cp = self.checkpoint.stats() if self.checkpoint is not None else None
        return AppStats(
            consumed=intake.consumed if intake else 0,
            invalid=intake.invalid if intake else 0,
            dead_letters=intake.dead_letters if intake else 0,
            published=self.pipeline.stats.published if self.pipeline is not None else 0,
            batches=self.batcher.stats().batches,
            commits=cp.commits if cp else 0,
            rebalances=cp.rebalances if cp else 0,
            owned=cp.owned if cp else frozenset(),
            committed=cp.committed if cp else {},
            tracker=self.tracker.stats(),
        )

    async def _prepare(self) -> tuple[Checkpoint, LogScopedStore]:
        """Model, caches, history store, engine, pipeline (the model loads off the loop)."""
        if self.loaded is None:
            self.loaded = await asyncio.to_thread(
                load_model,
                self.config.model,
                self.config.scoring,
                self.config.cache.embedding_cache_rows,
                self.config.cache.kv_dtype,
            )
        loaded = self.loaded
        set_host_threads(self.config.model, loaded.device)
        hstu = loaded.checkpoint.config
        if self._store is None:
            self._store = open_history_store(self.config.store.url, hstu.max_seq_len)
        scoring = serving_scoring(self.config.scoring, hstu)
        catalog = build_catalog(self.config.cache, loaded, scoring)  # before the KV budget
        tiers = build_tiers(self.config.cache, loaded)
        model = await asyncio.to_thread(serving_model, self.config, loaded, tiers.cache, scoring)
        gen = await asyncio.to_thread(serving_generation, self.config, loaded, tiers.cache, scoring)
        scoped = LogScopedStore(self._store)
        vocab, config = loaded.checkpoint.vocab, engine_config(self.config, loaded, scoring)
        name, version = config.model_name, config.model_version
        self.engine = Engine(model, tiers, scoped, vocab, hstu.task_names, config, catalog, gen)
        await self.engine.warm_up(hstu.max_seq_len, hstu.first_item_row)
        checkpoint = Checkpoint(
            self.config,
            tracker=self.tracker,
            consumer=self.input,
            publisher=self.publisher,
            batcher=self.batcher,
            metrics=self.metrics,
            scoped=scoped,
            store=scoped,
            stopping=self._stopping,
            fatal=self._fatal,
        )
        self.pipeline = ServingPipeline(
            self.engine, self.batcher, self.tracker, self.publisher, self.metrics,
            lambda: checkpoint.same_log(wait=True), self._on_published,
        )  # fmt: skip
        checkpoint.attach(self.engine, self.pipeline)
        self.checkpoint = checkpoint
        self.intake = Intake(
            self.config.topics,
            self.tracker,
            self.batcher,
            self.publisher,
            self.metrics,
            checkpoint.owns,
            self._stopping,
        )
        self.metrics.set_model(name, version, loaded.backend, loaded.device.type)
        log.info(
            "model ready",
            extra={
                "model": name,
                "model_version": version,
                "backend": loaded.backend,
                "device": str(loaded.device),
                "kv_blocks": tiers.cache.pool.num_blocks,
            },
        )
        return checkpoint, scoped

    async def _serve(self, pipeline: ServingPipeline) -> None:
        try:
            await pipeline.run()
        except StreamrecError as exc:
            self._fatal(exc)

    async def _shutdown(self, checkpoint: Checkpoint, *tasks: asyncio.Task[None]) -> None:
        fetch, serve, commit = tasks
        drain = self.config.group.drain_timeout_s
        deadline = time.monotonic() + drain
        await _finish(fetch, drain)
        self.batcher.close()
        if not await _finish(serve, max(deadline - time.monotonic(), 0.0)):
            log.warning("drain bound reached; unfinished batches are re-read by the next owner")
        await _finish(commit, 0.0)
        await self.publisher.flush(max(deadline - time.monotonic(), 0.1))
        await checkpoint.commit()
        committed = self.tracker.committed()
        log.info("drained", extra={"committed": {f"{t}:{p}": o for (t, p), o in committed.items()}})

    async def _close(self) -> None:
        if self.checkpoint is not None:
            await self.checkpoint.close()
        with contextlib.suppress(KafkaError):
            await self.input.stop()
        with contextlib.suppress(KafkaError):
            await self.publisher.stop()
        if self.engine is not None:
            await self.engine.close()
        if self._store is not None and self._owns_store:
            await self._store.close()
        await self.http.stop()

    def _fatal(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
            log.error("fatal worker error, stopping", extra={"error": repr(exc)})
        self._stopping.set()

    # ------------------------------------------------------------------ loops

    async def _fetch_loop(self) -> None:
        intake = self.intake
        assert intake is not None
        try:
            while not self._stopping.is_set():
                records = await self.input.fetch(_FETCH_TIMEOUT_MS)
                self._last_fetch = time.monotonic()
                for tp, batch in records.items():
                    await intake.take(tp, batch)
        except (KafkaError, StreamrecError) as exc:
            self._fatal(exc)

    def _on_pressure(self, paused: bool) -> None:
        if paused:
            self.input.pause(self.owned)
        else:
            self.input.resume(self.owned)

    # The rebalance listener's side (aiokafka awaits these inside the rebalance).
    async def partitions_revoked(self, tps: Set[TP]) -> None:
        if self.checkpoint is not None:
            await self.checkpoint.revoked(tps)

    async def partitions_assigned(self, tps: Set[TP]) -> None:
        if self.checkpoint is not None:
            await self.checkpoint.assigned(tps)

    # ------------------------------------------------------------------ HTTP routes

    def _health_state(self) -> HealthState:
        engine = self.engine.stats() if self.engine is not None else None
        cp = self.checkpoint
        return HealthState(
            now=time.monotonic(),
            fatal=self._error,
            stopping=self._stopping.is_set(),
            model_loaded=self.engine is not None,
            owned_partitions=len(self.owned),
            last_fetch=self._last_fetch,
            last_step=self.pipeline.last_step_at if self.pipeline is not None else 0.0,
            queued_events=self.batcher.depth,
            last_store_retry=engine.last_retry_at if engine is not None else 0.0,
            broker_down_since=cp.broker_down_since if cp is not None else None,
        )

    def _metrics_route(self) -> Response:
        if self.engine is not None:
            self.metrics.sync_serving(self.engine, self._store)
        body, content_type = self.metrics.render()
        return Response(200, body, content_type)


def _probe(answer: ProbeAnswer) -> Response:
    return Response(200 if answer.ok else 503, (answer.reason + "\n").encode())


async def _finish(task: asyncio.Task[None], timeout_s: float) -> bool:
    """Await ``task`` up to ``timeout_s``, cancelling it after; True if it ended by itself."""
    done, _ = await asyncio.wait({task}, timeout=max(timeout_s, 0.001))
    if done:
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False
