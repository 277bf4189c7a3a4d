"""The worker process: the composition root that wires Kafka, the pipeline and the caches.

Three tasks share one event loop:

- **fetch** (``_fetch_loop``): poll both input topics, decode each partition's records,
  send bad ones to the dead-letter topic, submit good ones to the micro-batcher, and
  track every offset the moment it is read;
- **engine** (``_engine_loop``): take batches strictly in order, ``engine.process`` one at
  a time (per-user token order rests on that), queue each recommendation on the producer;
- **commit** (``_commit_loop``): commit what the ``OffsetTracker`` says is committable.

An offset is *done* only when its history append is durable (``engine.process``
returned) and its recommendation or dead letter is acknowledged by the broker (the
producer's callback). Completions quote the generation their partition had when the
batch was taken, so work begun before a rebalance can never complete a record that was
re-read after it.

Hand-over on rebalance (``partitions_revoked``): stop feeding the partitions (discard
their queued deltas), wait for the batch in flight up to the drain bound, flush the
producer, commit, forget the partitions (new generation next time), drop their users from
the caches. Shutdown is the same for every partition: stop fetching, drain the batcher,
flush, commit, leave the group.

A replaced log (the broker lost its data and offsets restart at 0: ``LogScopedStore``)
is detected by the cluster id, asked before every store append and every commit; the
worker then stops with status 1 before applying or committing anything of the new log,
and its restart binds the new log's id.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Set
from dataclasses import dataclass
from typing import Final

from aiokafka.errors import KafkaError

from streamrec.cache.history_store import HistoryStore, open_history_store
from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache, KVCacheConfig, free_memory_bytes
from streamrec.cache.kv_tiers import KVTiers
from streamrec.errors import BrokerError, StreamrecError
from streamrec.models.config import HSTUConfig
from streamrec.pipeline.clock import MonotonicClock
from streamrec.pipeline.delta import Delta
from streamrec.pipeline.engine import Engine, EngineConfig, UserResult
from streamrec.pipeline.graphed_model import GraphConfig, GraphedModel
from streamrec.pipeline.micro_batcher import BatcherClosed, BatcherConfig, MicroBatcher
from streamrec.pipeline.scorer import ScoringConfig
from streamrec.pipeline.serving_model import ServingModel
from streamrec.schemas.codec import RawRecord, RejectedRecord, decode_batch
from streamrec.schemas.events import EventKind
from streamrec.schemas.records import DeadLetter, Recommendation
from streamrec.worker.config import ModelConfig, WorkerConfig
from streamrec.worker.consumer import TP, KafkaInput
from streamrec.worker.event_time_policy import EventTimePolicy
from streamrec.worker.http_server import HttpServer, Response
from streamrec.worker.log_scoped_store import LogScopedStore
from streamrec.worker.metrics import WorkerMetrics
from streamrec.worker.model_loader import LoadedModel, load_model
from streamrec.worker.offset_tracker import OffsetTracker, OffsetTrackerStats
from streamrec.worker.publisher import Publisher
from streamrec.worker.rebalance import RebalanceListener

log = logging.getLogger(__name__)

_FETCH_TIMEOUT_MS: Final = 100
_CPU_KV_BUDGET_CAP: Final = 256 << 20  # auto-sized KV pool on the CPU: RAM is shared
PublishedHook = Callable[[Recommendation, float], None]


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
    ) -> None:
        self.config = config
        self.metrics = WorkerMetrics()
        self.tracker = OffsetTracker()
        self._clock = MonotonicClock()
        b = config.batching
        self.batcher = MicroBatcher(
            BatcherConfig(
                max_batch_users=b.max_batch_users,
                max_wait_ms=b.max_wait_ms,
                queue_high_watermark=b.queue_high_watermark,
                queue_low_watermark=b.queue_low_watermark,
            ),
            self._clock,
        )
        self.batcher.on_pressure(self._on_pressure)
        self.input = KafkaInput(config.kafka, config.topics, config.group, RebalanceListener(self))
        self.publisher = Publisher(config.kafka, config.topics, self._fatal)
        self.http = HttpServer(
            config.http.host,
            config.http.port,
            {"/metrics": self._metrics_route, "/healthz": self._health, "/readyz": self._ready},
        )
        self.loaded = model
        self._store = store
        self._owns_store = store is None  # an injected store is closed by whoever made it
        self._scoped: LogScopedStore | None = None
        self._log_replaced = False
        self._time_policy = EventTimePolicy(config.topics.max_future_skew_ms)
        self.engine: Engine | None = None
        self._graphed: GraphedModel | None = None
        self._on_published = on_published
        self._kinds = {
            config.topics.playback: EventKind.PLAYBACK,
            config.topics.interaction: EventKind.INTERACTION,
        }
        self._stopping = asyncio.Event()
        self._engine_lock = asyncio.Lock()
        self._owned: set[TP] = set()
        self._users_by_tp: dict[TP, set[str]] = {}
        self._committed: dict[TP, int] = {}
        self._error: BaseException | None = None
        self._last_fetch = time.monotonic()
        self._last_step = time.monotonic()
        self._background: set[asyncio.Task[None]] = set()
        self._consumed = 0
        self._invalid = 0
        self._dead_letters = 0
        self._published = 0
        self._commits = 0
        self._rebalances = 0

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Serve until ``stop()`` (or a fatal error); returns the process exit status."""
        await self.http.start()
        try:
            await self._prepare()
            if not await self.input.start(self._stopping):
                return 0
            assert self._scoped is not None
            self._scoped.bind(await self.input.cluster_id())
            await self.publisher.start()
            tasks = [
                asyncio.create_task(self._fetch_loop(), name="streamrec-fetch"),
                asyncio.create_task(self._engine_loop(), name="streamrec-engine"),
                asyncio.create_task(self._commit_loop(), name="streamrec-commit"),
            ]
            await self._stopping.wait()
            await self._shutdown(*tasks)
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
        return self.engine is not None and bool(self._owned) and not self._stopping.is_set()

    @property
    def owned(self) -> frozenset[TP]:
        return frozenset(self._owned)

    def stats(self) -> AppStats:
        return AppStats(
            consumed=self._consumed,
            invalid=self._invalid,
            dead_letters=self._dead_letters,
            published=self._published,
            batches=self.batcher.stats().batches,
            commits=self._commits,
            rebalances=self._rebalances,
            owned=frozenset(self._owned),
            committed=dict(self._committed),
            tracker=self.tracker.stats(),
        )

    async def _prepare(self) -> None:
        """Model, caches, history store and engine (the model loads off the event loop)."""
        if self.loaded is None:
            self.loaded = await asyncio.to_thread(load_model, self.config.model)
        loaded = self.loaded
        hstu = loaded.checkpoint.config
        if self._store is None:
            self._store = open_history_store(self.config.store.url, hstu.max_seq_len)
        tiers = self._build_tiers(loaded)
        scoring = serving_scoring(self.config.model, hstu)
        model, backend = loaded.model, loaded.backend
        # AOTI packages are not captured: their input checks read values on the host,
        # which a capture forbids (and AOTI inside a graph is unmeasured on the H200).
        if loaded.device.type == "cuda" and self.config.model.cuda_graphs and backend == "eager":
            self._graphed = await asyncio.to_thread(
                self._capture_graphs, model, tiers.cache, scoring, hstu
            )
            model = self._graphed  # the backend label stays: graphs have their own counter
        self._scoped = LogScopedStore(self._store)
        self.engine = Engine(
            model,
            tiers,
            self._scoped,
            loaded.checkpoint.vocab,
            hstu.task_names,
            EngineConfig(
                model_name=loaded.checkpoint.model_name,
                model_version=loaded.checkpoint.version,
                backend=backend,
                scoring=scoring,
            ),
        )
        self.metrics.set_model(
            loaded.checkpoint.model_name, loaded.checkpoint.version, backend, loaded.device.type
        )
        log.info(
            "model ready",
            extra={
                "model": loaded.checkpoint.model_name,
                "model_version": loaded.checkpoint.version,
                "backend": backend,
                "device": str(loaded.device),
                "kv_blocks": tiers.cache.pool.num_blocks,
            },
        )

    def _capture_graphs(
        self, model: ServingModel, cache: KVCache, scoring: ScoringConfig, hstu: HSTUConfig
    ) -> GraphedModel:
        """Capture extend and rank as CUDA graphs now, so no step pays for a capture.

        Buckets are powers of two: extend up to ``graph_max_tokens`` new tokens (a step
        can carry several events per user), rank up to the batcher's ``max_batch_users``.
        """
        max_tokens = self.config.model.graph_max_tokens
        buckets = tuple(1 << i for i in range(max_tokens.bit_length()))
        max_users = self.config.batching.max_batch_users
        rank = [b for b in buckets if b < 2 * max_users] if scoring.num_candidates else []
        config = GraphConfig(
            max_blocks=-(-hstu.max_seq_len // cache.config.block_size) + 1,
            num_candidates=max(1, scoring.num_candidates),
            buckets=buckets,
        )
        graphed = GraphedModel(model, cache.kv, cache.ts, config)
        graphed.warm_up(extend=buckets, rank=rank)
        log.info(
            "CUDA graphs captured",
            extra={"graphs": graphed.stats.captures, "seconds": round(graphed.stats.capture_s, 1)},
        )
        return graphed

    def _build_tiers(self, loaded: LoadedModel) -> KVTiers:
        hstu = loaded.checkpoint.config
        c = self.config.cache
        geometry = KVCacheConfig(
            hstu.num_layers, hstu.num_heads, hstu.head_dim, c.block_size, hstu.torch_dtype
        )
        budget = c.kv_budget_bytes
        if budget == 0:
            budget = int(c.kv_budget_fraction * free_memory_bytes(loaded.device))
            if loaded.device.type == "cpu":
                budget = min(budget, _CPU_KV_BUDGET_CAP)
        cache = KVCache(geometry, geometry.num_blocks_for(budget), loaded.device)
        # A host tier only pays off behind a GPU pool; on the CPU it would copy RAM to RAM.
        host = None
        if c.host_tier_bytes > 0 and loaded.device.type == "cuda":
            host = HostTier.from_budget(cache, c.host_tier_bytes)
        return KVTiers(cache, host, hstu.max_seq_len)

    async def _shutdown(self, fetch: asyncio.Task[None], *others: asyncio.Task[None]) -> None:
        drain = self.config.group.drain_timeout_s
        deadline = time.monotonic() + drain
        await _finish(fetch, drain)
        self.batcher.close()
        engine_loop, commit_loop = others
        if not await _finish(engine_loop, max(deadline - time.monotonic(), 0.0)):
            log.warning("drain bound reached; unfinished batches are re-read by the next owner")
        await _finish(commit_loop, 0.0)
        await self.publisher.flush(max(deadline - time.monotonic(), 0.1))
        await self._commit()
        log.info(
            "drained",
            extra={"committed": {f"{t}:{p}": o for (t, p), o in self._committed.items()}},
        )

    async def _close(self) -> None:
        for task in list(self._background):
            await _finish(task, 1.0)
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

    # ------------------------------------------------------------------ fetch side

    async def _fetch_loop(self) -> None:
        try:
            while not self._stopping.is_set():
                records = await self.input.fetch(_FETCH_TIMEOUT_MS)
                self._last_fetch = time.monotonic()
                for tp, batch in records.items():
                    await self._intake(tp, batch)
        except (KafkaError, StreamrecError) as exc:
            self._fatal(exc)

    async def _intake(self, tp: TP, records: list[RawRecord]) -> None:
        """Track, decode and route one partition's fetched records."""
        if tp not in self._owned or not records:
            return  # fetched before a revoke: the partition's next owner reads it again
        topic = tp[0]
        generation = 0
        for record in records:
            generation = self.tracker.track(tp, record.offset)
        self._consumed += len(records)
        self.metrics.consumed(topic, len(records))
        decoded = decode_batch(records, self._kinds[topic], self.config.topics.max_record_bytes)
        events, too_new = self._time_policy.split(decoded.events, records, int(time.time() * 1000))
        users = self._users_by_tp.setdefault(tp, set())
        for item in events:
            users.add(item.event.user_id)
            delta = Delta.from_event(item.event, item.topic, item.partition, item.offset)
            while not self.batcher.submit(delta):  # over capacity: wait for the engine
                await _wait_either(self.batcher.wait_resumed(), self._stopping)
                if self._stopping.is_set() or tp not in self._owned:
                    return
        errors = [*decoded.errors, *too_new]
        if errors:
            self._invalid += len(errors)
            counts: dict[str, int] = {}
            for rejected in errors:
                counts[rejected.kind.value] = counts.get(rejected.kind.value, 0) + 1
            self.metrics.invalid(topic, counts)
            for rejected in errors:
                if tp not in self._owned:
                    return
                await self._send_dead_letter(tp, rejected, generation)

    async def _send_dead_letter(self, tp: TP, rejected: RejectedRecord, generation: int) -> None:
        letter = DeadLetter.from_rejected(rejected, int(time.time() * 1000))
        offset = rejected.record.offset

        def acked() -> None:
            self._dead_letters += 1
            self.metrics.dead_letter_acked()
            self.tracker.done(tp, offset, generation)

        log.debug(
            "dead letter",
            extra={"topic": tp[0], "partition": tp[1], "offset": offset, "reason": letter.reason},
        )
        await self.publisher.dead_letter(letter, acked)

    def _on_pressure(self, paused: bool) -> None:
        if paused:
            self.input.pause(self._owned)
        else:
            self.input.resume(self._owned)

    # ------------------------------------------------------------------ engine side

    async def _engine_loop(self) -> None:
        engine = self.engine
        assert engine is not None
        try:
            while True:
                try:
                    batch = await self.batcher.next_batch()
                except BatcherClosed:
                    return
                # Every delta of a tp in this batch was tracked in the tp's current
                # generation: a revoke discards the queued deltas of its partitions.
                generations = {
                    (d.topic, d.partition): self.tracker.generation((d.topic, d.partition))
                    for u in batch.users
                    for d in u.deltas
                }
                async with self._engine_lock:
                    if not await self._same_log(wait=True):
                        continue  # never applied: re-read from the new log after a restart
                    results = await engine.process(batch)
                    for result in results:
                        await self._publish(result, generations)
                self._last_step = time.monotonic()
                self.metrics.observe_batch(batch, engine.stats().phase_seconds)
                store = self._store.stats() if self._store is not None else None
                self.metrics.sync_caches(engine.tiers.stats(), store)
                if self._graphed is not None:
                    self.metrics.sync_graphs(self._graphed.stats)
        except StreamrecError as exc:
            self._fatal(exc)

    async def _publish(self, result: UserResult, generations: dict[TP, int | None]) -> None:
        current = all(self.tracker.generation(s.tp) == generations[s.tp] for s in result.sources)
        if not current:
            return  # a partition of this user was revoked meanwhile: the new owner redoes it
        complete = functools.partial(self._complete, result, generations)
        rec = result.recommendation
        if rec is None:
            complete()
            return

        def acked() -> None:
            latency = self._clock.now() - result.first_enqueued_at
            self._published += 1
            self.metrics.recommendation_acked(latency)
            complete()
            if self._on_published is not None:
                self._on_published(rec, latency)

        await self.publisher.publish(rec, acked)

    def _complete(self, result: UserResult, generations: dict[TP, int | None]) -> None:
        for source in result.sources:
            generation = generations[source.tp]
            if generation is not None:
                self.tracker.done(source.tp, source.offset, generation)

    # ------------------------------------------------------------------ commits

    async def _commit_loop(self) -> None:
        interval = self.config.group.commit_interval_ms / 1000.0
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), interval)
            await self._commit()
            self.metrics.set_lag(
                self.input.lags({tp: p for tp, p in self._committed.items() if tp in self._owned})
            )

    async def _commit(self, positions: dict[TP, int] | None = None) -> bool:
        wanted = positions if positions is not None else self.tracker.committable()
        wanted = {tp: pos for tp, pos in wanted.items() if self._committed.get(tp) != pos}
        if not wanted:
            return True
        if not await self._same_log(wait=False):
            return False  # these positions belong to a log the broker no longer has
        started = time.perf_counter()
        try:
            await self.input.commit(wanted)
        except (KafkaError, BrokerError) as exc:
            log.warning("commit failed; retried later", extra={"error": repr(exc)})
            return False
        self.tracker.mark_committed(wanted)
        self._committed.update(wanted)
        self._commits += 1
        self.metrics.committed(time.perf_counter() - started, time.time())
        return True

    async def _same_log(self, *, wait: bool) -> bool:
        """True if the broker still serves the log bound at start (same cluster id).

        Asked right before an append or a commit: an answer with the bound id proves every
        record fetched before it came from that log (ids only ever change to new ones).
        While the broker is unreachable, ``wait`` retries with backoff until it answers
        or the worker stops; without it the answer is False.
        """
        scoped = self._scoped
        assert scoped is not None
        delay = 0.05
        while not self._log_replaced:
            try:
                current = await self.input.cluster_id()
            except (KafkaError, BrokerError) as exc:
                if not wait or self._stopping.is_set():
                    return False
                log.warning("cluster id unavailable, retrying", extra={"error": repr(exc)})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)
                delay = min(delay * 2, self.config.kafka.connect_retry_max_s)
                continue
            if current == scoped.log_id:
                return True
            self._log_replaced = True
            self._fatal(
                BrokerError(
                    f"the input log was replaced: cluster id {scoped.log_id!r} is now "
                    f"{current!r} (offsets restart at 0); restart to bind the new log"
                )
            )
        return False

    # ------------------------------------------------------------------ rebalance

    async def partitions_revoked(self, tps: Set[TP]) -> None:
        if not tps:
            return
        revoked = set(tps)
        self._owned -= revoked
        discarded = self.batcher.discard(revoked)
        drain = self.config.group.drain_timeout_s
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._engine_lock.acquire(), drain)
            drained = True
        except TimeoutError:
            drained = False
        try:
            left = max(drain - (time.monotonic() - started), 0.1)
            await self.publisher.flush(left)
            final = self.tracker.revoke(revoked)
            await self._commit(final)
            for tp in revoked:
                self._committed.pop(tp, None)
            users = set().union(*(self._users_by_tp.pop(tp, set()) for tp in revoked))
            still_ours = set().union(*self._users_by_tp.values()) if self._users_by_tp else set()
            users -= still_ours
            if drained and self.engine is not None and not self._stopping.is_set():
                await self.engine.drop(sorted(users))
            elif users and self.engine is not None and not self._stopping.is_set():
                self._spawn(self._drop_later(sorted(users)))
        finally:
            if drained:
                self._engine_lock.release()
        log.info(
            "hand-over done",
            extra={
                "revoked": sorted(revoked),
                "discarded": discarded,
                "drained": drained,
                "seconds": round(time.monotonic() - started, 3),
            },
        )

    async def partitions_assigned(self, tps: Set[TP]) -> None:
        self._rebalances += 1
        self.metrics.rebalanced()
        self._owned |= set(tps)
        if self.batcher.paused:
            self.input.pause(tps)

    async def _drop_later(self, users: list[str]) -> None:
        engine = self.engine
        assert engine is not None
        async with self._engine_lock:
            await engine.drop(users)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ HTTP routes

    def _metrics_route(self) -> Response:
        body, content_type = self.metrics.render()
        return Response(200, body, content_type)

    def _health(self) -> Response:
        now = time.monotonic()
        stall = self.config.http.stall_timeout_s
        problems = []
        if self._error is not None:
            problems.append(f"fatal error: {self._error!r}")
        if now - self._last_fetch > stall and self.engine is not None and self._owned:
            problems.append(f"no fetch for {now - self._last_fetch:.0f}s")
        if self.batcher.depth and now - self._last_step > stall:
            problems.append(f"{self.batcher.depth} events queued, no batch for {stall:.0f}s")
        if problems:
            return Response(503, ("; ".join(problems) + "\n").encode())
        return Response(200, b"ok\n")

    def _ready(self) -> Response:
        if self.ready:
            return Response(200, b"ready\n")
        why = "model not loaded" if self.engine is None else "no partitions assigned"
        return Response(503, f"not ready: {why}\n".encode())


def serving_scoring(model: ModelConfig, hstu: HSTUConfig) -> ScoringConfig:
    """The scoring the worker serves with: the configured sizes, clamped to the catalogue
    (a small model may have fewer items than ``num_candidates``), and the default task
    weights restricted to the model's tasks. The offline recompute must use the same."""
    retrievable = hstu.num_items - hstu.first_item_row
    exclude = min(ScoringConfig().exclude_recent, max(retrievable - 1, 0))
    pool = max(1, min(model.num_candidates, retrievable - exclude))
    weights = ScoringConfig().task_weights
    return ScoringConfig(
        top_k=min(model.top_k, pool),
        num_candidates=pool,
        exclude_recent=exclude,
        task_weights={k: v for k, v in weights.items() if k in hstu.task_names},
    )


async def _wait_either(coro: Coroutine[object, object, None], event: asyncio.Event) -> None:
    """Wait until ``coro`` finishes or ``event`` is set, whichever comes first."""
    first = asyncio.ensure_future(coro)
    second = asyncio.ensure_future(event.wait())
    _, pending = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def _finish(task: asyncio.Task[None], timeout_s: float) -> bool:
    """Await ``task`` up to ``timeout_s``, cancelling it after; True if it ended by itself."""
    done, _ = await asyncio.wait({task}, timeout=max(timeout_s, 0.001))
    if done:
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False
