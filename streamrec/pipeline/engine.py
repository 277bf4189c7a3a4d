"""The inference engine: a batch of user deltas in, one recommendation per user out.

A batch goes through two stages, so that the worker can overlap them across batches
(DESIGN §5: the next batch's host work runs while the current step is on the GPU):

1. ``prepare`` (event loop; the store is async): build each event's token once, append
   the batch to the history store (idempotent; a store outage is retried with backoff,
   which stalls this batch and, through the batcher's watermarks, the consumer), decide
   per user whether the cached state can be extended by the new tokens or must be rebuilt
   from the store (a miss, or a redelivery the store partly skipped: only a rebuild is
   certain to match the stored history), and read the rebuilt users' histories.
2. ``execute`` (the engine's own thread and CUDA stream): the model step (``ModelStep``),
   then the outputs as arrays (``RecommendationBatch``), ready to encode.

Batches must be executed one at a time, in the batcher's order: that is what keeps each
user's tokens in order (the batcher coalesces a user's events inside one batch only). The
prepare of batch n + 1 may run while batch n executes. It may then see a user as cached
that batch n evicts (the step finds it gone and the engine rebuilds it from the store,
``lost``), or as missing that batch n caches (it is rebuilt once more): both are exact,
because a rebuild reads the store after the batch's own append.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from streamrec.backoff import Backoff
from streamrec.cache.history_store import AppendResult, History, HistoryEvent, HistoryStore
from streamrec.cache.kv_tiers import CacheOutcome, KVTiers
from streamrec.errors import PipelineError, StoreError
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.pipeline.delta import UserDelta
from streamrec.pipeline.item_catalog import ItemCatalog
from streamrec.pipeline.micro_batcher import Batch
from streamrec.pipeline.model_step import (
    PREFILL_CALL_TOKENS,
    ModelStep,
    StepTimings,
    UserOutput,
    UserWork,
)
from streamrec.pipeline.scorer import Scorer
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.pipeline.serving_model import ServingModel
from streamrec.pipeline.step_generation import StepGeneration
from streamrec.schemas.recommendation_batch import RecommendationBatch

log = logging.getLogger(__name__)
A = TypeVar("A")
R = TypeVar("R")
TP = tuple[str, int]


@dataclass(frozen=True)
class EngineConfig:
    model_name: str
    model_version: str
    backend: str = "eager"  # "aoti", "eager", "eager_fallback": reported, never branched on
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    # The model's prefill keeps tokens jagged (the fused prefill op): rebuilt users go in
    # one call. Off (a dense prefill), they go in calls per length class (model_step.py).
    jagged_prefill: bool = False
    prefill_call_tokens: int = PREFILL_CALL_TOKENS  # most tokens of one jagged prefill call
    store_retry_initial_s: float = 0.05
    store_retry_max_s: float = 2.0

    def __post_init__(self) -> None:
        if self.prefill_call_tokens <= 0:
            raise PipelineError(f"prefill_call_tokens={self.prefill_call_tokens}: need > 0")
        if not 0 < self.store_retry_initial_s <= self.store_retry_max_s:
            raise PipelineError(
                f"store retry backoff {self.store_retry_initial_s}s..{self.store_retry_max_s}s: "
                "need 0 < initial <= max"
            )


@dataclass(frozen=True)
class PreparedBatch:
    """A batch whose appends are durable, with each user's work for the step."""

    batch: Batch
    work: list[UserWork]
    io_seconds: dict[str, float]  # append, history_get (event-loop time)
    new_items: np.ndarray | None = None  # [events] item rows: the catalogue's popularity


@dataclass(frozen=True)
class BatchResult:
    """A batch's outcome: the recommendations (users with a history, in batch order) and
    which batch users they belong to; users without any history publish nothing."""

    batch: Batch
    output: RecommendationBatch
    rows: np.ndarray  # [B] row of each batch user in ``output``, -1 for none
    step_seconds: float  # engine-thread wall time of the step

    def recommendation_rows(self) -> list[int | None]:
        """Per batch user, its row in ``output`` (None: nothing to publish)."""
        return [None if r < 0 else int(r) for r in self.rows.tolist()]


@dataclass
class EngineStats:
    backend: str
    batches: int = 0
    users: int = 0
    events: int = 0
    gpu_hits: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    rebuilds_after_redelivery: int = 0
    rebuilds_after_burst: int = 0
    rebuilds_after_loss: int = 0
    tokens_prefilled: int = 0
    tokens_extended: int = 0
    batch_splits: int = 0
    store_retries: int = 0
    last_retry_at: float = 0.0  # time.monotonic() of the newest store retry
    phase_seconds: dict[str, float] = field(default_factory=dict)
    step_seconds: float = 0.0  # engine-thread wall time of every step: the busy time
    last_batch_seconds: float = 0.0


@dataclass
class _UserState:
    """What the engine remembers of a cached user besides its KV blocks."""

    total: int  # tokens ever appended to the store: the recommendation version
    recent: np.ndarray  # [<=E] item rows, newest last
    tps: set[TP]  # the input partitions the user's events came from (hand-over)


class Engine:
    def __init__(
        self,
        model: ServingModel,
        tiers: KVTiers,
        store: HistoryStore,
        vocab: ItemVocabulary,
        task_names: Sequence[str],
        config: EngineConfig,
        catalog: ItemCatalog | None = None,
        generation: StepGeneration | None = None,
    ) -> None:
        self.config = config
        self.tiers = tiers
        self.catalog = catalog  # the item table past the GPU budget (issue 20)
        self.store = store
        self.vocab = vocab
        self.device = tiers.cache.device
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self.scorer = Scorer(model, tiers.cache, config.scoring, task_names, catalog=catalog)
        self.step = ModelStep(
            model, tiers, self.scorer, self.device, catalog=catalog, generation=generation,
            jagged_prefill=config.jagged_prefill, prefill_call_tokens=config.prefill_call_tokens,
        )  # fmt: skip
        self._external = vocab.external_ids()  # [rows] item id per row, for the output
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="streamrec-engine")
        self._users: dict[str, _UserState] = {}
        # engine thread: user -> version a loss rebuild reached, ahead of its batch
        self._ahead: dict[str, int] = {}
        self._stats = EngineStats(backend=config.backend)
        self._closing = False

    # ------------------------------------------------------------------ public API

    async def process(self, batch: Batch) -> BatchResult:
        """``prepare`` then ``execute``: one batch, nothing overlapped."""
        return await self.execute(await self.prepare(batch))

    async def prepare(self, batch: Batch) -> PreparedBatch:
        users = batch.users
        vocab_index = self.vocab.index
        events: list[HistoryEvent] = []
        tokens: dict[str, np.ndarray] = {}
        for ud in users:
            rows = [(vocab_index(d.item_id), d.action, d.ts_ms) for d in ud.deltas]
            tokens[ud.user_id] = np.array(rows, dtype=np.int64)  # [n, 3]
            events.extend(
                HistoryEvent(ud.user_id, d.topic, d.partition, d.offset, row)
                for d, row in zip(ud.deltas, rows, strict=True)
            )
        append_start = time.perf_counter()
        appended: AppendResult = await self._with_retry("append", self.store.append, events)
        append_s = time.perf_counter() - append_start

        work, rebuild = self._plan(batch, tokens, appended)
        get_start = time.perf_counter()
        if rebuild:
            histories = await self._with_retry("get", self.store.get, rebuild)
            tps = {ud.user_id: {d.source.tp for d in ud.deltas} for ud in users}
            for user in rebuild:
                history = histories.get(user, History.empty())
                if len(history):
                    work.append(self._rebuild_work(user, history, tps[user]))
        get_s = time.perf_counter() - get_start
        new_items = None
        if self.catalog is not None and tokens:
            new_items = np.concatenate([t[:, 0] for t in tokens.values()])
        io = {"append": append_s, "history_get": get_s}
        return PreparedBatch(batch, work, io, new_items)

    async def execute(self, prepared: PreparedBatch) -> BatchResult:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        outputs, timings, rebuilt = await loop.run_in_executor(
            self._executor, self._run_batch, prepared, loop
        )
        if rebuilt:  # engine state of users rebuilt after a loss
            by_user = {ud.user_id: ud for ud in prepared.batch.users}
            for user, work in rebuilt.items():
                if user not in self._users:  # else a later plan already keeps it
                    tps = {d.source.tp for d in by_user[user].deltas}
                    self._users[user] = _UserState(work.version, work.recent, tps)
        result = self._result(prepared, outputs, timings, timings.wall)
        self._account(prepared, outputs, timings)
        self._stats.last_batch_seconds = time.perf_counter() - started
        return result

    async def warm_up(self, max_seq_len: int, item_row: int) -> None:
        """Before serving, on a GPU: one full-size prefill call on the engine's thread and
        stream, so that the first batch of cache misses does not pay the first call's
        costs (``ModelStep.warm_up_prefill``). A call the GPU cannot hold fails here, at
        start, naming the knobs, not in the first batch of a rebalance."""
        if self._stream is None:
            return  # CPU: no lazy module loads, and a call of this size costs seconds
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        tokens = await loop.run_in_executor(self._executor, self._warm_up, max_seq_len, item_row)
        if tokens:
            log.info(
                "prefill warmed up",
                extra={"tokens": tokens, "seconds": round(time.perf_counter() - start, 3)},
            )

    def _warm_up(self, max_seq_len: int, item_row: int) -> int:
        assert self._stream is not None
        try:
            with torch.inference_mode(), torch.cuda.stream(self._stream):
                tokens = self.step.warm_up_prefill(max_seq_len, item_row)
            self._stream.synchronize()
        except torch.OutOfMemoryError as exc:
            raise PipelineError(
                f"a prefill call of {self.config.prefill_call_tokens} tokens does not fit "
                "in the GPU memory the KV pool leaves: lower model.prefill_call_tokens or "
                "the KV budget (cache.kv_budget_bytes / cache.kv_budget_fraction)"
            ) from exc
        return tokens

    async def drop(self, users: Collection[str]) -> None:
        """Forget users (their new owner rebuilds them). Call with no step in flight."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._drop, list(users))
        await self.store.drop(list(users))

    def users_of(self, tps: Collection[TP]) -> list[str]:
        """Cached users with an event from one of ``tps`` (a revoke drops them)."""
        wanted = set(tps)
        return sorted(u for u, s in self._users.items() if not wanted.isdisjoint(s.tps))

    def cached_users(self) -> set[str]:
        """Users that have engine state here (tests: no user cached on two workers)."""
        return set(self._users)

    async def close(self) -> None:
        self._closing = True
        # off the loop: a step that lost users waits on the loop for their histories
        await asyncio.to_thread(self._executor.shutdown, True)
        self.tiers.close()  # the disk tier's threads and files
        if self.catalog is not None:
            self.catalog.close()

    def stats(self) -> EngineStats:
        return self._stats

    # ------------------------------------------------------------------ internals

    def _plan(
        self, batch: Batch, tokens: dict[str, np.ndarray], appended: AppendResult
    ) -> tuple[list[UserWork], list[str]]:
        where = self.tiers.resolve(ud.user_id for ud in batch.users)
        self.tiers.prefetch(u for u, w in where.items() if w is CacheOutcome.DISK_HIT)
        work: list[UserWork] = []
        rebuild: list[str] = []
        keep = self.config.scoring.exclude_recent
        for ud in batch.users:
            state = self._users.get(ud.user_id)
            applied = appended.applied.get(ud.user_id, 0)
            cached = state is not None and where[ud.user_id] is not CacheOutcome.MISS
            # A burst as long as the window replaces the whole cache: rebuilding from the
            # store's window is exact and cheaper than extending and trimming.
            burst = ud.n_events >= self.tiers.max_seq_len
            if cached and applied == ud.n_events and not burst:
                assert state is not None
                new = tokens[ud.user_id]  # [n, 3]
                state.total += applied
                if keep:
                    state.recent = np.concatenate([state.recent, new[:, 0]])[-keep:]
                state.tps.update(d.source.tp for d in ud.deltas)
                work.append(UserWork(ud.user_id, new, False, state.recent, state.total))
            else:
                if cached and applied != ud.n_events:
                    self._stats.rebuilds_after_redelivery += 1
                elif cached:
                    self._stats.rebuilds_after_burst += 1
                rebuild.append(ud.user_id)
        return work, rebuild

    def _run_batch(
        self, prepared: PreparedBatch, loop: asyncio.AbstractEventLoop
    ) -> tuple[list[UserOutput], StepTimings, dict[str, UserWork]]:
        """One batch's step on the engine thread, with the rebuild of the users it found
        gone in the same job, so that cache updates follow batch order exactly.

        ``prepare`` runs ahead of ``execute``: when a step finds a planned-as-cached user
        gone (an earlier step evicted it from every tier), later prepared batches may
        already have appended the user's next events. The rebuild reads the store's
        window as it is now (total T, through the loop: the store is async) and publishes
        that newer list with this batch; the later batches' works for the user at a
        version <= T are then already in the cache and are skipped (``_ahead``), the first
        one past T extends it. Cache updates of one batch never interleave with another's.
        """
        work = [w for w in prepared.work if not self._already_applied(w)]
        outputs, timings = self._run_step(work, prepared.new_items)
        rebuilt: dict[str, UserWork] = {}
        if timings.lost:
            self._stats.rebuilds_after_loss += len(timings.lost)
            get = self._with_retry("get", self.store.get, list(timings.lost))
            histories = asyncio.run_coroutine_threadsafe(get, loop).result()
            for user in timings.lost:
                history = histories.get(user, History.empty())
                if len(history):
                    keep = self.config.scoring.exclude_recent
                    rebuilt[user] = UserWork.from_history(user, history, keep, self.vocab.size)
                    self._ahead[user] = history.total_appended
            more, extra = self._run_step(list(rebuilt.values()))
            outputs += more
            timings.merge(extra)
        return outputs, timings, rebuilt

    def _already_applied(self, work: UserWork) -> bool:
        """Whether a loss rebuild of an earlier batch already put this work in the cache."""
        ahead = self._ahead.get(work.user_id)
        if ahead is None:
            return False
        if work.version <= ahead:
            return True
        del self._ahead[work.user_id]  # past the rebuild: applies as planned
        return False

    def _rebuild_work(self, user: str, history: History, tps: set[TP]) -> UserWork:
        keep = self.config.scoring.exclude_recent
        work = UserWork.from_history(user, history, keep, self.vocab.size)
        state = self._users.get(user)
        known = state.tps if state is not None else set()
        self._users[user] = _UserState(history.total_appended, work.recent, known | tps)
        return work

    def _run_step(
        self, work: list[UserWork], new_items: np.ndarray | None = None
    ) -> tuple[list[UserOutput], StepTimings]:
        with torch.inference_mode():
            if self._stream is None:
                outputs, timings = self._step(work, new_items)
            else:
                with torch.cuda.stream(self._stream):
                    outputs, timings = self._step(work, new_items)
                self._stream.synchronize()
        for user in timings.dropped:  # gone from every tier: next time is a rebuild
            self._users.pop(user, None)
            self._ahead.pop(user, None)  # nothing cached is ahead of its batches now
        return outputs, timings

    def _step(
        self, work: list[UserWork], new_items: np.ndarray | None
    ) -> tuple[list[UserOutput], StepTimings]:
        if self.catalog is not None and new_items is not None:
            self.catalog.observe(new_items)  # may apply a set refresh: engine stream
        return self.step.run(work)

    def _drop(self, users: list[str]) -> None:
        self.tiers.drop(users)
        if self.step.generation is not None:
            self.step.generation.forget(users)
        for user in users:
            self._users.pop(user, None)
            self._ahead.pop(user, None)

    async def _with_retry(self, what: str, call: Callable[[A], Awaitable[R]], arg: A) -> R:
        backoff = Backoff(self.config.store_retry_initial_s, self.config.store_retry_max_s)
        while True:
            try:
                return await call(arg)
            except StoreError as exc:
                if self._closing:
                    raise
                self._stats.store_retries += 1
                self._stats.last_retry_at = time.monotonic()
                delay = backoff.next_delay()
                log.warning("history store %s failed, retrying in %.2fs: %s", what, delay, exc)
                await asyncio.sleep(delay)

    def _result(
        self,
        prepared: PreparedBatch,
        outputs: list[UserOutput],
        timings: StepTimings,
        busy: float,
    ) -> BatchResult:
        users = prepared.batch.users
        by_user = {out.user_id: out for out in outputs}
        rows = np.full(len(users), -1, dtype=np.int64)  # [B]
        kept: list[UserDelta] = []
        for b, ud in enumerate(users):
            if ud.user_id in by_user:
                rows[b] = len(kept)
                kept.append(ud)
        outs = [by_user[ud.user_id] for ud in kept]
        top_k = self.config.scoring.top_k
        items = np.stack([o.items for o in outs]) if outs else np.zeros((0, top_k), np.int64)
        scores = (
            np.stack([o.scores for o in outs]).astype(np.float32)
            if outs
            else np.zeros((0, top_k), np.float32)
        )
        tasks = None
        if outs and outs[0].task_scores is not None:
            tasks = np.stack([o.task_scores for o in outs]).astype(np.float32)  # type: ignore[misc]
        generated = self._generated(outs)
        phases = {k: v * 1000.0 for k, v in prepared.io_seconds.items()} | timings.as_ms()
        output = RecommendationBatch(
            user_ids=[ud.user_id for ud in kept],
            item_ids=self._external[items],
            scores=scores,
            task_scores=tasks,
            task_names=self.scorer.task_names,
            versions=np.array([o.version for o in outs], dtype=np.int64),
            last_event_ts_ms=np.array([ud.newest_ts_ms for ud in kept], dtype=np.int64),
            cache_outcomes=[o.outcome for o in outs],
            generated_at_ms=int(time.time() * 1000),
            model_name=self.config.model_name,
            model_version=self.config.model_version,
            timings_ms={k: round(v, 3) for k, v in phases.items()},
            generated_ids=None if generated is None else self._external[generated[0]],
            generated_scores=None if generated is None else generated[1],
        )
        return BatchResult(prepared.batch, output, rows, busy)

    def _generated(self, outs: list[UserOutput]) -> tuple[np.ndarray, np.ndarray] | None:
        """(items [B, k], scores [B, k]) of the step's generation, or None when it is off."""
        generation = self.step.generation
        if generation is None:
            return None
        if not outs:
            return np.zeros((0, generation.k), np.int64), np.zeros((0, generation.k), np.float32)
        items = np.stack([o.generated for o in outs])  # type: ignore[misc]
        scores = np.stack([o.generated_scores for o in outs]).astype(np.float32)  # type: ignore[misc]
        return items, scores

    def _account(
        self, prepared: PreparedBatch, outputs: list[UserOutput], timings: StepTimings
    ) -> None:
        s = self._stats
        s.batches += 1
        s.users += prepared.batch.n_users
        s.events += prepared.batch.n_events
        for out in outputs:
            if out.outcome is CacheOutcome.GPU_HIT:
                s.gpu_hits += 1
            elif out.outcome is CacheOutcome.HOST_HIT:
                s.host_hits += 1
            elif out.outcome is CacheOutcome.DISK_HIT:
                s.disk_hits += 1
            else:
                s.misses += 1
        s.tokens_prefilled += timings.tokens_prefilled
        s.tokens_extended += timings.tokens_extended
        s.batch_splits += timings.splits
        s.step_seconds += timings.wall
        phase_s = {k: v / 1000.0 for k, v in timings.as_ms().items()} | prepared.io_seconds
        for name, seconds in phase_s.items():
            s.phase_seconds[name] = s.phase_seconds.get(name, 0.0) + seconds
