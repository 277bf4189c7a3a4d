"""One engine step on the device: admit the batch into the KV tiers, encode, score.

This is the only place that turns per-user deltas into tensors. It runs on the engine's
own thread (never the event loop) and touches the cache metadata and tensors, so the
engine calls it for one batch at a time. Cache capacity is a return value all the way
down: when the pool cannot hold the whole batch even after evicting every unpinned user,
the step splits the batch and runs the halves one after the other.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from streamrec.cache.block_pool import NoRoom
from streamrec.cache.history_store import History
from streamrec.cache.kv_cache import to_device
from streamrec.cache.kv_tiers import Admission, CacheOutcome, KVTiers
from streamrec.errors import PipelineError
from streamrec.pipeline.item_catalog import ItemCatalog
from streamrec.pipeline.phase_timer import PhaseTimer
from streamrec.pipeline.scorer import ScoredUsers, Scorer
from streamrec.pipeline.serving_model import ServingModel
from streamrec.pipeline.step_generation import StepGeneration

# The most tokens one jagged prefill call takes by default (its activations grow with
# them; ``model.prefill_call_tokens`` sets it per worker). 65,536 against 32,768: warm-up
# of 2,000 skewed users by three AOTI workers 2,124 against 1,876 users/s from the first
# to the last completion (H100, 2026-12-06); model alone 1,902 against 1,777 (H200).
PREFILL_CALL_TOKENS = 65_536

IntArray = np.ndarray


@dataclass(frozen=True)
class UserWork:
    """What one user brings to a step.

    ``tokens`` are ``[n, 3]`` rows of ``(item_row, action, ts_ms)``. With ``prefill`` set
    they are the user's whole (window-capped) history and the cache entry is rebuilt from
    them; otherwise they are only the new tokens and are appended to a cached entry.
    ``recent`` are the item rows the retrieval must not return (newest last).
    """

    user_id: str
    tokens: IntArray  # [n, 3] int64
    prefill: bool
    recent: IntArray  # [E] int64
    version: int  # tokens ever appended for the user, this step's included

    @classmethod
    def from_history(
        cls, user_id: str, history: History, exclude_recent: int, num_rows: int | None = None
    ) -> UserWork:
        """A rebuild of the user's cache from its stored window (engine and reference).

        With ``num_rows`` (the served vocabulary's size) a stored item row outside the
        embedding table is a ``PipelineError`` naming the user, here on the host: on the
        GPU it would be a device-side assert that ends the process's CUDA context."""
        if num_rows is not None and len(history.items):
            low, high = int(history.items.min()), int(history.items.max())
            if low < 0 or high >= num_rows:
                bad = high if high >= num_rows else low
                raise PipelineError(
                    f"user {user_id!r}: the history store holds item row {bad}, outside "
                    f"the model's {num_rows} rows: it was written under another vocabulary "
                    "(clear the store, or keep the vocabulary's rows when retraining)"
                )
        tokens = np.stack([history.items, history.actions, history.ts], axis=1)  # [L, 3]
        keep = exclude_recent
        recent = history.items[-keep:].copy() if keep else np.zeros(0, dtype=np.int64)
        return cls(user_id, tokens.astype(np.int64), True, recent, history.total_appended)


@dataclass(frozen=True)
class UserOutput:
    user_id: str
    version: int
    outcome: CacheOutcome
    items: IntArray  # [top_k] item rows, best first
    scores: IntArray  # [top_k] float
    task_scores: IntArray | None  # [top_k, tasks] or None without ranking
    generated: IntArray | None = None  # [k] generated item rows, in order (generation on)
    generated_scores: IntArray | None = None  # [k] float


@dataclass
class StepTimings:
    """Seconds per phase, summed over the sub-steps of a split batch; ``wall`` is the
    engine thread's time for the whole step (the engine's busy time)."""

    wall: float = 0.0
    admit: float = 0.0
    prefill: float = 0.0
    extend: float = 0.0
    retrieve: float = 0.0
    rank: float = 0.0
    generate: float = 0.0
    splits: int = 0
    tokens_prefilled: int = 0
    tokens_extended: int = 0
    evicted: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    # Incremental users whose cache vanished before their turn (a split batch's earlier
    # half evicted them past the host tier): the engine rebuilds them from the store.
    lost: list[str] = field(default_factory=list)

    def merge(self, other: StepTimings) -> None:
        phases = ("wall", "admit", "prefill", "extend", "retrieve", "rank", "generate")
        for name in (*phases, "splits"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.tokens_prefilled += other.tokens_prefilled
        self.tokens_extended += other.tokens_extended
        self.evicted += other.evicted
        self.dropped += other.dropped

    def as_ms(self) -> dict[str, float]:
        return {
            name: round(getattr(self, name) * 1000.0, 3)
            for name in ("admit", "prefill", "extend", "retrieve", "rank", "generate")
            if name != "generate" or self.generate
        }


class ModelStep:
    """Runs ``prefill`` for rebuilt users and one jagged ``extend`` for the rest (then,
    with ``generation``, the users' next-k items)."""

    def __init__(
        self,
        model: ServingModel,
        tiers: KVTiers,
        scorer: Scorer,
        device: torch.device,
        catalog: ItemCatalog | None = None,
        generation: StepGeneration | None = None,
        jagged_prefill: bool = False,
        prefill_call_tokens: int = PREFILL_CALL_TOKENS,
    ) -> None:
        self.model = model
        self.tiers = tiers
        self.scorer = scorer
        self.device = device
        self.catalog = catalog  # set: item rows become embedding-cache slots per call
        self.generation = generation
        self.jagged_prefill = jagged_prefill  # one prefill call, not one per length class
        self.prefill_call_tokens = prefill_call_tokens

    def run(self, work: Sequence[UserWork]) -> tuple[list[UserOutput], StepTimings]:
        timings = StepTimings()
        start = time.perf_counter()
        outputs = self._run(list(work), timings)
        timings.wall = time.perf_counter() - start
        return outputs, timings

    def _run(self, work: list[UserWork], timings: StepTimings) -> list[UserOutput]:
        if not work:
            return []
        start = time.perf_counter()
        rebuild = [w.user_id for w in work if w.prefill]
        self.tiers.drop(rebuild)  # a stale entry must not survive a rebuild
        where = self.tiers.settle(w.user_id for w in work if not w.prefill)  # disk: verified
        lost = {user for user, outcome in where.items() if outcome is CacheOutcome.MISS}
        if lost:
            timings.lost.extend(sorted(lost))
            work = [w for w in work if w.user_id not in lost]
            if not work:
                return []
        demands = {w.user_id: int(w.tokens.shape[0]) for w in work}
        admission = self.tiers.ensure_room(demands)
        timings.admit += time.perf_counter() - start
        if isinstance(admission, NoRoom):
            if len(work) == 1:
                raise PipelineError(
                    f"user {work[0].user_id!r} needs {admission.needed} KV blocks but the "
                    f"pool has {self.tiers.cache.num_blocks} in all: raise the KV budget or "
                    "lower max_seq_len"
                )
            timings.splits += 1
            half = len(work) // 2
            return self._run(work[:half], timings) + self._run(work[half:], timings)
        try:
            return self._admitted(work, admission, timings)
        finally:
            self.tiers.unpin(demands)

    def _admitted(
        self, work: list[UserWork], admission: Admission, timings: StepTimings
    ) -> list[UserOutput]:
        timings.evicted.extend(str(u) for u in admission.evicted)
        timings.dropped.extend(str(u) for u in admission.dropped)
        fresh = [w for w in work if admission.outcomes[w.user_id] is CacheOutcome.MISS]
        cached = [w for w in work if admission.outcomes[w.user_id] is not CacheOutcome.MISS]
        # User embeddings in the order the calls made them; one reorder to ``work``'s at
        # the end (a torch op per user would release and retake the GIL per user).
        parts: list[torch.Tensor] = []  # [b, D] each
        made: list[str] = []
        phases = PhaseTimer(self.device)
        if fresh:
            for group, group_emb in self._prefill(fresh):
                parts.append(group_emb)
                made.extend(w.user_id for w in group)
            timings.tokens_prefilled += sum(int(w.tokens.shape[0]) for w in fresh)
        phases.mark("prefill")
        if cached:
            parts.append(self._extend(cached))
            made.extend(w.user_id for w in cached)
            timings.tokens_extended += sum(int(w.tokens.shape[0]) for w in cached)
        phases.mark("extend")
        users = [w.user_id for w in work]
        user_emb = self._in_order(parts, made, users)  # [B, D]
        scored: ScoredUsers = self.scorer.score(
            user_emb,
            [w.recent for w in work],
            [int(w.tokens[-1, 2]) for w in work],
            users,
            phases.mark,
        )
        generated = None
        if self.generation is not None:
            self.generation.forget(str(u) for u in admission.dropped)
            generated = self.generation.run(work, user_emb)
            phases.mark("generate")
        for name, seconds in phases.seconds().items():
            setattr(timings, name, getattr(timings, name) + seconds)
        return [
            UserOutput(
                user_id=w.user_id,
                version=w.version,
                outcome=admission.outcomes[w.user_id],
                items=scored.items[row],
                scores=scored.scores[row],
                task_scores=None if scored.task_scores is None else scored.task_scores[row],
                generated=None if generated is None else generated.items[row],
                generated_scores=None if generated is None else generated.scores[row],
            )
            for row, w in enumerate(work)
        ]

    def _jagged(self, work: list[UserWork]) -> tuple[torch.Tensor, ...]:
        tokens = np.concatenate([w.tokens for w in work])  # [T, 3], a fresh array
        if self.catalog is not None:
            tokens[:, 0] = self.catalog.slots(tokens[:, 0])
        lengths = np.fromiter((w.tokens.shape[0] for w in work), np.int64, len(work))
        offsets = np.zeros(len(work) + 1, dtype=np.int64)  # [B+1]
        np.cumsum(lengths, out=offsets[1:])
        n = tokens.shape[0]
        # Rows of an even width start 16-byte aligned: an AOTI package compiled for aligned
        # inputs copies a misaligned one (a warning and a copy per call, H200).
        rows = np.zeros((3, n + (n & 1)), dtype=np.int64)  # [3, T (+1)]
        rows[:, :n] = tokens.T
        t = to_device(rows, self.device)
        return t[0, :n], t[1, :n], t[2, :n], to_device(offsets, self.device)

    def _write(
        self, work: list[UserWork], k: torch.Tensor, v: torch.Tensor, ts: torch.Tensor
    ) -> None:
        slots = np.concatenate(
            [
                np.asarray(self.tiers.append(w.user_id, int(w.tokens.shape[0])), np.int64)
                for w in work
            ]
        )  # [T]
        self.tiers.cache.write(slots, k, v, ts)

    def warm_up_prefill(self, max_seq_len: int, item_row: int) -> int:
        """One jagged prefill call of ``prefill_call_tokens`` synthetic tokens, outputs
        dropped, cache untouched; returns the tokens (0: the prefill is not jagged).

        Why: the first prefill of a process otherwise pays, inside the first batch of
        cache misses, what only a first call pays: module loads of the package's kernels
        (CUDA loads them lazily), the Triton kernels' compiles on the eager backend, and
        the caching allocator's growth to a full call's activations on the engine's stream.
        A call of the largest size leaves that memory reserved for the calls that follow.
        """
        if not self.jagged_prefill:
            return 0
        total = self.prefill_call_tokens
        lengths = [max_seq_len] * (total // max_seq_len) + [total % max_seq_len]
        empty = np.zeros(0, dtype=np.int64)
        work = []
        for i, n in enumerate(x for x in lengths if x):
            tokens = np.zeros((n, 3), dtype=np.int64)  # [n, 3] (item_row, action, ts_ms)
            tokens[:, 0] = item_row
            tokens[:, 2] = 1_600_000_000_000 + 60_000 * np.arange(n)  # one a minute, 2020
            work.append(UserWork(f"warm-up {i}", tokens, True, empty, n))
        self.model.prefill(*self._jagged(work))
        return total

    def _prefill(self, work: list[UserWork]) -> list[tuple[list[UserWork], torch.Tensor]]:
        """One prefill per group of similar history lengths (power-of-two classes), or one
        for all when the model's prefill is jagged: each group with its user embeddings
        ``[b, D]``.

        A dense prefill pads every row to the longest history of its call, and its cost
        grows with the square of that width: grouping keeps a few long users from making
        every short one pay for their length. A jagged prefill pads nothing, so groups
        only add calls and partial last tiles (H100, HSTU-8L, 256 skewed users: one call
        1,762 users/s, grouped 1,481); its calls are cut at ``prefill_call_tokens`` only
        so that a call's activations stay as small as the largest length class's were (one
        call of ~120k tokens per worker ran three H100 workers out of memory; the cut at
        65,536 costs 7 % against one call, 32,768 costs 12 %: H200, BENCHMARKS.md).
        """
        groups: dict[int, list[UserWork]] = {}
        chunk, chunk_tokens = 0, 0
        for w in work:
            n = int(w.tokens.shape[0])
            if self.jagged_prefill:  # consecutive users, at most prefill_call_tokens a call
                if chunk_tokens and chunk_tokens + n > self.prefill_call_tokens:
                    chunk, chunk_tokens = chunk + 1, 0
                chunk_tokens += n
                groups.setdefault(chunk, []).append(w)
            else:
                groups.setdefault(max(64, n - 1).bit_length(), []).append(w)
        out: list[tuple[list[UserWork], torch.Tensor]] = []
        for _, group in sorted(groups.items()):
            items, actions, ts, offsets = self._jagged(group)
            k, v, user_emb = self.model.prefill(items, actions, ts, offsets)  # [Lyr,T,H,d]
            self._write(group, k, v, ts)
            out.append((group, user_emb[: len(group)]))
        return out

    def _extend(self, work: list[UserWork]) -> torch.Tensor:
        """The user embeddings ``[B, D]`` of ``work``, in its order."""
        items, actions, ts, offsets = self._jagged(work)
        cache = self.tiers.cache
        tables, lens = cache.batch_tables([w.user_id for w in work])  # [B, MB], [B]
        k, v, user_emb = self.model.extend(
            items, actions, ts, offsets, cache.kv, cache.ts, tables, lens
        )
        self._write(work, k, v, ts)
        return user_emb[: len(work)]

    def _in_order(
        self, parts: list[torch.Tensor], made: list[str], users: list[str]
    ) -> torch.Tensor:
        """Rows of ``parts`` (users ``made``, in that order) as ``users`` orders them."""
        emb = parts[0] if len(parts) == 1 else torch.cat(parts)  # [B, D]
        if made == users:
            return emb
        row = {user: i for i, user in enumerate(made)}
        order = np.fromiter((row[u] for u in users), np.int64, len(users))  # [B]
        return emb.index_select(0, to_device(order, emb.device))
