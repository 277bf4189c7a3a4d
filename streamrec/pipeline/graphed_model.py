"""CUDA-graph replay of ``extend`` and ``rank`` for bucketed batch shapes.

Why: the eager step issues about a thousand kernel launches from Python (8 layers of
projections, norms, bias and the fused attention, for extend and again for rank). On the
H200 that is ~22 ms of CPU per step at any batch size, which left the worker's one Python
thread saturated at 2,000 events/s while the GPU idled (BENCHMARKS.md, issue 8 e). A
replayed graph costs one launch.

A graph has fixed shapes and fixed input addresses, so each call is padded up to a bucket
and copied into that bucket's static buffers:

- ``extend`` is bucketed on the token count T: the bucket of T tokens has T user rows.
  The real B users keep their rows; each padding token becomes a one-token padding user,
  the remaining padding users get no tokens. Padding users have no cached keys (length 0),
  so the fused kernels skip them, and their outputs are dropped.
- ``rank`` is bucketed on the user count B (candidates per user fixed at capture).
- Block tables are padded to the widest table a user of ``max_seq_len`` can have; the
  kernels never read past a user's length, so stale entries there are harmless.

``prefill`` and ``retrieve`` are called directly (variable history lengths; retrieve is a
handful of large kernels), and so is ``extend_scratch``: the generator captures whole
generation rounds around it (pipeline/generator.py). Calls that fit no bucket, or whose
pool tensors are not the ones captured, run directly too and are counted. Outputs are
copied out of the graph's static outputs before returning, so a later replay cannot
overwrite what a caller still holds.

Memory: every graph of a model allocates from one private pool, on one capture stream,
largest bucket first. A graph keeps its outputs; what a capture frees (activations,
workspaces: most of its peak) stays reserved in the pool for later captures, never for
anything else. The caching allocator gives a free block only to an allocation on the
block's stream that fits in it, so a fresh side stream per capture (before) left every
capture's transients unusable: the HSTU-8L worker's 70 captures ended with 40.39 GiB free
in its pool ("allocated in private pools" of the CUDA OOM message counts the free blocks)
on the H200, memory no other process on the GPU could have. On one stream, largest first,
each capture fits in what the larger ones freed: the pool holds about the largest
capture's peak plus every graph's outputs (``bench/graph_memory.py`` measures it).

Any backend works: eager ``HSTU`` and the AOTInductor runtime alike. A backend that
checks its inputs (``CheckedModel``: the AOTI one, whose package would otherwise read out
of bounds on a bad batch) has its value check run on the caller's tensors before each
replay, outside the capture, and the capture records its ``unchecked()`` twin, because the
check copies values to the host and a capture forbids that synchronisation. A backend
loaded without value checks (the worker's: its batches come from its own block pool) is
not checked per replay at all: a replay reads only the static buffers its capture was
validated on, the copies into them check the shapes, and the metadata checks cost
~70 µs of host time per step (CPU machine), on the critical path at small batches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast, runtime_checkable

import torch

from streamrec.cache.kv_cache import KVCache
from streamrec.errors import ConfigError, ModelError
from streamrec.pipeline.serving_model import GeneratingModel, ServingModel

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Below this size a bucket's padding is a few rows: powers of two suffice.
FINE_BUCKETS_FROM = 32


def bucket_ladder(limit: int, per_octave: int = 4) -> tuple[int, ...]:
    """Bucket sizes up to the first one >= ``limit``: powers of two to 32, then
    ``per_octave`` evenly spaced sizes per doubling (4: 40, 48, 56, 64, 80, ...).

    Why: a replay costs what its bucket costs, not what the batch holds, and large steps
    cost about linearly in their rows (H200, 8L: 4.7 ms at 64 users, 18.6 ms at 256). With
    powers of two a batch of 137 users ran as 256 (BENCHMARKS.md, issue 13: ~29 ms steps
    at 5,000 events/s); with 4 per octave it runs as 160, at most 25 % padding above 32.
    Each bucket is one more graph (captures ~20 ms each; static buffers in the shared pool).
    """
    if limit < 1 or per_octave < 1:
        raise ConfigError(
            f"bucket_ladder(limit={limit}, per_octave={per_octave}): both must be >= 1"
        )
    sizes = [1]
    while sizes[-1] < limit:
        last = sizes[-1]
        if last < FINE_BUCKETS_FROM or per_octave == 1:
            sizes.append(last * 2)
        else:
            octave = 1 << (last.bit_length() - 1)  # the power of two at or below ``last``
            sizes.append(last + max(1, octave // per_octave))
    return tuple(sizes)


Call = Callable[[], tuple[torch.Tensor, ...]]


@runtime_checkable
class CheckedModel(Protocol):
    """A ``ServingModel`` that validates its inputs with a host synchronisation."""

    check_values: bool  # False: only dtypes and shapes, which a replay needs no check of

    def check_extend(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        offsets: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> None: ...

    def check_rank(
        self,
        cand_items: torch.Tensor,
        query_ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> None: ...

    def unchecked(self) -> ServingModel:
        """The same entry points without any host synchronisation (capturable)."""
        ...


@dataclass(frozen=True)
class GraphConfig:
    """Bucket sizes (tokens for extend, users for rank) and the fixed table width."""

    max_blocks: int  # block-table width of every capture: ceil(max_seq_len / block_size)
    num_candidates: int  # C of every rank capture
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    capture: bool = True  # False: pad and run eagerly (the CPU tests of the padding)
    exclude_width: int = 16  # retrieve: the widest exclusion list a capture takes

    def __post_init__(self) -> None:
        if self.max_blocks < 1 or self.num_candidates < 1:
            raise ConfigError(
                f"max_blocks={self.max_blocks} and num_candidates={self.num_candidates} "
                "must be >= 1"
            )
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)):
            raise ConfigError(f"buckets={self.buckets} must be strictly increasing")
        if self.buckets[0] < 1:
            raise ConfigError(f"buckets={self.buckets} must be >= 1")


@dataclass
class GraphStats:
    """Counters the worker exports; ``eager_calls`` names calls that fit no graph."""

    captures: int = 0
    capture_s: float = 0.0
    replays: int = 0
    eager_calls: int = 0
    by_bucket: dict[str, int] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)  # buckets whose capture raised


@dataclass
class _Graph:
    inputs: tuple[torch.Tensor, ...]  # the static buffers the graph reads
    call: Call  # the eager call on those buffers
    outputs: tuple[torch.Tensor, ...] = ()  # the static tensors the graph writes
    graph: torch.cuda.CUDAGraph | None = None  # None: capture=False, ``call`` runs eagerly
    failed: bool = False  # the capture raised: this bucket's calls run eagerly, unpadded


class GraphedModel:
    """A ``ServingModel`` whose ``extend`` and ``rank`` replay captured CUDA graphs."""

    def __init__(
        self,
        model: ServingModel,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        config: GraphConfig,
    ) -> None:
        self.model = model
        # What the captures record: the backend without its host-side checks, which run
        # on the caller's tensors before each replay instead (value checks only).
        self._checks: CheckedModel | None = (
            model if isinstance(model, CheckedModel) and model.check_values else None
        )
        self._captured = model.unchecked() if isinstance(model, CheckedModel) else model
        self.config = config
        self._kv_pool = kv_pool  # [Lyr, 2, NB, BS, H, d]: captured by address
        self._ts_pool = ts_pool  # [NB, BS]
        self._device = kv_pool.device
        self._extend: dict[int, _Graph] = {}
        self._rank: dict[int, _Graph] = {}
        self._retrieve: dict[int, _Graph] = {}
        self._retrieve_shape: tuple[int, int, torch.dtype] | None = None  # k, D, dtype
        self._pool = torch.cuda.graph_pool_handle() if config.capture else None
        # Every warm-up and capture runs on this stream (made at the first capture): blocks
        # freed on it in one capture are reused by the next (module docstring, "Memory").
        self.capture_stream: torch.cuda.Stream | None = None
        self.stats = GraphStats()

    # ------------------------------------------------------------------ protocol

    def prefill(
        self, items: torch.Tensor, actions: torch.Tensor, ts: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.model.prefill(items, actions, ts, offsets)

    def retrieve(
        self, user_emb: torch.Tensor, k: int, exclude: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucketed on the user count like rank: padding users repeat the first user's
        embedding and exclude nothing; their rows are dropped. The fused top-k compiles a
        kernel per tile shape, and a capture (at start, ``warm_up``) pays that once.

        Why not zeros: every item scores exactly 0 for a zero row, so the fused op's
        threshold lets all of them through until each item chunk's region is compacted,
        and its merge walks ~34,000 candidates instead of ~4,500 (H200, AOTI worker at
        2,000 events/s, ~36 users in a 40-user bucket: select 0.56 ms and merge 0.53 ms
        per call, against 0.33 and 0.10 for 40 real users)."""
        num_users, width = user_emb.shape[0], exclude.shape[1]
        bucket = self._bucket(num_users)
        shape = (k, user_emb.shape[1], user_emb.dtype)
        if (
            bucket is None
            or width > self.config.exclude_width
            or (self._retrieve_shape is not None and shape != self._retrieve_shape)
        ):
            self.stats.eager_calls += 1
            return self.model.retrieve(user_emb, k, exclude)
        entry = self._retrieve.get(bucket) or self._capture_retrieve(bucket, *shape)
        if entry.failed:
            self.stats.eager_calls += 1
            return self.model.retrieve(user_emb, k, exclude)
        s_emb, s_exclude = entry.inputs
        s_emb[:num_users].copy_(user_emb)
        if num_users < bucket:
            s_emb[num_users:].copy_(user_emb[:1].expand(bucket - num_users, -1))
        s_exclude.fill_(-1)
        s_exclude[:num_users, :width].copy_(exclude)
        scores, items = self._run(entry, f"retrieve/{bucket}")
        return scores[:num_users].clone(), items[:num_users].clone()

    def extend_scratch(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
        scratch_kv: torch.Tensor,
        scratch_ts: torch.Tensor,
        scratch_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not hasattr(self.model, "extend_scratch"):
            raise ModelError(
                f"{type(self.model).__name__} has no extend_scratch: it cannot generate"
            )
        return cast(GeneratingModel, self.model).extend_scratch(
            items, actions, ts, kv_pool, ts_pool, block_tables, cached_lens, scratch_kv,
            scratch_ts, scratch_lens,
        )  # fmt: skip

    def extend(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        offsets: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens, num_users = items.shape[0], offsets.shape[0] - 1
        bucket = self._bucket(max(num_tokens, num_users))  # users without new tokens too
        if bucket == num_users and num_tokens < num_users:
            bucket = self._bucket(num_users + 1)  # a padding user must own the padding tokens
        if bucket is None or not self._fits(kv_pool, ts_pool, block_tables):
            self.stats.eager_calls += 1
            return self.model.extend(
                items, actions, ts, offsets, kv_pool, ts_pool, block_tables, cached_lens
            )
        if self._checks is not None:
            self._checks.check_extend(
                items, actions, ts, offsets, kv_pool, ts_pool, block_tables, cached_lens
            )
        entry = self._extend.get(bucket) or self._capture_extend(bucket)
        if entry.failed:
            self.stats.eager_calls += 1
            return self.model.extend(
                items, actions, ts, offsets, kv_pool, ts_pool, block_tables, cached_lens
            )
        s_items, s_actions, s_ts, s_offsets, s_tables, s_lens = entry.inputs
        pad = bucket - num_tokens
        for static, real in ((s_items, items), (s_actions, actions), (s_ts, ts)):
            static[:num_tokens].copy_(real)
            static[num_tokens:].zero_()  # padding tokens see only themselves: any value
        s_offsets[: num_users + 1].copy_(offsets)
        # padding user j (rows B..bucket-1) owns token T + j while padding tokens last, the
        # last one whatever is left: every token belongs to a user (the kernels and the
        # per-user new-token attention index by user), none to a real one
        tail = torch.arange(1, bucket - num_users + 1, device=self._device).clamp(max=pad)
        s_offsets[num_users + 1 :].copy_(num_tokens + tail)
        s_offsets[-1] = bucket
        s_tables[:num_users, : block_tables.shape[1]].copy_(block_tables)
        s_lens[:num_users].copy_(cached_lens)
        s_lens[num_users:].zero_()
        k, v, emb = self._run(entry, f"extend/{bucket}")
        return k[:, :num_tokens].clone(), v[:, :num_tokens].clone(), emb[:num_users].clone()

    def rank(
        self,
        cand_items: torch.Tensor,
        query_ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> torch.Tensor:
        num_users, num_cands = cand_items.shape
        bucket = self._bucket(num_users)
        if (
            bucket is None
            or num_cands != self.config.num_candidates
            or not self._fits(kv_pool, ts_pool, block_tables)
        ):
            self.stats.eager_calls += 1
            return self.model.rank(
                cand_items, query_ts, kv_pool, ts_pool, block_tables, cached_lens
            )
        if self._checks is not None:
            self._checks.check_rank(
                cand_items, query_ts, kv_pool, ts_pool, block_tables, cached_lens
            )
        entry = self._rank.get(bucket) or self._capture_rank(bucket)
        if entry.failed:
            self.stats.eager_calls += 1
            return self.model.rank(
                cand_items, query_ts, kv_pool, ts_pool, block_tables, cached_lens
            )
        s_cand, s_ts, s_tables, s_lens = entry.inputs
        s_cand[:num_users].copy_(cand_items)
        s_ts[:num_users].copy_(query_ts)
        s_tables[:num_users, : block_tables.shape[1]].copy_(block_tables)
        s_lens[:num_users].copy_(cached_lens)
        s_lens[num_users:].zero_()
        (probs,) = self._run(entry, f"rank/{bucket}")
        return probs[:num_users].clone()

    # ------------------------------------------------------------------ graphs

    def warm_up(
        self,
        extend: Sequence[int] | None = None,
        rank: Sequence[int] | None = None,
        retrieve: tuple[Sequence[int], int, int, torch.dtype] | None = None,
    ) -> None:
        """Capture these buckets now (start-up) instead of on the first call of each, in
        ``capture_plan`` order; ``None`` means every configured bucket (retrieve: none
        unless given as ``(buckets, k, D, dtype)``)."""
        buckets, shape = ((), None) if retrieve is None else (retrieve[0], retrieve[1:])
        for entry, bucket in self.capture_plan(extend, rank, buckets):
            self.capture(entry, bucket, shape)

    def capture_plan(
        self,
        extend: Sequence[int] | None = None,
        rank: Sequence[int] | None = None,
        retrieve: Sequence[int] = (),
    ) -> list[tuple[str, int]]:
        """(entry point, bucket) in capture order: retrieve, rank, extend, each largest
        bucket first (``None``: every configured bucket).

        Why: a capture reuses the pool's free blocks only where one is at least as large as
        what it allocates, so the largest capture goes first and the others fit in what it
        freed. Retrieve first: the AOTI package normalises the whole item table per call
        (1M x 512 bf16: ~1 GB, the largest single transient); rank's largest activations
        (~0.6 GB at 256 users x 256 candidates, 8L) come next, extend's (~0.2 GB) last.
        """
        ext = self.config.buckets if extend is None else extend
        users = self.config.buckets if rank is None else rank
        return [
            (entry, bucket)
            for entry, buckets in (("retrieve", retrieve), ("rank", users), ("extend", ext))
            for bucket in sorted(set(buckets), reverse=True)
        ]

    def capture(
        self, entry: str, bucket: int, retrieve_shape: tuple[int, int, torch.dtype] | None = None
    ) -> None:
        """Capture ``entry``'s (extend, rank or retrieve) ``bucket`` now unless it has been;
        retrieve needs its ``(k, D, dtype)``."""
        if entry == "extend" and bucket not in self._extend:
            self._capture_extend(bucket)
        elif entry == "rank" and bucket not in self._rank:
            self._capture_rank(bucket)
        elif entry == "retrieve" and bucket not in self._retrieve:
            if retrieve_shape is None:
                raise ConfigError("capture('retrieve', ...) needs retrieve_shape=(k, D, dtype)")
            self._capture_retrieve(bucket, *retrieve_shape)
        elif entry not in ("extend", "rank", "retrieve"):
            raise ConfigError(f"capture: unknown entry point {entry!r}")

    def _bucket(self, n: int) -> int | None:
        for bucket in self.config.buckets:
            if n <= bucket:
                return bucket
        return None

    def _fits(self, kv_pool: torch.Tensor, ts_pool: torch.Tensor, tables: torch.Tensor) -> bool:
        return (
            kv_pool.data_ptr() == self._kv_pool.data_ptr()
            and ts_pool.data_ptr() == self._ts_pool.data_ptr()
            and tables.shape[1] <= self.config.max_blocks
        )

    def _buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed block tables [rows, max_blocks] and lengths [rows]: all padding."""
        tables = torch.zeros(
            rows, self.config.max_blocks, dtype=torch.int32, device=self._device
        )  # [R, MB]
        return tables, torch.zeros(rows, dtype=torch.int64, device=self._device)  # [R]

    def _capture_extend(self, bucket: int) -> _Graph:
        def zeros() -> torch.Tensor:
            return torch.zeros(bucket, dtype=torch.int64, device=self._device)  # [T]

        offsets = torch.arange(bucket + 1, dtype=torch.int64, device=self._device)  # [T+1]
        tables, lens = self._buffers(bucket)
        inputs = (zeros(), zeros(), zeros(), offsets, tables, lens)

        def call() -> tuple[torch.Tensor, ...]:
            items, actions, ts, offs, tbl, lns = inputs
            return self._captured.extend(
                items, actions, ts, offs, self._kv_pool, self._ts_pool, tbl, lns
            )

        entry = self._capture(call, inputs, f"extend/{bucket}")
        self._extend[bucket] = entry
        return entry

    def _capture_retrieve(self, bucket: int, k: int, dim: int, dtype: torch.dtype) -> _Graph:
        self._retrieve_shape = (k, dim, dtype)
        emb = torch.zeros(bucket, dim, dtype=dtype, device=self._device)  # [B, D]
        exclude = torch.full(
            (bucket, self.config.exclude_width), -1, dtype=torch.int64, device=self._device
        )  # [B, E]
        inputs = (emb, exclude)

        def call() -> tuple[torch.Tensor, ...]:
            return self._captured.retrieve(emb, k, exclude)

        entry = self._capture(call, inputs, f"retrieve/{bucket}")
        self._retrieve[bucket] = entry
        return entry

    def _capture_rank(self, bucket: int) -> _Graph:
        cand = torch.zeros(
            bucket, self.config.num_candidates, dtype=torch.int64, device=self._device
        )  # [B, C]
        ts = torch.zeros(bucket, dtype=torch.int64, device=self._device)  # [B]
        tables, lens = self._buffers(bucket)
        inputs = (cand, ts, tables, lens)

        def call() -> tuple[torch.Tensor, ...]:
            return (self._captured.rank(cand, ts, self._kv_pool, self._ts_pool, tables, lens),)

        entry = self._capture(call, inputs, f"rank/{bucket}")
        self._rank[bucket] = entry
        return entry

    def _capture(self, call: Call, inputs: tuple[torch.Tensor, ...], name: str) -> _Graph:
        if not self.config.capture:
            return _Graph(inputs=inputs, call=call)
        start = time.perf_counter()
        try:
            outputs, graph = self._record(call)
        except RuntimeError as exc:  # out of memory, or an op that cannot be captured
            log.warning(
                "CUDA graph capture failed: this bucket runs eagerly",
                extra={"graph": name, "error": repr(exc)[:300]},
            )
            self.stats.failed.append(name)
            self.capture_stream = None  # the next capture starts on a clean stream
            return _Graph(inputs=inputs, call=call, failed=True)
        seconds = time.perf_counter() - start
        self.stats.captures += 1
        self.stats.capture_s += seconds
        log.info("captured CUDA graph", extra={"graph": name, "seconds": round(seconds, 3)})
        return _Graph(inputs=inputs, call=call, outputs=outputs, graph=graph)

    def _record(self, call: Call) -> tuple[tuple[torch.Tensor, ...], torch.cuda.CUDAGraph]:
        """Warm up and capture on the side stream every capture shares (an AOTI runner
        captured on another stream than it warmed up on is untested; this order is the one
        seen to work). One stream for all: the pool reuses blocks only on their stream."""
        if self.capture_stream is None:
            self.capture_stream = torch.cuda.Stream(self._device)
        side = self.capture_stream
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(2):  # compiles the Triton kernels, lets cuBLAS pick its kernels
                call()
        graph = torch.cuda.CUDAGraph()
        with (
            torch.no_grad(),
            torch.cuda.graph(
                graph, pool=self._pool, stream=side, capture_error_mode="thread_local"
            ),
        ):
            outputs = call()
        torch.cuda.current_stream(self._device).wait_stream(side)
        return outputs, graph

    def _run(self, entry: _Graph, name: str) -> tuple[torch.Tensor, ...]:
        self.stats.by_bucket[name] = self.stats.by_bucket.get(name, 0) + 1
        if entry.graph is None:
            with torch.no_grad():
                return entry.call()
        entry.graph.replay()
        self.stats.replays += 1
        return entry.outputs


def capture_serving_graphs(
    model: ServingModel,
    cache: KVCache,
    max_seq_len: int,
    max_tokens: int,
    max_users: int,
    num_candidates: int,
    retrieve: tuple[int, int, torch.dtype] | None = None,
    per_octave: int = 4,
) -> GraphedModel:
    """``model`` with extend and rank captured now, so no step pays for a capture.

    Buckets follow ``bucket_ladder``: extend up to ``max_tokens`` new tokens (a step can
    carry several events per user), rank and retrieve up to the bucket holding
    ``max_users`` (the batcher's ``max_batch_users``), only when candidates are ranked.
    """
    buckets = tuple(b for b in bucket_ladder(max_tokens, per_octave) if b <= max_tokens)
    users = list(bucket_ladder(max_users, per_octave))
    rank = users if num_candidates else []
    config = GraphConfig(
        max_blocks=-(-max_seq_len // cache.config.block_size) + 1,
        num_candidates=max(1, num_candidates),
        buckets=buckets,
    )
    graphed = GraphedModel(model, cache.kv, cache.ts, config)
    graphed.warm_up(
        extend=buckets, rank=rank, retrieve=None if retrieve is None else (users, *retrieve)
    )
    log.info(
        "CUDA graphs captured",
        extra={"graphs": graphed.stats.captures, "seconds": round(graphed.stats.capture_s, 1)},
    )
    return graphed
