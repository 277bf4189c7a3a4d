"""The device buffers of one generation call: scratch K/V, generated items, counters.

Allocated once per row count and reused, so that every tensor a generation round reads or
writes has a fixed address (a CUDA graph replays on those addresses) and nothing is
allocated per step. Scratch K/V belong to the generation alone: they are never written to
the user's KV cache or history (docs/contracts.md, "Generation").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamrec.models.config import HSTUConfig


@dataclass(frozen=True)
class ModelGeometry:
    """What buffers a model needs: its shape and its serving dtype."""

    config: HSTUConfig
    dtype: torch.dtype

    def scratch(self, rows: int, span: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Zeroed scratch ``kv [Lyr, 2, R, S, H, d]`` and ``ts [R, S]``."""
        cfg = self.config
        shape = (cfg.num_layers, 2, rows, span, cfg.num_heads, cfg.head_dim)
        kv = torch.zeros(shape, dtype=self.dtype, device=device)
        return kv, torch.zeros(rows, span, dtype=torch.int64, device=device)

    def empty_pool(self, rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """A one-slot pool, block tables and zero lengths: a model with no cached context."""
        cfg = self.config
        kv = torch.zeros(
            (cfg.num_layers, 2, 1, 1, cfg.num_heads, cfg.head_dim), dtype=self.dtype, device=device
        )  # [Lyr, 2, 1, 1, H, d]
        ts = torch.zeros(1, 1, dtype=torch.int64, device=device)
        tables = torch.zeros(rows, 1, dtype=torch.int32, device=device)
        return kv, ts, tables, torch.zeros(rows, dtype=torch.int64, device=device)


def write_scratch(
    kv: torch.Tensor,
    ts_buf: torch.Tensor,
    start: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    ts: torch.Tensor,
) -> None:
    """Scatter k/v_new [Lyr, R, Q, H, d] and ts [R, Q] into row r's slots start[r] + 0..Q-1.

    Slots are clamped to the row's last one, so a row that has finished generating (its
    writes are never read again) cannot spill into the next row.
    """
    num_layers, _, rows, span = kv.shape[:4]
    num_new = ts.shape[1]
    offs = torch.arange(num_new, device=ts.device, dtype=torch.int64)
    slot = (start.unsqueeze(1) + offs).clamp(max=span - 1)  # [R, Q]
    row = torch.arange(rows, device=ts.device, dtype=torch.int64).unsqueeze(1) * span
    idx = (row + slot).reshape(-1)  # [R*Q]
    flat = kv.view(num_layers, 2, rows * span, *kv.shape[-2:])
    heads = k_new.shape[-2:]
    flat[:, 0].index_copy_(1, idx, k_new.reshape(num_layers, -1, *heads))
    flat[:, 1].index_copy_(1, idx, v_new.reshape(num_layers, -1, *heads))
    ts_buf.view(-1).index_copy_(0, idx, ts.reshape(-1))


class Workspace:
    """Every buffer of one generation call over ``rows`` users (real ones first).

    ``gen``/``gen_scores`` hold the emitted items (``cap`` slots: a round may write past
    ``k``, the surplus is dropped); ``m`` counts each row's emitted items. Inputs (user
    embedding, block tables, lengths, timestamps, exclusions, the draft's window) are
    copied in by ``Generator.load`` so that a captured round reads them in place.
    """

    def __init__(
        self,
        rows: int,
        k: int,
        gamma: int,
        window: int,
        consumed: int,
        max_blocks: int,
        target: ModelGeometry,
        draft: ModelGeometry | None,
        device: torch.device,
    ) -> None:
        self.rows, self.k, self.gamma, self.window = rows, k, gamma, window
        self.cap = k + 2 * gamma + 1

        def longs(*shape: int, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.int64, device=device)

        self.emb = torch.zeros(rows, target.config.d_model, dtype=target.dtype, device=device)
        self.tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
        self.lens = longs(rows)
        self.last_ts = longs(rows)
        self.consumed = longs(rows, max(1, consumed), fill=-1)  # [R, E0]
        self.real = torch.zeros(rows, dtype=torch.bool, device=device)
        self.gen = longs(rows, self.cap)  # [R, cap]
        self.gen_scores = torch.zeros(rows, self.cap, dtype=torch.float32, device=device)
        self.m = longs(rows)
        self.t_kv, self.t_ts = target.scratch(rows, self.cap, device)
        self.proposed = longs()
        self.accepted = longs()
        # The draft's side (allocated empty without a draft).
        self.window_tokens = longs(rows, window + 1, 3)  # [R, W+1, 3]
        self.open_width = window + 1  # columns of window_tokens the opening call feeds
        self.window_lens = longs(rows, fill=1)
        self.draft = longs(rows, gamma)  # [R, γ] this round's proposals
        geometry = draft or target
        span = window + self.cap + 1 if draft is not None else 0
        self.d_kv, self.d_ts = geometry.scratch(rows if draft is not None else 0, span, device)
        self.d_pool = geometry.empty_pool(rows, device)

    # Per-row buffers and the axis of their rows (``take`` copies exactly these; a test
    # checks that every tensor with a row axis is listed).
    ROW_AXES = (("emb", 0), ("tables", 0), ("lens", 0), ("last_ts", 0), ("consumed", 0),
                ("real", 0), ("gen", 0), ("gen_scores", 0), ("m", 0), ("t_kv", 2), ("t_ts", 0),
                ("window_tokens", 0), ("window_lens", 0), ("draft", 0), ("d_kv", 2),
                ("d_ts", 0))  # fmt: skip

    def take(self, src: Workspace, rows: torch.Tensor) -> None:
        """Become ``src``'s rows ``rows`` [n] (n <= self.rows) mid-generation; the rows
        after them are padding that has finished (no cached keys, nothing to emit)."""
        n = rows.numel()
        for name, axis in self.ROW_AXES:
            dst, whole = getattr(self, name), getattr(src, name)
            if dst.numel() == 0:  # the draft's buffers without a draft
                continue
            dst.fill_(-1 if name == "consumed" else 0)
            dst.narrow(axis, 0, n).copy_(whole.index_select(axis, rows))
        self.m[n:] = self.k
        self.open_width = src.open_width
        self.proposed.zero_()
        self.accepted.zero_()

    def live(self) -> torch.Tensor:
        """Rows still generating: [R] bool."""
        return self.m < self.k

    def emitted(self, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Item rows a position must not emit again: consumed + emitted so far [R, E].

        With ``extra [R, Q, J]`` (a verified prefix per position) the result is
        [R, Q, E + J]: position q also excludes the prefix before it.
        """
        slots = torch.arange(self.cap, device=self.m.device)
        done = torch.where(slots < self.m.unsqueeze(1), self.gen, torch.full_like(self.gen, -1))
        base = torch.cat([self.consumed, done], dim=1)  # [R, E]
        if extra is None:
            return base
        return torch.cat([base.unsqueeze(1).expand(-1, extra.shape[1], -1), extra], dim=2)

    def last_emitted(self, back: int = 1) -> torch.Tensor:
        """The item emitted ``back`` steps ago per row: [R, 1]."""
        at = (self.m - back).clamp(min=0).unsqueeze(1)
        return self.gen.gather(1, at)
