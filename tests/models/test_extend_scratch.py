"""``extend_scratch``: tokens after the paged cache and a private scratch equal a full
recompute of history + scratch tokens, and nothing is written anywhere (fp32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from streamrec.models import scratch_extend as scratch_module
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.models.paged_attention import fused_token_attention
from tests.models.kernel_device import kernel_device
from tests.models.test_hstu import (
    REL_TOL,
    filled_cache,
    jagged,
    random_history,
    random_model,
    rel_err,
)


class Scratch:
    """Per-user scratch K/V as a generator keeps it: NaN wherever nothing was written."""

    def __init__(self, model: HSTU, users: int, span: int) -> None:
        cfg = model.config
        shape = (cfg.num_layers, 2, users, span, cfg.num_heads, cfg.head_dim)
        self.kv = torch.full(shape, float("nan"))
        self.ts = torch.full((users, span), -(2**40), dtype=torch.int64)
        self.lens = torch.zeros(users, dtype=torch.int64)

    def write(self, k: torch.Tensor, v: torch.Tensor, ts: torch.Tensor, counts: list[int]) -> None:
        """Write each user's first counts[b] new tokens after its scratch_lens[b]."""
        for b, n in enumerate(counts):
            at = int(self.lens[b])
            self.kv[:, 0, b, at : at + n] = k[:, b, :n]
            self.kv[:, 1, b, at : at + n] = v[:, b, :n]
            self.ts[b, at : at + n] = ts[b, :n]
            self.lens[b] += n


def padded(tokens: list[torch.Tensor], width: int) -> torch.Tensor:
    """Right-pad each user's tokens to ``width`` with garbage (item 1, action 2, ts 5)."""
    rows = []
    for t in tokens:
        pad = torch.tensor([1, 2, 5], dtype=torch.int64).expand(width - t.shape[0], 3)
        rows.append(torch.cat([t, pad]))
    return torch.stack(rows)  # [B, Q, 3]


@pytest.mark.parametrize("seed", range(5))
@torch.no_grad()
def test_scratch_tokens_equal_full_recompute(seed: int) -> None:
    model = random_model(300 + seed)
    cfg = model.config
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_users = rng.randint(2, 5)
    extra = [rng.randint(1, 6) for _ in range(num_users)]  # scratch tokens per user
    cached = [rng.randint(0, cfg.max_seq_len - n) for n in extra]
    cached[0] = 0  # a user with nothing cached reads no block-table entry
    block_size = rng.choice([1, 3, 4])
    hist = [random_history(cfg, c + n, gen) for c, n in zip(cached, extra)]
    cache = filled_cache(model, hist, cached, block_size, seed)
    tables, lens = cache.batch_tables()
    pool_before = (cache.kv.clone(), cache.ts.clone())
    scratch = Scratch(model, num_users, span=max(extra) + 2)

    done = [0] * num_users
    while done != extra:
        width = rng.randint(1, 3)
        counts = [min(width, n - d) for d, n in zip(done, extra)]  # fewer: padded rows
        rows = [
            torch.stack([h[i][c + d : c + d + n] for i in range(3)], dim=1)
            for h, c, d, n in zip(hist, cached, done, counts)
        ]
        batch = padded(rows, width)  # [B, Q, 3]
        k, v, emb = model.extend_scratch(
            batch[..., 0], batch[..., 1], batch[..., 2], cache.kv, cache.ts, tables, lens,
            scratch.kv, scratch.ts, scratch.lens,
        )  # fmt: skip
        assert k.shape == (cfg.num_layers, num_users, width, cfg.num_heads, cfg.head_dim)
        assert emb.shape == (num_users, width, cfg.d_model)
        for b, n in enumerate(counts):
            for r in range(n):  # token r of b against a recompute of everything up to it
                upto = cached[b] + done[b] + r + 1
                one = jagged([hist[b]], [upto], [0])
                k_ref, v_ref, z = model.prefill_states(*one)
                want = torch.nn.functional.normalize(z[-1], dim=-1)
                assert rel_err(emb[b, r], want) < REL_TOL
                assert rel_err(k[:, b, r], k_ref[:, -1]) < REL_TOL
                assert rel_err(v[:, b, r], v_ref[:, -1]) < REL_TOL
        scratch.write(k, v, batch[..., 2], counts)
        done = [d + n for d, n in zip(done, counts)]
    assert torch.equal(cache.kv.nan_to_num(7.0), pool_before[0].nan_to_num(7.0))
    assert torch.equal(cache.ts, pool_before[1])


@torch.no_grad()
def test_padding_tokens_and_stale_scratch_slots_change_nothing() -> None:
    model = random_model(7)
    cfg = model.config
    gen = torch.Generator().manual_seed(7)
    hist = [random_history(cfg, 10, gen) for _ in range(2)]
    cache = filled_cache(model, hist, [6, 8], block_size=4, seed=7)
    tables, lens = cache.batch_tables()
    scratch = Scratch(model, 2, span=6)
    scratch.kv[:, :, :, 1:].normal_()  # stale values past scratch_lens = 1 after the write
    rows = [torch.stack([h[i][c : c + 1] for i in range(3)], dim=1) for h, c in zip(hist, [6, 8])]
    first = padded(rows, 1)
    k, v, _ = model.extend_scratch(
        first[..., 0], first[..., 1], first[..., 2], cache.kv, cache.ts, tables, lens,
        scratch.kv, scratch.ts, scratch.lens,
    )  # fmt: skip
    scratch.write(k, v, first[..., 2], [1, 1])
    nxt = [
        torch.stack([h[i][c + 1 : c + 2] for i in range(3)], dim=1) for h, c in zip(hist, [6, 8])
    ]
    narrow = padded(nxt, 1)
    wide = padded(nxt, 4)  # the same token followed by 3 padding tokens
    _, _, emb_narrow = model.extend_scratch(
        narrow[..., 0], narrow[..., 1], narrow[..., 2], cache.kv, cache.ts, tables, lens,
        scratch.kv, scratch.ts, scratch.lens,
    )  # fmt: skip
    _, _, emb_wide = model.extend_scratch(
        wide[..., 0], wide[..., 1], wide[..., 2], cache.kv, cache.ts, tables, lens,
        scratch.kv, scratch.ts, scratch.lens,
    )  # fmt: skip
    assert rel_err(emb_wide[:, 0], emb_narrow[:, 0]) < REL_TOL
    for b, c in enumerate([6, 8]):  # stale slots 1.. of the scratch were never seen
        z = model.prefill_states(*jagged([hist[b]], [c + 2], [0]))[2]
        assert rel_err(emb_wide[b, 0], torch.nn.functional.normalize(z[-1], dim=-1)) < REL_TOL


@pytest.mark.gpu
@torch.no_grad()
def test_fused_attention_path_equals_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the op covers cache + new tokens and the scratch is added densely; the
    same on the CPU interpreter (``TRITON_INTERPRET=1``, the op forced on)."""
    device = kernel_device(monkeypatch)
    if device == "cpu":
        monkeypatch.setattr(
            scratch_module,
            "fused_attention_enabled",
            lambda backend, q, head_dim=None: backend != "torch",
        )
    cfg = HSTUConfig(
        num_items=50, d_model=32, num_layers=2, num_heads=2, head_dim=16, max_seq_len=40,
        num_time_buckets=8, task_hidden=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = HSTU(cfg).eval()
    for layer in model.layers:
        layer.pos_bias.normal_(0, 0.5)
        layer.time_bias.normal_(0, 0.5)
    gen = torch.Generator().manual_seed(0)
    lens = [0, 5, 17, 9]
    hist = [random_history(cfg, max(n, 1) + 8, gen) for n in lens]
    cache = filled_cache(model, hist, lens, block_size=4, seed=0)
    tables, cached = cache.batch_tables()
    scratch = Scratch(model, len(lens), span=6)
    scratch.kv.normal_()
    scratch.ts.fill_(1_700_000_000_000)
    scratch.lens = torch.tensor([2, 0, 6, 3])
    rows = [torch.stack([h[i][n : n + 3] for i in range(3)], dim=1) for h, n in zip(hist, lens)]
    batch = padded(rows, 3)
    model = model.to(device)
    args = [t.to(device) for t in (batch[..., 0], batch[..., 1], batch[..., 2], cache.kv,
            cache.ts, tables, cached, scratch.kv, scratch.ts, scratch.lens)]  # fmt: skip
    model.attention_backend = "torch"
    want = model.extend_scratch(*args)
    model.attention_backend = "auto"
    calls = []
    monkeypatch.setattr(
        scratch_module, "fused_token_attention",
        lambda *a: calls.append(1) or fused_token_attention(*a),
    )  # fmt: skip
    got = model.extend_scratch(*args)
    assert len(calls) == cfg.num_layers  # the op really ran
    for g, w in zip(got, want, strict=True):
        assert rel_err(g.cpu(), w.cpu()) < 1e-5
