"""The inference engine: a batch of user deltas in, one recommendation per user out.

Per batch, in this order (DESIGN §5):

1. idempotent history append (event loop; the store is async). A store outage is retried
   with backoff, which stalls this batch and so, through the batcher's watermarks, the
   consumer: nothing past the failed events is ever completed.
2. decide per user whether the cached state can simply be extended by the new tokens, or
   must be rebuilt from the store (a miss, or a redelivery that the store partly skipped,
   where only a rebuild is certain to match the stored history);
3. one batched ``get`` for the rebuilt users;
4. the model step on the engine's own thread and CUDA stream (``ModelStep``);
5. results back on the event loop as ``UserResult``s carrying the source offsets, which the
   worker completes only after the producer acknowledges the recommendation.

Batches must be processed one at a time, in the batcher's order: that is what keeps each
user's tokens in order (the batcher coalesces a user's events inside one batch only).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from streamrec.cache.history_store import AppendResult, History, HistoryEvent, HistoryStore, Token
from streamrec.cache.kv_tiers import CacheOutcome, KVTiers
from streamrec.errors import PipelineError, StoreError
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.pipeline.delta import SourceOffset, UserDelta
from streamrec.pipeline.item_catalog import ItemCatalog
from streamrec.pipeline.micro_batcher import Batch
from streamrec.pipeline.model_step import ModelStep, StepTimings, UserOutput, UserWork
from streamrec.pipeline.scorer import Scorer, ScoringConfig
from streamrec.pipeline.serving_model import ServingModel
from streamrec.schemas.records import Recommendation

log = logging.getLogger(__name__)
A = TypeVar("A")
R = TypeVar("R")


@dataclass(frozen=True)
class EngineConfig:
    model_name: str
    model_version: str
    backend: str = "eager"  # "aoti" or "eager": reported, never branched on
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    store_retry_initial_s: float = 0.05
    store_retry_max_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.store_retry_initial_s <= self.store_retry_max_s:
            raise PipelineError(
                f"store retry backoff {self.store_retry_initial_s}s..{self.store_retry_max_s}s: "
                "need 0 < initial <= max"
            )


@dataclass(frozen=True)
class UserResult:
    """One user's share of a batch: what to publish and which offsets it covers."""

    user_id: str
    recommendation: Recommendation | None  # None only when the user has no history at all
    sources: tuple[SourceOffset, ...]
    first_enqueued_at: float


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
    tokens_prefilled: int = 0
    tokens_extended: int = 0
    batch_splits: int = 0
    store_retries: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    last_batch_seconds: float = 0.0


@dataclass
class _UserState:
    """What the engine remembers of a cached user besides its KV blocks."""

    total: int  # tokens ever appended to the store: the recommendation version
    recent: np.ndarray  # [<=E] item rows, newest last


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
    ) -> None:
        self.config = config
        self.tiers = tiers
        self.catalog = catalog  # the item table past the GPU budget (issue 20)
        self.store = store
        self.vocab = vocab
        self.device = tiers.cache.device
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        sync = torch.cuda.synchronize if cuda else None
        self.scorer = Scorer(
            model, tiers.cache, config.scoring, task_names, sync=sync, catalog=catalog
        )
        self.step = ModelStep(model, tiers, self.scorer, self.device, sync=sync, catalog=catalog)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="streamrec-engine")
        self._users: dict[str, _UserState] = {}
        self._stats = EngineStats(backend=config.backend)
        self._closing = False

    # ------------------------------------------------------------------ public API

    async def process(self, batch: Batch) -> list[UserResult]:
        started = time.perf_counter()
        users = list(batch.users)
        # Each event's token is built once: the store append and the extend share it.
        tokens = {
            ud.user_id: np.array(
                [[self.vocab.index(d.item_id), d.action, d.ts_ms] for d in ud.deltas],
                dtype=np.int64,
            )  # [n, 3]
            for ud in users
        }
        events = [
            HistoryEvent(ud.user_id, d.topic, d.partition, d.offset, Token(*map(int, row)))
            for ud in users
            for d, row in zip(ud.deltas, tokens[ud.user_id], strict=True)
        ]
        append_start = time.perf_counter()
        appended: AppendResult = await self._with_retry("append", self.store.append, events)
        append_s = time.perf_counter() - append_start

        work, rebuild = self._plan(users, tokens, appended)
        get_start = time.perf_counter()
        histories: dict[str, History] = {}
        if rebuild:
            histories = await self._with_retry("get", self.store.get, rebuild)
        get_s = time.perf_counter() - get_start
        for user in rebuild:
            history = histories.get(user, History.empty())
            if len(history):
                work.append(self._rebuild_work(user, history))

        loop = asyncio.get_running_loop()
        new_items = np.concatenate([t[:, 0] for t in tokens.values()]) if tokens else None
        outputs, timings = await loop.run_in_executor(
            self._executor, self._run_step, work, new_items
        )
        if timings.lost:
            lost = await self._with_retry("get", self.store.get, timings.lost)
            redo = [self._rebuild_work(user, h) for user, h in lost.items() if len(h)]
            more, extra = await loop.run_in_executor(self._executor, self._run_step, redo)
            outputs += more
            timings.merge(extra)
        by_user = {out.user_id: out for out in outputs}
        phases = {"append": append_s * 1000.0, "history_get": get_s * 1000.0, **timings.as_ms()}
        now_ms = int(time.time() * 1000)
        results = [
            UserResult(
                user_id=ud.user_id,
                recommendation=self._recommendation(ud, by_user.get(ud.user_id), phases, now_ms),
                sources=ud.sources,
                first_enqueued_at=ud.first_enqueued_at,
            )
            for ud in users
        ]
        self._account(users, outputs, timings, {"append": append_s, "history_get": get_s})
        self._stats.last_batch_seconds = time.perf_counter() - started
        return results

    async def drop(self, users: Sequence[str]) -> None:
        """Forget users whose partitions were revoked (their new owner rebuilds them)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._drop, list(users))
        await self.store.drop(list(users))

    def cached_users(self) -> set[str]:
        """Users that have engine state here (tests: no user cached on two workers)."""
        return set(self._users)

    async def close(self) -> None:
        self._closing = True
        self._executor.shutdown(wait=True)
        if self.catalog is not None:
            self.catalog.close()

    def stats(self) -> EngineStats:
        return self._stats

    # ------------------------------------------------------------------ internals

    def _plan(
        self, users: list[UserDelta], tokens: dict[str, np.ndarray], appended: AppendResult
    ) -> tuple[list[UserWork], list[str]]:
        where = self.tiers.resolve(ud.user_id for ud in users)
        self.tiers.prefetch(u for u, w in where.items() if w is CacheOutcome.DISK_HIT)
        work: list[UserWork] = []
        rebuild: list[str] = []
        keep = self.config.scoring.exclude_recent
        for ud in users:
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
                state.recent = (
                    np.concatenate([state.recent, new[:, 0]])[-keep:] if keep else state.recent
                )
                work.append(UserWork(ud.user_id, new, False, state.recent, state.total))
            else:
                if cached and applied != ud.n_events:
                    self._stats.rebuilds_after_redelivery += 1
                elif cached:
                    self._stats.rebuilds_after_burst += 1
                rebuild.append(ud.user_id)
        return work, rebuild

    def _rebuild_work(self, user: str, history: History) -> UserWork:
        keep = self.config.scoring.exclude_recent
        tokens = np.stack([history.items, history.actions, history.ts], axis=1)  # [L, 3]
        recent = history.items[-keep:].copy() if keep else np.zeros(0, dtype=np.int64)
        self._users[user] = _UserState(total=history.total_appended, recent=recent)
        return UserWork(user, tokens.astype(np.int64), True, recent, history.total_appended)

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
        return outputs, timings

    def _step(
        self, work: list[UserWork], new_items: np.ndarray | None
    ) -> tuple[list[UserOutput], StepTimings]:
        if self.catalog is not None and new_items is not None:
            self.catalog.observe(new_items)  # may apply a set refresh: engine stream
        return self.step.run(work)

    def _drop(self, users: list[str]) -> None:
        self.tiers.drop(users)
        for user in users:
            self._users.pop(user, None)

    async def _with_retry(self, what: str, call: Callable[[A], Awaitable[R]], arg: A) -> R:
        delay = self.config.store_retry_initial_s
        while True:
            try:
                return await call(arg)
            except StoreError as exc:
                if self._closing:
                    raise
                self._stats.store_retries += 1
                log.warning("history store %s failed, retrying in %.2fs: %s", what, delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.config.store_retry_max_s)

    def _recommendation(
        self, ud: UserDelta, out: UserOutput | None, phases: dict[str, float], now_ms: int
    ) -> Recommendation | None:
        if out is None:
            return None
        task_names = self.scorer.task_names
        items = tuple(
            (self.vocab.external(int(row)), float(score))
            for row, score in zip(out.items, out.scores, strict=True)
        )
        task_scores = None
        if out.task_scores is not None:
            task_scores = {
                name: tuple(float(x) for x in out.task_scores[:, col])
                for col, name in enumerate(task_names)
            }
        return Recommendation(
            user_id=ud.user_id,
            items=items,
            model_name=self.config.model_name,
            model_version=self.config.model_version,
            version=out.version,
            last_event_ts_ms=ud.newest_ts_ms,
            generated_at_ms=now_ms,
            cache_outcome=out.outcome,
            task_scores=task_scores,
            timings_ms={k: round(v, 3) for k, v in phases.items()},
        )

    def _account(
        self,
        users: list[UserDelta],
        outputs: list[UserOutput],
        timings: StepTimings,
        io_seconds: dict[str, float],
    ) -> None:
        s = self._stats
        s.batches += 1
        s.users += len(users)
        s.events += sum(ud.n_events for ud in users)
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
        phase_s = {k: v / 1000.0 for k, v in timings.as_ms().items()} | io_seconds
        for name, seconds in phase_s.items():
            s.phase_seconds[name] = s.phase_seconds.get(name, 0.0) + seconds
