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

from dataclasses import dataclass

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
from streamrec.models.candidate_attention import fused_projection_candidates
from streamrec.models.config import HSTUConfig
from streamrec.models.fp8 import KVScales, gather_blocks
from streamrec.models.hstu_layer import HSTULayer
from streamrec.models.paged_attention import fused_attention_enabled, fused_token_attention
from streamrec.models.prefill_attention import fused_prefill_attention, fused_prefill_enabled
from streamrec.models.retrieval import (
    NormalizedTable,
    fused_retrieval_enabled,
    fused_retrieve,
    retrieve_reference,
)
from streamrec.models.scratch_extend import scratch_extend
from streamrec.schemas.events import Action


@dataclass(frozen=True)
class NewTokenGeometry:
    """How the step's new tokens see each other (torch path of ``extend``), per call.

    Eager: each user's new tokens in a padded row of ``width`` (``grid`` [T] = the row
    slot of each token), rel [1, W, W], dt/mask [B, W, W]: O(B·W²), never a square over
    the batch. Traced or captured (no shape may depend on a value): ``grid`` is None and
    rel/dt [1, T, T], mask [1, T, T] hold every pair of the batch's tokens.
    """

    grid: torch.Tensor | None
    rel: torch.Tensor
    dt: torch.Tensor
    mask: torch.Tensor


class HSTU(nn.Module):
    """Item + action embeddings, HSTU layers, final LayerNorm, multi-task heads."""

    def __init__(
        self, config: HSTUConfig, attention_backend: str = "auto", fused_layers: bool = False
    ) -> None:
        super().__init__()
        self.config = config
        # "auto" | "torch" | "triton": cached-context attention through the fused op
        # (streamrec/models/paged_attention.py) on CUDA when Triton is present.
        self.attention_backend = attention_backend
        # FP8 KV cache (models/precision.py): the scales K/V are cached with, else None.
        self.kv_quant: KVScales | None = None
        self.retrieval_table = NormalizedTable()  # retrieve's normalised item rows
        # extend/rank: LayerNorm + GEMM + SiLU and the output tail as one kernel each
        # (streamrec/models/fused_layer.py) where that can run; never with "torch". Off
        # by default: on the H200 the fused halves were slower than LayerNorm + cuBLAS
        # (1-layer rank step at batch 64: 0.696 vs 0.596 ms; BENCHMARKS.md, issue 14).
        self.fused_layers = fused_layers
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
        with torch.device("cpu"):  # a real tensor also when built on "meta" (load_checkpoint)
            edges = time_bucket_edges(config.num_time_buckets, config.time_bucket_width)
        self.register_buffer("time_edges", edges, persistent=False)
        nn.init.normal_(self.item_emb.weight, std=config.d_model**-0.5)
        nn.init.normal_(self.action_emb.weight, std=config.d_model**-0.5)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()

    # ---------------------------------------------------------------- helpers

    def _layers_fused(self, x: torch.Tensor) -> bool:
        """Whether extend/rank run the layers' GEMM halves fused for input x."""
        layer = self.layers[0]
        assert isinstance(layer, HSTULayer)
        return self.fused_layers and self.attention_backend != "torch" and layer.fusable(x)

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
        k = gather_blocks(kv_pool[layer_idx, 0], blocks).reshape(g, span, *kv_pool.shape[-2:])
        v = gather_blocks(kv_pool[layer_idx, 1], blocks).reshape(g, span, *kv_pool.shape[-2:])
        ts = ts_pool[blocks].reshape(g, span)
        if self.kv_quant is not None:  # FP8 codes -> values
            k, v = self.kv_quant.load(layer_idx, k, v, self.norm_out.weight.dtype)
        return k, v, ts

    def _cached_kv(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [..., H, d] as every query sees them, in the step that computes them and
        later from the cache alike (FP8 KV: quantized and back; else unchanged)."""
        return (k, v) if self.kv_quant is None else self.kv_quant.cached_form(layer_idx, k, v)

    def _kv_storage(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's k, v [Lyr, T, H, d] in the pool's dtype."""
        return (k, v) if self.kv_quant is None else self.kv_quant.store(k, v)

    def _layer_kv_scale(self, layer_idx: int) -> torch.Tensor | None:
        """The fused kernels' FP8 operand: the layer's [2, H] scales (None: model dtype)."""
        return None if self.kv_quant is None else self.kv_quant.layer_scale(layer_idx)

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
        """Torch path: each new token against its user's cached keys. q [G, H, d]."""
        layer = self.layers[layer_idx]
        assert isinstance(layer, HSTULayer)
        k, v, k_ts = self._gather_context(layer_idx, kv_pool, ts_pool, block_tables[users])
        span = k.shape[1]
        key_pos = torch.arange(span, device=q.device, dtype=torch.int64)  # [S]
        mask = (key_pos.unsqueeze(0) < cached_lens[users].unsqueeze(1)).unsqueeze(1)  # [G,1,S]
        rel = (pos.unsqueeze(1) - key_pos.unsqueeze(0)).unsqueeze(1)  # [G, 1, S]
        dt = (ts.unsqueeze(1) - k_ts).unsqueeze(1)  # [G, 1, S]
        bias = self._bias(layer, rel, dt).to(q.dtype)  # [G, H, 1, S]
        out = silu_attention(q.unsqueeze(1), k, v, bias, mask, self.config.max_seq_len)
        return out.squeeze(1)  # [G, H, d]

    def _new_token_geometry(
        self,
        offsets: torch.Tensor,
        users: torch.Tensor,
        slot: torch.Tensor,
        pos: torch.Tensor,
        ts: torch.Tensor,
    ) -> NewTokenGeometry:
        """Geometry of the new tokens among themselves; users, slot (index within the
        user's new tokens), pos, ts [T]."""
        num_users = offsets.shape[0] - 1
        exporting = getattr(torch.compiler, "is_exporting", lambda: False)()
        static = (
            torch.compiler.is_compiling()
            or exporting
            or isinstance(offsets, torch._subclasses.FakeTensor)
            or (offsets.is_cuda and torch.cuda.is_current_stream_capturing())
        )
        if static:
            rel = (pos.unsqueeze(1) - pos.unsqueeze(0)).unsqueeze(0)  # [1, T, T]
            dt = (ts.unsqueeze(1) - ts.unsqueeze(0)).unsqueeze(0)  # [1, T, T]
            mask = (users.unsqueeze(1) == users.unsqueeze(0)) & (rel[0] >= 0)  # [T, T]
            return NewTokenGeometry(None, rel, dt, mask.unsqueeze(0))
        # Row width from the tokens themselves (one host sync, eager only): a caller that
        # pads the batch (GraphedModel) leaves tokens past offsets[-1], which
        # _token_users gives to the last user, beyond its offsets length.
        width = int(slot.max()) + 1 if slot.numel() else 1
        grid = users * width + slot  # [T]
        ts_grid = ts.new_zeros(num_users * width).index_put((grid,), ts)
        valid = torch.zeros(num_users * width, dtype=torch.bool, device=ts.device)
        valid = valid.index_put((grid,), torch.ones_like(grid, dtype=torch.bool))
        rel, dt, mask = self._dense_geometry(
            ts_grid.view(num_users, width), valid.view(num_users, width)
        )
        return NewTokenGeometry(grid, rel, dt, mask)

    def _new_token_attention(
        self,
        layer: HSTULayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        geo: NewTokenGeometry,
    ) -> torch.Tensor:
        """Torch path: each new token against its user's new tokens up to itself.

        q, k, v [T, H, d]. Returns [T, H, d].
        """
        bias = self._bias(layer, geo.rel, geo.dt).to(q.dtype)  # [B|1, H, W, W]
        n = self.config.max_seq_len
        if geo.grid is None:
            out = silu_attention(q[None], k[None], v[None], bias, geo.mask, n)
            return out.squeeze(0)
        num_users, width = geo.mask.shape[:2]
        grid = geo.grid

        def padded(t: torch.Tensor) -> torch.Tensor:  # [T, H, d] -> [B, W, H, d]
            rows = t.new_zeros(num_users * width, *t.shape[1:]).index_put((grid,), t)
            return rows.view(num_users, width, *t.shape[1:])

        out = silu_attention(padded(q), padded(k), padded(v), bias, geo.mask, n)  # [B,W,H,d]
        return out.reshape(num_users * width, *q.shape[1:])[grid]

    def _candidate_attention(
        self,
        layer_idx: int,
        h: torch.Tensor,
        activated: bool,
        query_ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Every user's candidates against its cache and each itself; h [B, C, 4*H*d] is
        the layer's projection (``activated``: after its SiLU). Returns [B, C, H, d].

        All of user b's candidates sit at position cached_lens[b] with timestamp
        query_ts[b], so they share one bias row per key and one read of b's K/V; a
        candidate's own key has relative position 0 and dt 0.
        """
        layer = self.layers[layer_idx]
        assert isinstance(layer, HSTULayer)
        n = self.config.max_seq_len
        if fused_attention_enabled(self.attention_backend, h, layer.head_dim):
            return fused_projection_candidates(
                h, layer.qkv_columns(), not activated, cached_lens, query_ts,
                kv_pool[layer_idx], ts_pool, block_tables, cached_lens, layer.pos_bias,
                layer.time_bias, self.time_edges,  # type: ignore[arg-type]
                n, self._layer_kv_scale(layer_idx),
            )  # fmt: skip
        v, q, k = layer.value_query_key(h, activated)  # [B, C, H, d]
        kc, vc, k_ts = self._gather_context(layer_idx, kv_pool, ts_pool, block_tables)
        span = kc.shape[1]
        key_pos = torch.arange(span, device=q.device, dtype=torch.int64)  # [S]
        mask = (key_pos.unsqueeze(0) < cached_lens.unsqueeze(1)).unsqueeze(1)  # [B, 1, S]
        rel = (cached_lens.unsqueeze(1) - key_pos.unsqueeze(0)).unsqueeze(1)  # [B, 1, S]
        dt = (query_ts.unsqueeze(1) - k_ts).unsqueeze(1)  # [B, 1, S]
        bias = self._bias(layer, rel, dt).to(q.dtype)  # [B, H, 1, S]
        cached = silu_attention(q, kc, vc, bias, mask, n)  # [B, C, H, d]
        return cached + self_attention_term(q, k, v, layer.bias0(), n)

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
        for idx, layer in enumerate(self.layers):
            assert isinstance(layer, HSTULayer)
            u, v, q, k = layer.project(x)  # [B, L, H, d]
            k, v = self._cached_kv(idx, k, v)
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
        """Full recompute of whole histories; also returns the normed outputs z [T, D]
        (k, v [Lyr, T, H, d] in the pool's dtype).

        On CUDA with Triton (and no explicit ``width``) the tokens stay jagged and the
        attention is the fused prefill op; otherwise each user's tokens go into a dense
        row of ``width`` (default ``dense_width``). A history must not exceed max_seq_len
        tokens.
        """
        cfg = self.config
        if width is None and fused_prefill_enabled(
            self.attention_backend, items, cfg.head_dim, cfg.num_time_buckets,
            cfg.time_bucket_width,
        ):  # fmt: skip
            return self._prefill_jagged(items, actions, ts, offsets)
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
        return (*self._kv_storage(k, v), z_tok)

    def _prefill_jagged(
        self, items: torch.Tensor, actions: torch.Tensor, ts: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``prefill_states`` on jagged tokens: projections over [T, D], fused attention,
        no padding and no [B, W, W] temporaries. FP8 KV: the kernel reads the codes the
        pool will store."""
        x = self._embed(items, actions)  # [T, D]
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        for idx, layer in enumerate(self.layers):
            assert isinstance(layer, HSTULayer)
            u, v, q, k = layer.project(x)  # [T, H, d] (views of one projection)
            if self.kv_quant is not None:
                k, v = self.kv_quant.codes(idx, k, v)
            attn = fused_prefill_attention(
                q, k, v, ts, offsets, layer.pos_bias, layer.time_bias,
                self.time_edges, self.config.max_seq_len,  # type: ignore[arg-type]
                self._layer_kv_scale(idx),
            )  # fmt: skip
            x = layer.output(x, u, attn)
            ks.append(k)
            vs.append(v)
        return torch.stack(ks), torch.stack(vs), self.norm_out(x)

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
        first = starts[users]  # [T] the first new token of each token's user
        pos = cached_lens[users] + (tok - first)  # [T] position in the user's cache
        x = self._embed(items, actions)  # [T, D]
        n = self.config.max_seq_len
        edges: torch.Tensor = self.time_edges  # type: ignore[assignment]
        fused = fused_attention_enabled(self.attention_backend, x, self.config.head_dim)
        geo = None if fused else self._new_token_geometry(offsets, users, tok - first, pos, ts)
        fl = self._layers_fused(x)
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        for idx, layer in enumerate(self.layers):
            assert isinstance(layer, HSTULayer)
            u, v, q, k = layer.project(x, fl)  # [T, H, d]
            k, v = self._cached_kv(idx, k, v)
            if geo is None:  # cached keys, then the user's new keys up to the token
                attn = fused_token_attention(
                    q, k, v, pos, ts, users, first, kv_pool[idx], ts_pool, block_tables,
                    cached_lens, layer.pos_bias, layer.time_bias, edges, n,
                    self._layer_kv_scale(idx),
                )  # fmt: skip
            else:
                attn = self._context_attention(
                    idx, q, pos, ts, users, kv_pool, ts_pool, block_tables, cached_lens
                ) + self._new_token_attention(layer, q, k, v, geo)
            x = layer.output(x, u, attn, fl)
            ks.append(k)
            vs.append(v)
        z = self.norm_out(x)
        k_new, v_new = self._kv_storage(torch.stack(ks), torch.stack(vs))
        return k_new, v_new, self._user_embedding(z, offsets)

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
        """Generation's tokens [B, Q] after the paged cache and a caller-owned scratch;
        writes nothing (models/scratch_extend.py)."""
        return scratch_extend(
            self, items, actions, ts, kv_pool, ts_pool, block_tables, cached_lens, scratch_kv,
            scratch_ts, scratch_lens,
        )  # fmt: skip

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
        fl = self._layers_fused(x)
        for idx, layer in enumerate(self.layers):
            assert isinstance(layer, HSTULayer)
            h, activated = layer.project_packed(x, fl)  # [B, C, 4*H*d]
            attn = self._candidate_attention(
                idx, h, activated, query_ts, kv_pool, ts_pool, block_tables, cached_lens
            )
            x = layer.output(x, layer.gate(h, activated), attn, fl)  # [B, C, D]
        return torch.sigmoid(self.task_head(self.norm_out(x)))

    def retrieve(
        self,
        user_emb: torch.Tensor,
        k: int,
        exclude: torch.Tensor,
        table: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k retrievable rows by cosine score; exclude [B, E] row ids, -1 = none; ``table``:
        the normalised rows [V, D] (default the cached copy; the AOTI package binds it). With
        Triton on CUDA the retrieval op (models/retrieval.py): ties at the k-th
        place may pick other rows of equal score than ``torch.topk``."""
        if table is None:
            table = self.retrieval_table.get(self.item_emb.weight)  # [V, D]
        first = self.config.first_item_row
        if fused_retrieval_enabled(self.attention_backend, user_emb, table, k, first):
            return fused_retrieve(user_emb, table, exclude, k, first)
        return retrieve_reference(user_emb, table, exclude, k, first)
