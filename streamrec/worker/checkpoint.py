"""Commits and partition hand-over: the ordered steps that make "nothing lost" hold.

An offset is committed only once every record before it is done (``OffsetTracker``), and
only while the broker still serves the log the worker bound at start: the cluster id is
asked before every commit and every batch (``same_log``). A replaced log (the dev broker
lost its data and offsets restart at 0) stops the worker with status 1 before anything
of the new log is applied or committed.

Revoke (aiokafka awaits it inside the rebalance, before another member starts on the
partitions), in this order:

1. stop feeding the partitions: forget them as owned (intake drops their records),
   discard their queued deltas (never done, so never committed: re-read by the owner);
2. hold the pipeline: take no new batch, wait for the batches in flight, up to the drain
   bound (a stuck store must not stall the whole group past ``max_poll_interval_ms``);
3. flush the producer: what was published gets acknowledged and completes its offsets;
4. commit the partitions' final positions and forget them (a new generation next time);
5. drop their users from the caches (their next owner rebuilds them), after the batches
   taken before the revoke if the drain bound ran out;
6. release the pipeline.

Assign only records ownership. Shutdown is a revoke of everything, through ``App``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Set
from dataclasses import dataclass

from aiokafka.errors import KafkaError

from streamrec.backoff import Backoff
from streamrec.cache.history_store import HistoryStore
from streamrec.errors import BrokerError
from streamrec.pipeline.engine import Engine
from streamrec.pipeline.micro_batcher import MicroBatcher
from streamrec.worker.config import WorkerConfig
from streamrec.worker.consumer import TP, KafkaInput
from streamrec.worker.log_scoped_store import LogScopedStore
from streamrec.worker.metrics import WorkerMetrics
from streamrec.worker.offset_tracker import OffsetTracker
from streamrec.worker.publisher import Publisher
from streamrec.worker.serving_pipeline import ServingPipeline

log = logging.getLogger(__name__)
_COMMIT_TIMES = 4096  # recent successful commit times, for the latency split


@dataclass(frozen=True)
class CheckpointStats:
    commits: int
    rebalances: int
    owned: frozenset[TP]
    committed: dict[TP, int]


class Checkpoint:
    def __init__(
        self,
        config: WorkerConfig,
        *,
        tracker: OffsetTracker,
        consumer: KafkaInput,
        publisher: Publisher,
        batcher: MicroBatcher,
        metrics: WorkerMetrics,
        scoped: LogScopedStore,
        store: HistoryStore,
        stopping: asyncio.Event,
        fatal: Callable[[BaseException], None],
    ) -> None:
        self._config = config
        self._tracker = tracker
        self._input = consumer
        self._publisher = publisher
        self._batcher = batcher
        self._metrics = metrics
        self._scoped = scoped
        self._store = store
        self._stopping = stopping
        self._fatal = fatal
        self._engine: Engine | None = None
        self._pipeline: ServingPipeline | None = None
        self._owned: set[TP] = set()
        self._log_replaced = False
        self._background: set[asyncio.Task[None]] = set()
        self._commits = 0
        self._rebalances = 0
        self.broker_down_since: float | None = None  # monotonic; None while reachable
        self.commit_times: deque[float] = deque(maxlen=_COMMIT_TIMES)  # monotonic

    def attach(self, engine: Engine, pipeline: ServingPipeline) -> None:
        """The serving side, built once the model is loaded (before any assignment)."""
        self._engine = engine
        self._pipeline = pipeline

    def owns(self, tp: TP) -> bool:
        return tp in self._owned

    @property
    def owned(self) -> frozenset[TP]:
        return frozenset(self._owned)

    def stats(self) -> CheckpointStats:
        return CheckpointStats(
            commits=self._commits,
            rebalances=self._rebalances,
            owned=frozenset(self._owned),
            committed={tp: p for tp, p in self._tracker.committed().items() if tp in self._owned},
        )

    # ------------------------------------------------------------------ commits

    async def commit_loop(self) -> None:
        interval = self._config.group.commit_interval_ms / 1000.0
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), interval)
            await self.commit()
            committed = self._tracker.committed()
            self._metrics.set_lag(
                self._input.lags({tp: committed[tp] for tp in self._owned if tp in committed})
            )

    async def commit(self, positions: dict[TP, int] | None = None) -> bool:
        """Commit what is committable (or ``positions``); with nothing to commit, still ask
        for the cluster id, so readiness notices a lost broker on an idle worker."""
        wanted = self._tracker.committable() if positions is None else positions
        if not wanted:
            await self.same_log(wait=False)
            return True
        if not await self.same_log(wait=False):
            return False  # these positions belong to a log the broker no longer has
        started = time.perf_counter()
        try:
            await self._input.commit(wanted)
        except (KafkaError, BrokerError) as exc:
            log.warning("commit failed; retried later", extra={"error": repr(exc)})
            return False
        self._tracker.mark_committed(wanted)
        self._commits += 1
        self.commit_times.append(time.monotonic())
        self._metrics.committed(time.perf_counter() - started, time.time())
        return True

    async def same_log(self, *, wait: bool) -> bool:
        """True if the broker still serves the log bound at start (same cluster id).

        Asked right before an append or a commit: an answer with the bound id proves every
        record fetched before it came from that log (ids only ever change to new ones).
        While the broker is unreachable, ``wait`` retries with backoff until it answers
        or the worker stops; without it the answer is False.
        """
        backoff = Backoff(0.05, self._config.kafka.connect_retry_max_s)
        while not self._log_replaced:
            try:
                current = await self._input.cluster_id()
            except (KafkaError, BrokerError) as exc:
                if self.broker_down_since is None:
                    self.broker_down_since = time.monotonic()
                if not wait or self._stopping.is_set():
                    return False
                delay = backoff.next_delay()
                log.warning(
                    "cluster id unavailable, retrying",
                    extra={"error": repr(exc), "retry_in_s": round(delay, 2)},
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)
                continue
            self.broker_down_since = None
            if current == self._scoped.log_id:
                return True
            self._log_replaced = True
            self._fatal(
                BrokerError(
                    f"the input log was replaced: cluster id {self._scoped.log_id!r} is now "
                    f"{current!r} (offsets restart at 0); restart to bind the new log"
                )
            )
        return False

    # ------------------------------------------------------------------ hand-over

    async def revoked(self, tps: Set[TP]) -> None:
        if not tps:
            return
        revoked = set(tps)
        self._owned -= revoked
        discarded = self._batcher.discard(revoked)
        drain = self._config.group.drain_timeout_s
        started = time.monotonic()
        pipeline, engine = self._pipeline, self._engine
        drained = True if pipeline is None else await pipeline.hold(drain)
        try:
            left = max(drain - (time.monotonic() - started), 0.1)
            await self._publisher.flush(left)
            await self.commit(self._tracker.revoke(revoked))
            if engine is not None and pipeline is not None and not self._stopping.is_set():
                if drained:
                    await self._drop(revoked)
                else:  # after the batches taken so far, which may still cache these users
                    self._spawn(self._drop_after(pipeline.last_taken_seq, revoked))
        finally:
            if pipeline is not None:
                pipeline.release()
        log.info(
            "hand-over done",
            extra={
                "revoked": sorted(revoked),
                "discarded": discarded,
                "drained": drained,
                "seconds": round(time.monotonic() - started, 3),
            },
        )

    async def assigned(self, tps: Set[TP]) -> None:
        self._rebalances += 1
        self._metrics.rebalanced()
        self._owned |= set(tps)
        if self._batcher.paused:
            self._input.pause(tps)

    async def _drop(self, tps: set[TP]) -> None:
        engine = self._engine
        assert engine is not None
        await engine.drop(engine.users_of(tps))
        await self._store.drop_partitions(tps)

    async def _drop_after(self, seq: int, tps: set[TP]) -> None:
        pipeline = self._pipeline
        assert pipeline is not None
        await pipeline.finished_through(seq)
        await self._drop(tps - self._owned)  # not the ones assigned back meanwhile

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
