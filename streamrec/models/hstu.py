"""HSTU: the generative recommender the worker serves (DESIGN §3).

The module holds weights only; ``prefill``, ``extend``, ``rank`` and ``retrieve`` are pure
functions of their tensor arguments (docs/contracts.md, "Model entry points"), so the same
code runs eagerly, as the full-recompute reference and inside an AOTInductor package.
Jagged batches are (values, offsets); tokens are mapped to users with ``searchsorted``
and every mask is a ``where``, so no shape depends on tensor data.

Retrieval scores are cosine similarities: the user embedding is L2-normalised and so is
each row of the (shared input/output) item table; ``retrieve`` ranks by that dot product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from streamrec.errors import ModelError
from streamrec.models.attention import (
    relative_bias,
    self_attention_term,
    silu_attention,
    time_bucket_edges,
)
from streamrec.models.config import HSTUConfig
from streamrec.models.paged_attention import (
    fused_attention_enabled,
    fused_candidate_attention,
    fused_context_attention,
)
from streamrec.schemas.events import Action

LayerState = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class HSTULayer(nn.Module):
    """Weights of one pre-norm HSTU layer; the attention is done by the caller."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        hd = config.num_heads * config.head_dim
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.norm_in = nn.LayerNorm(config.d_model)
        self.uvqk = nn.Linear(config.d_model, 4 * hd)
        self.norm_attn = nn.LayerNorm(hd)
        self.proj = nn.Linear(hd, config.d_model)
        self.pos_bias = nn.Parameter(torch.zeros(config.max_seq_len, config.num_heads))
        self.time_bias = nn.Parameter(torch.zeros(config.num_time_buckets, config.num_heads))
        self.dropout = nn.Dropout(config.dropout)

    def project(self, x: torch.Tensor) -> LayerState:
        """x [..., D] -> u, v, q, k, each [..., H, d]."""
        h = F.silu(self.uvqk(self.norm_in(x)))  # [..., 4*H*d]
        shape = (*x.shape[:-1], self.num_heads, self.head_dim)
        u, v, q, k = (part.reshape(shape) for part in h.chunk(4, dim=-1))
        return u, v, q, k

    def output(self, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual update x + Linear(u ⊙ LayerNorm(attn)); u, attn [..., H, d]."""
        gated = u.flatten(-2) * self.norm_attn(attn.flatten(-2))  # [..., H*d]
        return x + self.dropout(self.proj(gated))

    def bias0(self) -> torch.Tensor:
        """rab of a token with itself (relative position 0, dt = 0): [H]."""
        return self.pos_bias[0] + self.time_bias[0]


class HSTU(nn.Module):
    """Item + action embeddings, HSTU layers, final LayerNorm, multi-task heads."""

    def __init__(self, config: HSTUConfig, attention_backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        # "auto" | "torch" | "triton": cached-context attention through the fused op
        # (streamrec/models/paged_attention.py) on CUDA when Triton is present.
        self.attention_backend = attention_backend
        self.item_emb = nn.Embedding(config.num_items, config.d_model, padding_idx=0)
        self.action_emb = nn.Embedding(config.num_actions, config.d_model)
        self.layers = nn.ModuleList(HSTULayer(config) for _ in range(config.num_layers))
        self.norm_out = nn.LayerNorm(config.d_model)
        self.task_head = nn.Sequential(
            nn.Linear(config.d_model, config.task_hidden),
            nn.SiLU(),
            nn.Linear(config.task_hidden, config.num_tasks),
        )
        self.emb_dropout = nn.Dropout(config.dropout)
        edges = time_bucket_edges(config.num_time_buckets, config.time_bucket_width)
        self.register_buffer("time_edges", edges, persistent=False)
        nn.init.normal_(self.item_emb.weight, std=config.d_model**-0.5)
        nn.init.normal_(self.action_emb.weight, std=config.d_model**-0.5)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()

    # ---------------------------------------------------------------- helpers

    def _embed(self, items: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """A token's input is frozen when appended: item + action, nothing time-relative."""
        return self.emb_dropout(self.item_emb(items) + self.action_emb(actions))

    def _bias(self, layer: HSTULayer, rel_pos: torch.Tensor, dt_ms: torch.Tensor) -> torch.Tensor:
        edges: torch.Tensor = self.time_edges  # type: ignore[assignment]
        return relative_bias(rel_pos, dt_ms, layer.pos_bias, layer.time_bias, edges)

    def _user_embedding(self, z: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Normalised output at each user's last token; 0 for users without tokens.

        z [T, D] (after the final norm); offsets [B+1]. Returns [B, D].
        """
        num_users = offsets.shape[0] - 1
        starts = offsets[torch.arange(num_users, device=offsets.device)]
        ends = offsets[torch.arange(1, num_users + 1, device=offsets.device)]
        last = (ends - 1).clamp(min=0)  # [B]
        emb = F.normalize(z[last], dim=-1)
        return torch.where((ends > starts).unsqueeze(-1), emb, torch.zeros_like(emb))

    @staticmethod
    def _token_users(offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """users[T]: the batch row of each jagged token.

        The clamp is a no-op for valid offsets; it keeps every index in range when a
        compiler runs the graph on placeholder inputs (AOTInductor autotunes kernels on
        zero-filled tensors, where ``searchsorted`` would answer B for every token).
        """
        ar = torch.arange(num_tokens, device=offsets.device, dtype=offsets.dtype)
        users = torch.searchsorted(offsets, ar, right=True) - 1
        return users.clamp(0, offsets.shape[0] - 2)

    def _gather_context(
        self,
        layer_idx: int,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        tables: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cached K, V, ts of each query's user through its block table.

        tables [G, MB] (block ids, any value past the user's length). Returns
        k, v [G, MB*BS, H, d] and ts [G, MB*BS].
        """
        num_blocks, block_size = ts_pool.shape
        blocks = tables.long().clamp(0, num_blocks - 1)  # [G, MB]
        g, mb = blocks.shape
        span = mb * block_size
        k = kv_pool[layer_idx, 0][blocks].reshape(g, span, *kv_pool.shape[-2:])
        v = kv_pool[layer_idx, 1][blocks].reshape(g, span, *kv_pool.shape[-2:])
        ts = ts_pool[blocks].reshape(g, span)
        return k, v, ts

    def _context_attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        pos: torch.Tensor,
        ts: torch.Tensor,
        users: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Contribution of each new token's cached keys. q [G, H, d]; pos, ts, users [G]."""
        layer = self.layers[layer_idx]
        assert isinstance(layer, HSTULayer)
        if fused_attention_enabled(self.attention_backend, q):
            return fused_context_attention(
                q, pos, ts, users, kv_pool[layer_idx], ts_pool, block_tables, cached_lens,
                layer.pos_bias, layer.time_bias, self.time_edges,  # type: ignore[arg-type]
                self.config.max_seq_len,
            )  # fmt: skip
        k, v, k_ts = self._gather_context(layer_idx, kv_pool, ts_pool, block_tables[users])
        span = k.shape[1]
        key_pos = torch.arange(span, device=q.device, dtype=torch.int64)  # [S]
        mask = (key_pos.unsqueeze(0) < cached_lens[users].unsqueeze(1)).unsqueeze(1)  # [G,1,S]
        rel = (pos.unsqueeze(1) - key_pos.unsqueeze(0)).unsqueeze(1)  # [G, 1, S]
        dt = (ts.unsqueeze(1) - k_ts).unsqueeze(1)  # [G, 1, S]
        bias = self._bias(layer, rel, dt).to(q.dtype)  # [G, H, 1, S]
        out = silu_attention(q.unsqueeze(1), k, v, bias, mask, self.config.max_seq_len)
        return out.squeeze(1)  # [G, H, d]

    def _candidate_attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        query_ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Cached-context attention of every user's candidates. q [B, C, H, d].

        All of user b's candidates sit at position cached_lens[b] with timestamp
        query_ts[b], so they share one bias row per key and one read of b's K/V.
        """
        layer = self.layers[layer_idx]
        assert isinstance(layer, HSTULayer)
        if fused_attention_enabled(self.attention_backend, q):
            return fused_candidate_attention(
                q, cached_lens, query_ts, kv_pool[layer_idx], ts_pool, block_tables,
                cached_lens, layer.pos_bias, layer.time_bias,
                self.time_edges,  # type: ignore[arg-type]
                self.config.max_seq_len,
            )  # fmt: skip
        k, v, k_ts = self._gather_context(layer_idx, kv_pool, ts_pool, block_tables)  # [B,S,H,d]
        span = k.shape[1]
        key_pos = torch.arange(span, device=q.device, dtype=torch.int64)  # [S]
        mask = (key_pos.unsqueeze(0) < cached_lens.unsqueeze(1)).unsqueeze(1)  # [B, 1, S]
        rel = (cached_lens.unsqueeze(1) - key_pos.unsqueeze(0)).unsqueeze(1)  # [B, 1, S]
        dt = (query_ts.unsqueeze(1) - k_ts).unsqueeze(1)  # [B, 1, S]
        bias = self._bias(layer, rel, dt).to(q.dtype)  # [B, H, 1, S]
        return silu_attention(q, k, v, bias, mask, self.config.max_seq_len)  # [B, C, H, d]

    # ----------------------------------------------------------- dense paths

    @staticmethod
    def _dense_geometry(
        ts: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Relative positions [1, L, L], time gaps [B, L, L] and the causal mask [B, L, L]
        of left-aligned padded sequences (ts, valid [B, L])."""
        pos = torch.arange(ts.shape[1], device=ts.device, dtype=torch.int64)
        rel = (pos.unsqueeze(1) - pos.unsqueeze(0)).unsqueeze(0)
        dt = ts.unsqueeze(2) - ts.unsqueeze(1)
        return rel, dt, (rel >= 0) & valid.unsqueeze(1)

    def encode_dense(
        self, x: torch.Tensor, ts: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Full causal recompute on padded sequences (prefill reference and training).

        x [B, L, D] input embeddings; ts [B, L] int64; valid [B, L] bool (left-aligned).
        Returns z [B, L, D] (before the final norm) and per-layer k, v [B, L, H, d].
        """
        rel, dt, mask = self._dense_geometry(ts, valid)
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        for layer in self.layers:
            assert isinstance(layer, HSTULayer)
            u, v, q, k = layer.project(x)  # [B, L, H, d]
            bias = self._bias(layer, rel, dt).to(x.dtype)  # [B, H, L, L]
            attn = silu_attention(q, k, v, bias, mask, self.config.max_seq_len)
            x = layer.output(x, u, attn)
            ks.append(k)
            vs.append(v)
        return x, ks, vs

    def train_forward(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        valid: torch.Tensor,
        next_items: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """History outputs and, for each position i, the task logits of item i+1 as a
        ranking candidate (position i+1, action CANDIDATE, timestamp ts_i) — exactly the
        regime ``rank`` serves in. All inputs [B, L]; returns user vectors [B, L, D]
        (normalised) and task logits [B, L, num_tasks] (None without ``next_items``,
        which halves the cost when the heads are not trained).
        """
        x = self._embed(items, actions)  # [B, L, D]
        xc = None
        if next_items is not None:
            cand_actions = torch.full_like(next_items, int(Action.CANDIDATE))
            xc = self._embed(next_items, cand_actions)  # [B, L, D]
        rel, dt, mask = self._dense_geometry(ts, valid)
        n = self.config.max_seq_len
        for layer in self.layers:
            assert isinstance(layer, HSTULayer)
            u, v, q, k = layer.project(x)
            bias = self._bias(layer, rel, dt).to(x.dtype)
            if xc is not None:
                uc, vc, qc, kc = layer.project(xc)
                # Candidate at position i+1 sees history 0..i (one further away) and itself.
                cbias = self._bias(layer, rel + 1, dt).to(x.dtype)
                cattn = silu_attention(qc, k, v, cbias, mask, n)
                cattn = cattn + self_attention_term(qc, kc, vc, layer.bias0(), n)
                xc = layer.output(xc, uc, cattn)
            x = layer.output(x, u, silu_attention(q, k, v, bias, mask, n))
        user = F.normalize(self.norm_out(x), dim=-1)
        return user, None if xc is None else self.task_head(self.norm_out(xc))

    def use_item_rows(self, rows: torch.Tensor) -> None:
        """Read input item embeddings from ``rows[S, D]``, shared, not copied.

        For catalogues past the GPU budget: ``rows`` are the embedding cache's device
        slots, and the item arguments of ``prefill``/``extend``/``rank`` become slot ids
        (cache.EmbeddingCache.slots). ``item_table``/``retrieve`` then see the slots, not
        the catalogue: retrieval goes through a cache.RetrievalSet. Bind before CUDA-graph
        capture; the cache updates ``rows`` in place, so captured graphs stay valid.
        """
        if rows.dim() != 2 or rows.shape[1] != self.config.d_model:
            raise ModelError(f"item rows must be [S, {self.config.d_model}], got {rows.shape}")
        self.item_emb.weight = nn.Parameter(rows, requires_grad=False)

    def item_table(self) -> torch.Tensor:
        """Normalised item rows [num_items, D]: the retrieval side of the cosine score."""
        return F.normalize(self.item_emb.weight, dim=-1)

    # ----------------------------------------------------------- entry points

    def dense_width(self, offsets: torch.Tensor) -> int:
        """Row width of a dense prefill: ``max_seq_len`` when traced, else the batch's
        longest history rounded up to a multiple of 64.

        Padding never changes a valid token's output (keys past a user's length are
        masked, and the divisor is the constant N = max_seq_len, not the width), so the
        width only decides cost: attention is O(width²) per user, and a median history of
        1,000 in rows of 4,096 did 16x the needed work. An exported or compiled graph
        keeps ``max_seq_len``: its shapes must not depend on values.
        """
        n = self.config.max_seq_len
        exporting = getattr(torch.compiler, "is_exporting", lambda: False)()
        traced = torch.compiler.is_compiling() or exporting
        if traced or isinstance(offsets, torch._subclasses.FakeTensor) or offsets.numel() < 2:
            return n
        longest = int(offsets.diff().max())  # one host sync, eager only
        return min(n, max(64, -(-longest // 64) * 64))

    def prefill_states(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        offsets: torch.Tensor,
        width: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full recompute of whole histories; also returns the normed outputs z [T, D].

        Each user's tokens go into a dense row of ``width`` (default ``dense_width``); a
        history must not exceed max_seq_len tokens.
        """
        num_tokens = items.shape[0]
        num_users = offsets.shape[0] - 1
        width = self.dense_width(offsets) if width is None else width
        users = self._token_users(offsets, num_tokens)  # [T]
        starts = offsets[torch.arange(num_users, device=offsets.device)]
        grid = users * width + (torch.arange(num_tokens, device=items.device) - starts[users])
        x = self._embed(items, actions)  # [T, D]
        d_model = x.shape[-1]
        x_grid = x.new_zeros(num_users * width, d_model).index_put((grid,), x)
        ts_grid = ts.new_zeros(num_users * width).index_put((grid,), ts)
        valid = torch.zeros(num_users * width, dtype=torch.bool, device=items.device)
        valid = valid.index_put((grid,), torch.ones_like(grid, dtype=torch.bool))
        z, ks, vs = self.encode_dense(
            x_grid.view(num_users, width, d_model),
            ts_grid.view(num_users, width),
            valid.view(num_users, width),
        )
        heads = (self.config.num_heads, self.config.head_dim)
        k = torch.stack([kl.reshape(num_users * width, *heads)[grid] for kl in ks])
        v = torch.stack([vl.reshape(num_users * width, *heads)[grid] for vl in vs])
        z_tok = self.norm_out(z.reshape(num_users * width, d_model)[grid])  # [T, D]
        return k, v, z_tok

    def prefill(
        self, items: torch.Tensor, actions: torch.Tensor, ts: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Whole histories -> (k [Lyr, T, H, d], v [Lyr, T, H, d], user_emb [B, D])."""
        k, v, z = self.prefill_states(items, actions, ts, offsets)
        return k, v, self._user_embedding(z, offsets)

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
        """New tokens only, attending to the paged cache and to each other causally.

        Returns (k_new [Lyr, T, H, d], v_new [Lyr, T, H, d], user_emb [B, D]); the caller
        writes k_new/v_new/ts into the pool afterwards.
        """
        num_tokens = items.shape[0]
        num_users = offsets.shape[0] - 1
        users = self._token_users(offsets, num_tokens)  # [T]
        starts = offsets[torch.arange(num_users, device=offsets.device)]
        tok = torch.arange(num_tokens, device=items.device, dtype=torch.int64)
        pos = cached_lens[users] + (tok - starts[users])  # [T] position in the user's cache
        new_rel = (pos.unsqueeze(1) - pos.unsqueeze(0)).unsqueeze(0)  # [1, T, T]
        new_dt = (ts.unsqueeze(1) - ts.unsqueeze(0)).unsqueeze(0)  # [1, T, T]
        new_mask = (users.unsqueeze(1) == users.unsqueeze(0)) & (
            tok.unsqueeze(0) <= tok.unsqueeze(1)
        )  # [T, T]
        x = self._embed(items, actions)  # [T, D]
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        for idx, layer in enumerate(self.layers):
            assert isinstance(layer, HSTULayer)
            u, v, q, k = layer.project(x)  # [T, H, d]
            cached = self._context_attention(
                idx, q, pos, ts, users, kv_pool, ts_pool, block_tables, cached_lens
            )
            bias = self._bias(layer, new_rel, new_dt).to(x.dtype)  # [1, H, T, T]
            fresh = silu_attention(
                q.unsqueeze(0),
                k.unsqueeze(0),
                v.unsqueeze(0),
                bias,
                new_mask.unsqueeze(0),
                self.config.max_seq_len,
            ).squeeze(0)
            x = layer.output(x, u, cached + fresh)
            ks.append(k)
            vs.append(v)
        z = self.norm_out(x)
        return torch.stack(ks), torch.stack(vs), self._user_embedding(z, offsets)

    def rank(
        self,
        cand_items: torch.Tensor,
        query_ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Candidates [B, C] -> task probabilities [B, C, num_tasks]; writes nothing.

        Candidate c of user b sits at position cached_lens[b] with action CANDIDATE and
        timestamp query_ts[b]; it sees b's cache and itself, never another candidate.
        """
        x = self._embed(cand_items, torch.full_like(cand_items, int(Action.CANDIDATE)))
        for idx, layer in enumerate(self.layers):
            assert isinstance(layer, HSTULayer)
            u, v, q, k = layer.project(x)  # [B, C, H, d]
            cached = self._candidate_attention(
                idx, q, query_ts, kv_pool, ts_pool, block_tables, cached_lens
            )
            own = self_attention_term(q, k, v, layer.bias0(), self.config.max_seq_len)
            x = layer.output(x, u, cached + own)  # [B, C, D]
        return torch.sigmoid(self.task_head(self.norm_out(x)))

    def retrieve(
        self, user_emb: torch.Tensor, k: int, exclude: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k retrievable rows by cosine score; exclude [B, E] row ids, -1 = none."""
        scores = user_emb @ self.item_table().t()  # [B, V], a fresh tensor: masked in place
        # (masking in place saves three passes over [B, V], 1M items each, per step)
        scores[:, : self.config.first_item_row] = float("-inf")
        # -1 maps to row 0 (padding), which is already blocked.
        drop = exclude.clamp(min=0, max=scores.shape[1] - 1)
        scores.scatter_(1, drop, float("-inf"))
        top_scores, top_idx = torch.topk(scores, k, dim=1)
        return top_scores, top_idx


def validate_offsets(offsets: torch.Tensor, num_tokens: int, max_len: int | None = None) -> None:
    """Eager-side check of a jagged batch before it reaches an entry point.

    The entry points themselves cannot check (no data-dependent control flow under
    export), and a compiled package silently returns garbage on bad offsets.
    """
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.shape[0] < 2:
        raise ModelError(
            f"offsets must be int64 [B+1] with B >= 1, got {offsets.dtype} {tuple(offsets.shape)}"
        )
    lens = offsets.diff()
    if int(offsets[0]) != 0 or int(offsets[-1]) != num_tokens or bool((lens < 0).any()):
        raise ModelError(
            f"offsets {offsets.tolist()[:8]}… must start at 0, be non-decreasing and end at "
            f"{num_tokens}"
        )
    if max_len is not None and int(lens.max()) > max_len:
        raise ModelError(f"a user has {int(lens.max())} tokens, more than max_seq_len={max_len}")
