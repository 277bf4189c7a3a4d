"""Next-k generation after a step: plain autoregressive, or speculative with a draft model.

After a user's step the target's user embedding predicts the first generated item; each
item is then fed back as a token (next position, ``time_step_ms`` later, action
``action``) to predict the next, k in all. The generated tokens' K/V go to scratch
buffers (``Workspace``), never to the user's cache or history, through
``extend_scratch`` (docs/contracts.md): every model call is a ``GeneratingModel`` entry
point, so eager, AOTI and graph-wrapped models all serve.

With a draft model each round runs the draft γ times (one item each) and the target once
over γ + 1 positions, keeping the longest prefix the target agrees with plus one item of
the target's own (``sampling``): the output is the target's, in fewer target calls. The
draft is a smaller HSTU with no KV cache of its own: at the first round it encodes the
user's last ``window`` tokens (``DraftContext``) into its scratch, so it costs one
window-long call per step whatever the history length.

Rows are the batch's users, padded to a power of two when rounds replay as CUDA graphs
(greedy, CUDA, ``capture``): the padding rows have no cached keys and start finished.
A speculative batch whose live rows fit in half of its rows moves them into the workspace
of a smaller power of two (``_compact``); the draft may propose from a catalog of items
rather than all (``DraftCatalog``). Neither changes a greedy output.
Sampling runs eagerly (its random draws come from one seeded ``torch.Generator``; after a
compaction they come in the smaller shape, equally distributed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from streamrec.errors import ConfigError, PipelineError
from streamrec.pipeline.draft_catalog import DraftCatalog
from streamrec.pipeline.generation_config import GenerationConfig
from streamrec.pipeline.generation_workspace import ModelGeometry, Workspace, write_scratch
from streamrec.pipeline.sampling import (
    candidate_probs,
    draw,
    greedy_accept,
    prob_of,
    speculative_accept,
)
from streamrec.pipeline.serving_model import GeneratingModel

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# (user_emb [R, D], k, exclude [R, E]) -> (scores, item rows) [R, k]
Retrieve = Callable[[torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class GenModel:
    """A model the generator drives, with the geometry its buffers need."""

    model: GeneratingModel
    geometry: ModelGeometry


@dataclass
class GenerationStats:
    """Cumulative counters; the worker turns them into metrics."""

    users: int = 0
    tokens: int = 0  # generated items handed out (k per user)
    rounds: int = 0  # speculative rounds (or autoregressive steps)
    target_calls: int = 0
    draft_calls: int = 0
    proposed: int = 0  # draft items proposed to rows still generating
    accepted: int = 0  # of those, kept by the target
    compactions: int = 0  # live rows moved into a smaller workspace (Generator._compact)
    # Rows the rounds after the first item ran over (padding and finished rows included):
    # a cost measure that compaction lowers and the count of rounds does not show.
    row_rounds: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass(frozen=True)
class GenerationInputs:
    """One batch's users right after their step (the cache holds the step's tokens).

    ``window``/``window_lens``: each user's last tokens for the draft ([B, W, 3] rows of
    ``(item, action, ts)``, right-padded; see ``DraftContext.batch``).
    """

    user_emb: torch.Tensor  # [B, D] the target's output at the newest token
    block_tables: torch.Tensor  # [B, MB] int32
    cached_lens: torch.Tensor  # [B] int64
    last_ts: torch.Tensor  # [B] int64, the newest event's timestamp
    consumed: torch.Tensor  # [B, E] int64 item rows never to generate, -1 = none
    window: torch.Tensor | None = None  # [B, W, 3] int64
    window_lens: torch.Tensor | None = None  # [B] int64


def consumed_rows(items: Sequence[np.ndarray]) -> np.ndarray:
    """Each row's item rows never to generate, right-padded with -1: ``consumed`` [B, E]
    of ``GenerationInputs`` (at least one column)."""
    width = max(1, max((len(i) for i in items), default=0))
    out = np.full((len(items), width), -1, dtype=np.int64)
    for row, rows in enumerate(items):
        out[row, : len(rows)] = rows
    return out


@dataclass(frozen=True)
class Generated:
    items: np.ndarray  # [B, k] int64 item rows, in generation order
    scores: np.ndarray  # [B, k] float32: the target's retrieval score of each


class Generator:
    """Generates k items per user over a target's paged cache (and a draft, if given)."""

    def __init__(
        self,
        target: GenModel,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        config: GenerationConfig,
        draft: GenModel | None = None,
        *,
        capture: bool = False,
        max_rows: int = ROW_BUCKETS[-1],
        max_blocks: int = 1,
        max_consumed: int = 1,
        compact: bool = True,
        draft_catalog: DraftCatalog | None = None,
    ) -> None:
        if config.k < 1:
            raise ConfigError(f"k = {config.k}: a Generator needs k >= 1")
        self.target, self.draft, self.config = target, draft, config
        self.kv_pool, self.ts_pool = kv_pool, ts_pool
        self.device = kv_pool.device
        self.max_rows = max_rows
        # Narrower block tables and exclusion lists are padded to these widths, so one
        # workspace (and one set of graphs) per row count serves every batch.
        self.max_blocks, self.max_consumed = max_blocks, max_consumed
        self.compact = compact  # speculative rows that finish leave the batch
        self.draft_catalog = draft_catalog  # the draft proposes among these items only
        if draft_catalog is not None and (draft is None or draft_catalog.size < config.candidates):
            raise ConfigError(
                f"draft catalog of {draft_catalog.size} items: needs a draft and at least "
                f"{config.candidates} items (the candidates per position)"
            )
        t_cfg = target.geometry.config
        self.window = 0
        if draft is not None:
            d_cfg = draft.geometry.config
            if d_cfg.num_items != t_cfg.num_items:
                raise ConfigError(
                    f"draft has {d_cfg.num_items} item rows, the target {t_cfg.num_items}"
                )
            # Every draft position a live row reaches stays below the draft's max_seq_len.
            self.window = d_cfg.max_seq_len - config.k - config.gamma - 1
            if self.window < 1:
                raise ConfigError(
                    f"draft max_seq_len = {d_cfg.max_seq_len}: leaves no history window for "
                    f"k = {config.k} + gamma = {config.gamma} generated positions"
                )
        self.capture = capture and self.device.type == "cuda" and config.greedy
        self._rng = torch.Generator(device=self.device).manual_seed(config.seed)
        self._spaces: dict[tuple[int, int, int], Workspace] = {}
        self._graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.stats = GenerationStats()

    @property
    def speculative(self) -> bool:
        return self.draft is not None

    # ------------------------------------------------------------------ public API

    def generate(self, inputs: GenerationInputs) -> Generated:
        """k items per user; one host sync per speculative round (the stop test)."""
        users = inputs.user_emb.shape[0]
        if users == 0:
            k = self.config.k
            return Generated(np.zeros((0, k), np.int64), np.zeros((0, k), np.float32))
        if self.speculative and (inputs.window is None or inputs.window_lens is None):
            raise PipelineError("speculative generation needs each user's draft window")
        parts = [self._generate(_rows(inputs, lo, lo + self.max_rows))
                 for lo in range(0, users, self.max_rows)]  # fmt: skip
        return Generated(
            items=np.concatenate([p.items for p in parts]),
            scores=np.concatenate([p.scores for p in parts]),
        )

    # ------------------------------------------------------------------ one chunk

    def _generate(self, inputs: GenerationInputs) -> Generated:
        users = inputs.user_emb.shape[0]
        rows = _bucket(users) if self.capture else users
        ws = self._inputs_workspace(rows, inputs)
        self._load(ws, inputs, users)
        self._run("first", ws, self._first)
        self.stats.target_calls += 1
        if self.speculative:
            self._speculate(ws)
        else:
            for _ in range(self.config.k - 1):
                self._run("step", ws, self._ar_step)
            self.stats.rounds += self.config.k - 1
            self.stats.target_calls += self.config.k - 1
            self.stats.row_rounds += ws.rows * (self.config.k - 1)
        k = self.config.k
        self.stats.users += users
        self.stats.tokens += users * k
        return Generated(  # copies: the workspace is reused by the next call
            items=ws.gen[:users, :k].to("cpu", copy=True).numpy(),
            scores=ws.gen_scores[:users, :k].to("cpu", copy=True).numpy(),
        )

    def _speculate(self, home: Workspace) -> None:
        """Rounds until every row has k items. Batches move their live rows into a
        smaller workspace once they fit in half of it (``_compact``): a batch runs as many
        rounds as its slowest row, and the rows that finished early would otherwise cost
        every later round as much as the live ones."""
        home.proposed.zero_()
        home.accepted.zero_()
        ws, index = home, None  # index: the home row of each of ws's rows (None: the same)
        for round_no in range(self.config.k - 1):  # every round emits >= 1 item per row
            if round_no:
                live = int(ws.live().sum())  # the round's one host sync
                if not live:
                    break
                if self.compact and _bucket(live) <= ws.rows // 2:
                    ws, index = self._compact(home, ws, index)
            if round_no == 0:
                self._run("open", ws, lambda w: self._round(w, opening=True))
            else:
                self._run("round", ws, lambda w: self._round(w, opening=False))
            self.stats.rounds += 1
            self.stats.target_calls += 1
            self.stats.row_rounds += ws.rows
            self.stats.draft_calls += self.config.gamma
        self._settle(home, ws, index)

    def _compact(
        self, home: Workspace, ws: Workspace, index: torch.Tensor | None
    ) -> tuple[Workspace, torch.Tensor]:
        """Move ws's live rows into the workspace of the smallest bucket that holds them."""
        self._settle(home, ws, index)
        rows = torch.nonzero(ws.live()).squeeze(1)  # [n]
        consumed = ws.consumed.shape[1] if self.config.exclude_consumed else 0  # as the key
        small = self._workspace(_bucket(rows.numel()), ws.tables.shape[1], consumed)
        small.take(ws, rows)
        self.stats.compactions += 1
        return small, rows if index is None else index[rows]

    def _settle(self, home: Workspace, ws: Workspace, index: torch.Tensor | None) -> None:
        """Count ws's proposals, and copy its rows' items back to their home rows."""
        self.stats.proposed += int(ws.proposed)
        self.stats.accepted += int(ws.accepted)
        ws.proposed.zero_()
        ws.accepted.zero_()
        if index is not None:
            n = index.numel()
            home.gen[index] = ws.gen[:n]
            home.gen_scores[index] = ws.gen_scores[:n]
            home.m[index] = ws.m[:n]

    # ------------------------------------------------------------------ buffers

    def _inputs_workspace(self, rows: int, inputs: GenerationInputs) -> Workspace:
        consumed = 0
        if self.config.exclude_consumed:
            consumed = max(self.max_consumed, inputs.consumed.shape[1])
        blocks = max(self.max_blocks, inputs.block_tables.shape[1])
        return self._workspace(rows, blocks, consumed)

    def _workspace(self, rows: int, blocks: int, consumed: int) -> Workspace:
        key = (rows, blocks, consumed)
        ws = self._spaces.get(key)
        if ws is None:
            cfg = self.config
            ws = Workspace(
                rows, cfg.k, cfg.gamma, self.window, consumed, blocks, self.target.geometry,
                None if self.draft is None else self.draft.geometry, self.device,
            )  # fmt: skip
            self._spaces[key] = ws
        return ws

    def warm_up(self, rows: Sequence[int]) -> None:
        """Generate once for each row count with placeholder users (no cached keys), so
        that the CUDA graphs of those buckets are captured now rather than by a step."""
        d_model = self.target.geometry.config.d_model
        dtype = self.target.geometry.dtype
        for n in rows:
            longs = torch.zeros(n, dtype=torch.int64, device=self.device)
            self.generate(
                GenerationInputs(
                    user_emb=torch.zeros(n, d_model, dtype=dtype, device=self.device),
                    block_tables=torch.zeros(n, 1, dtype=torch.int32, device=self.device),
                    cached_lens=longs,
                    last_ts=longs,
                    consumed=torch.full((n, 1), -1, dtype=torch.int64, device=self.device),
                    window=torch.zeros(n, 1, 3, dtype=torch.int64, device=self.device),
                    window_lens=longs,
                )
            )
        self.stats = GenerationStats()  # placeholders are not traffic

    def _load(self, ws: Workspace, inputs: GenerationInputs, users: int) -> None:
        """Copy the batch into the workspace; rows past ``users`` become padding."""
        ws.emb.zero_()
        ws.emb[:users].copy_(inputs.user_emb)
        ws.tables.zero_()
        ws.tables[:users, : inputs.block_tables.shape[1]].copy_(inputs.block_tables)
        ws.lens.zero_()
        ws.lens[:users].copy_(inputs.cached_lens)
        ws.last_ts.zero_()
        ws.last_ts[:users].copy_(inputs.last_ts)
        ws.consumed.fill_(-1)
        if self.config.exclude_consumed:
            ws.consumed[:users, : inputs.consumed.shape[1]].copy_(inputs.consumed)
        ws.real.zero_()
        ws.real[:users] = True
        ws.m.zero_()  # nothing emitted yet (the previous call's items are not excluded)
        if self.speculative:
            assert inputs.window is not None and inputs.window_lens is not None
            width = inputs.window.shape[1]
            if width > self.window:
                raise PipelineError(
                    f"draft window of {width} tokens, more than the {self.window} that "
                    "draft max_seq_len - k - gamma - 1 allows"
                )
            ws.window_tokens.zero_()
            ws.window_tokens[:users, :width].copy_(inputs.window)
            # A graph replays the full width; an eager call only as wide as this batch needs.
            ws.open_width = self.window + 1 if self.capture else width + 1
            ws.window_lens.zero_()
            ws.window_lens[:users].copy_(inputs.window_lens.clamp(0, width))

    def _run(self, name: str, ws: Workspace, fn: Callable[[Workspace], None]) -> None:
        """Run ``fn(ws)``: eagerly, or as the CUDA graph captured for this workspace."""
        if not self.capture:
            with torch.no_grad():
                fn(ws)
            return
        key = (name, ws.rows, id(ws))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._record(ws, fn)
            self._graphs[key] = graph
        graph.replay()

    def _record(self, ws: Workspace, fn: Callable[[Workspace], None]) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (state saved and restored), then capture."""
        saved = {name: t.clone() for name, t in vars(ws).items() if isinstance(t, torch.Tensor)}
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(2):
                fn(ws)
                _restore(ws, saved)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with (
            torch.no_grad(),
            torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"),
        ):
            fn(ws)
        _restore(ws, saved)
        return graph

    # ------------------------------------------------------------------ steps

    def _choose(
        self, retrieve: Retrieve, emb: torch.Tensor, exclude: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chosen item per row of emb [R', D]: (item, score, ids [R', N], probs)."""
        s = self.config
        scores, ids = retrieve(emb, s.candidates, exclude)  # [R', N]
        scores = scores.float()
        if s.greedy:
            return ids[:, 0], scores[:, 0], ids, torch.ones_like(scores)
        probs = candidate_probs(scores, s.temperature, s.top_p)
        pick = draw(probs, self._uniform(emb.shape[0]))
        chosen = ids.gather(1, pick.unsqueeze(1)).squeeze(1)
        return chosen, scores.gather(1, pick.unsqueeze(1)).squeeze(1), ids, probs

    def _uniform(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self._rng, device=self.device)

    def _first(self, ws: Workspace) -> None:
        """Item 1 from the step's own user embedding: no extra model call but retrieval."""
        item, score, _, _ = self._choose(self.target.model.retrieve, ws.emb, ws.emitted())
        ws.gen[:, 0] = item
        ws.gen_scores[:, 0] = score
        k = self.config.k
        ws.m.copy_(k - (k - 1) * ws.real.to(torch.int64))  # 1, or k (done) for padding rows

    def _token_ts(self, ws: Workspace, index: torch.Tensor) -> torch.Tensor:
        """Timestamp of generated item ``index`` (1-based) [R, Q]: time_step_ms apart."""
        return ws.last_ts.unsqueeze(1) + index * self.config.time_step_ms

    def _target_call(self, ws: Workspace, items: torch.Tensor) -> torch.Tensor:
        """Feed items [R, Q] (emitted items m, m+1, ...) to the target; returns emb [R, Q, D]."""
        index = ws.m.unsqueeze(1) + torch.arange(items.shape[1], device=self.device)
        ts = self._token_ts(ws, index)
        start = ws.m - 1  # the target's scratch holds every emitted item but the last
        k, v, emb = self.target.model.extend_scratch(
            items, torch.full_like(items, self.config.action_id), ts, self.kv_pool, self.ts_pool,
            ws.tables, ws.lens, ws.t_kv, ws.t_ts, start,
        )  # fmt: skip
        write_scratch(ws.t_kv, ws.t_ts, start, k, v, ts)
        return emb

    def _ar_step(self, ws: Workspace) -> None:
        emb = self._target_call(ws, ws.last_emitted())  # [R, 1, D]
        item, score, _, _ = self._choose(self.target.model.retrieve, emb[:, 0], ws.emitted())
        at = ws.m.clamp(max=ws.cap - 1).unsqueeze(1)
        ws.gen.scatter_(1, at, item.unsqueeze(1))
        ws.gen_scores.scatter_(1, at, score.unsqueeze(1))
        ws.m.add_(ws.live().to(torch.int64))

    def _draft_call(
        self, ws: Workspace, items: torch.Tensor, actions: torch.Tensor, ts: torch.Tensor,
        start: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        assert self.draft is not None
        pool, pool_ts, tables, lens = ws.d_pool
        k, v, emb = self.draft.model.extend_scratch(
            items, actions, ts, pool, pool_ts, tables, lens, ws.d_kv, ws.d_ts, start
        )
        write_scratch(ws.d_kv, ws.d_ts, start, k, v, ts)
        return emb  # [R, Q, D_draft]

    def _open_draft(self, ws: Workspace, opening: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's first call of a round: (its query [R, D], its scratch length after).

        Opening round: the user's window then item 1, right-padded (the window is re-encoded
        every step, so the draft needs no cache). Later rounds: the last two emitted items
        over a scratch rewound to just before them (the second-last may be a draft item the
        draft never fed itself).
        """
        rows = torch.arange(ws.rows, device=self.device)
        if opening:
            tokens = ws.window_tokens[:, : ws.open_width].clone()  # [R, W+1, 3]
            at = ws.window_lens
            # (tensor values only: a captured round must not copy a host scalar)
            tokens[rows, at, 0] = ws.gen[:, 0]
            tokens[rows, at, 1] = torch.full_like(at, self.config.action_id)
            tokens[rows, at, 2] = self._token_ts(ws, torch.ones_like(at).unsqueeze(1))[:, 0]
            start = torch.zeros_like(at)
            emb = self._draft_call(ws, tokens[..., 0], tokens[..., 1], tokens[..., 2], start)
            return emb[rows, at], at + 1
        items = torch.cat([ws.last_emitted(2), ws.last_emitted(1)], dim=1)  # [R, 2]
        index = ws.m.unsqueeze(1) - 1 + torch.arange(2, device=self.device)
        start = ws.window_lens + ws.m - 2
        actions = torch.full_like(items, self.config.action_id)
        emb = self._draft_call(ws, items, actions, self._token_ts(ws, index), start)
        return emb[:, 1], start + 2

    def _propose(
        self, ws: Workspace, j: int, query: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft's item for position m + j from its query [R, D]: (item, ids, probs)."""
        assert self.draft is not None
        exclude = torch.cat([ws.emitted(), ws.draft[:, :j]], dim=1)
        catalog = self.draft_catalog  # the draft proposes from it when it has one
        retrieve = self.draft.model.retrieve if catalog is None else catalog.retrieve
        item, _, ids, probs = self._choose(retrieve, query, exclude)
        return item, ids, probs

    def _round(self, ws: Workspace, opening: bool) -> None:
        """γ draft items, one target call over γ + 1 positions, the accept rule."""
        gamma = self.config.gamma
        query, d_len = self._open_draft(ws, opening)
        d_ids: list[torch.Tensor] = []
        d_probs: list[torch.Tensor] = []
        for j in range(gamma):
            if j:
                item = ws.draft[:, j - 1 : j]
                ts = self._token_ts(ws, ws.m.unsqueeze(1) + j)
                actions = torch.full_like(item, self.config.action_id)
                query = self._draft_call(ws, item, actions, ts, d_len)[:, 0]
                d_len = d_len + 1
            item, ids, probs = self._propose(ws, j, query)
            ws.draft[:, j] = item
            d_ids.append(ids)
            d_probs.append(probs)
        items = torch.cat([ws.last_emitted(), ws.draft], dim=1)  # [R, γ+1]
        emb = self._target_call(ws, items)  # [R, γ+1, D]
        slots = torch.arange(gamma + 1, device=self.device)
        prefix = torch.where(
            torch.arange(gamma, device=self.device) < slots.unsqueeze(1),
            ws.draft.unsqueeze(1), torch.full_like(ws.draft, -1).unsqueeze(1),
        )  # [R, γ+1, γ]: position r also excludes draft items before it  # fmt: skip
        exclude = ws.emitted(prefix).flatten(0, 1)  # [R*(γ+1), E]
        s = self.config
        scores, ids = self.target.model.retrieve(emb.flatten(0, 1), s.candidates, exclude)
        scores = scores.float().view(ws.rows, gamma + 1, -1)  # [R, γ+1, N]
        ids = ids.view(ws.rows, gamma + 1, -1)
        if s.greedy:
            kept = greedy_accept(ws.draft, ids[..., 0])
            new_items, new_scores = ids[..., 0], scores[..., 0]  # [R, γ+1]
        else:
            probs = candidate_probs(scores, s.temperature, s.top_p)
            kept, pick = speculative_accept(
                ws.draft, torch.stack(d_ids, 1), torch.stack(d_probs, 1), ids, probs,
                self._uniform(ws.rows, gamma), self._uniform(ws.rows),
            )  # fmt: skip
            last_ids = ids[torch.arange(ws.rows, device=self.device), kept]  # [R, N]
            last_scores = scores[torch.arange(ws.rows, device=self.device), kept]
            final = last_ids.gather(1, pick.unsqueeze(1))  # [R, 1]
            final_score = last_scores.gather(1, pick.unsqueeze(1))
            hit = prob_of(ws.draft, ids[:, :gamma], scores[:, :gamma])  # a kept item's score
            new_items = torch.where(slots < kept.unsqueeze(1),
                                    torch.cat([ws.draft, final], 1), final)  # fmt: skip
            new_scores = torch.where(slots < kept.unsqueeze(1),
                                     torch.cat([hit, final_score], 1), final_score)  # fmt: skip
        at = (ws.m.unsqueeze(1) + slots).clamp(max=ws.cap - 1)  # [R, γ+1]
        ws.gen.scatter_(1, at, new_items)
        ws.gen_scores.scatter_(1, at, new_scores)
        live = ws.live().to(torch.int64)
        ws.proposed.add_(live.sum() * gamma)
        ws.accepted.add_((live * kept).sum())
        ws.m.add_(live * (kept + 1))


def _bucket(n: int) -> int:
    for size in ROW_BUCKETS:
        if n <= size:
            return size
    return n


def _rows(inputs: GenerationInputs, lo: int, hi: int) -> GenerationInputs:
    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[lo:hi]

    return GenerationInputs(
        user_emb=inputs.user_emb[lo:hi],
        block_tables=inputs.block_tables[lo:hi],
        cached_lens=inputs.cached_lens[lo:hi],
        last_ts=inputs.last_ts[lo:hi],
        consumed=inputs.consumed[lo:hi],
        window=cut(inputs.window),
        window_lens=cut(inputs.window_lens),
    )


def _restore(ws: Workspace, saved: dict[str, torch.Tensor]) -> None:
    for name, value in saved.items():
        getattr(ws, name).copy_(value)
