"""Exactness of incremental inference (issue 3, acceptance 1): fp32 on CPU."""

from __future__ import annotations

import random

import pytest
import torch

from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.schemas.events import NUM_ACTIONS, Action
from tests.models.paged import FakePagedCache

REL_TOL = 1e-5


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp(min=1e-12))


def random_model(seed: int) -> HSTU:
    rng = random.Random(seed)
    cfg = HSTUConfig(
        num_items=rng.randint(20, 60),
        num_oov_buckets=rng.randint(1, 4),
        d_model=rng.choice([8, 16, 24]),
        num_layers=rng.randint(1, 3),
        num_heads=rng.randint(1, 3),
        head_dim=rng.choice([4, 8]),
        max_seq_len=rng.choice([16, 24, 32]),
        num_time_buckets=rng.randint(4, 12),
        task_hidden=8,
    )
    torch.manual_seed(seed)
    model = HSTU(cfg).eval()
    with torch.no_grad():  # non-zero biases so rab matters in every comparison
        for layer in model.layers:
            layer.pos_bias.normal_(0, 0.5)
            layer.time_bias.normal_(0, 0.5)
    return model


def random_history(cfg: HSTUConfig, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    items = torch.randint(1, cfg.num_items, (n,), generator=gen)
    actions = torch.randint(1, NUM_ACTIONS, (n,), generator=gen)
    gaps = torch.randint(0, 10**7, (n,), generator=gen)
    ts = 1_700_000_000_000 + torch.cumsum(gaps, 0)
    return items, actions, ts


def jagged(histories: list[tuple[torch.Tensor, ...]], lens: list[int], start: list[int]):
    """Concatenate tokens start[b] .. start[b]+lens[b] of every user."""
    parts = [tuple(t[s : s + n] for t in h) for h, s, n in zip(histories, start, lens)]
    items, actions, ts = (torch.cat([p[i] for p in parts]) for i in range(3))
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    return items, actions, ts, offsets


@pytest.mark.parametrize("seed", range(6))
@torch.no_grad()
def test_extend_equals_prefill(seed: int) -> None:
    model = random_model(seed)
    cfg = model.config
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    block_size = rng.choice([1, 3, 4, 8])
    num_users = rng.randint(2, 6)
    full = [rng.randint(1, cfg.max_seq_len) for _ in range(num_users)]
    full[0] = cfg.max_seq_len  # the longest allowed history
    full[1] = block_size * rng.randint(1, cfg.max_seq_len // block_size)  # block boundary
    hist = [random_history(cfg, n, gen) for n in full]
    prefix = [rng.randint(0, n) for n in full]
    prefix[1] = block_size * rng.randint(0, full[1] // block_size)
    prefix[-1] = 0  # a user with nothing cached
    cache = FakePagedCache(
        model,
        num_blocks=num_users * (cfg.max_seq_len // block_size + 2),
        block_size=block_size,
        seed=seed,
    )
    cache.add_users(num_users)

    items, actions, ts, offsets = jagged(hist, prefix, [0] * num_users)
    if items.numel():
        k, v, _ = model.prefill(items, actions, ts, offsets)
        slots = [s for b in range(num_users) for s in cache.slots(b, prefix[b])]
        cache.write(slots, k, v, ts)

    done = list(prefix)
    while done != full:
        step = [min(n - d, rng.choice([0, 1, 1, 2, 5])) for d, n in zip(done, full)]
        if not any(step):
            continue
        items, actions, ts, offsets = jagged(hist, step, done)
        tables, lens = cache.batch_tables()
        k_new, v_new, user_emb = model.extend(
            items, actions, ts, offsets, cache.kv, cache.ts, tables, lens
        )
        slots = [s for b in range(num_users) for s in cache.slots(b, step[b])]
        cache.write(slots, k_new, v_new, ts)
        done = [d + s for d, s in zip(done, step)]
        moved = [b for b in range(num_users) if step[b]]
        ref = model.prefill(
            *jagged([hist[b] for b in moved], [done[b] for b in moved], [0] * len(moved))
        )[2]
        assert rel_err(user_emb[moved], ref) < REL_TOL
        idle = [b for b in range(num_users) if not step[b]]
        assert torch.equal(user_emb[idle], torch.zeros_like(user_emb[idle]))

    k_ref, v_ref, _ = model.prefill(*jagged(hist, full, [0] * num_users))
    slots = []
    for b in range(num_users):
        for p in range(full[b]):
            slots.append(cache.tables[b][p // block_size] * block_size + p % block_size)
    lyr, _, nb, bs, h, d = cache.kv.shape
    idx = torch.tensor(slots)
    assert rel_err(cache.kv[:, 0].reshape(lyr, nb * bs, h, d)[:, idx], k_ref) < REL_TOL
    assert rel_err(cache.kv[:, 1].reshape(lyr, nb * bs, h, d)[:, idx], v_ref) < REL_TOL


@pytest.mark.parametrize("seed", range(3))
@torch.no_grad()
def test_multi_token_extend_equals_prefill(seed: int) -> None:
    """Backlogs: 1..40 new tokens per user in one call, users with none in the same
    batch, block boundaries crossed inside a call; each step equals a full recompute."""
    rng = random.Random(300 + seed)
    cfg = HSTUConfig(
        num_items=60, d_model=16, num_layers=2, num_heads=2, head_dim=8, max_seq_len=128,
        num_time_buckets=10, task_hidden=8,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = HSTU(cfg).eval()
    for layer in model.layers:
        layer.pos_bias.normal_(0, 0.5)
        layer.time_bias.normal_(0, 0.5)
    gen = torch.Generator().manual_seed(seed)
    block_size = rng.choice([4, 8, 16])
    num_users = 5
    hist = [random_history(cfg, cfg.max_seq_len, gen) for _ in range(num_users)]
    cache = FakePagedCache(
        model, num_blocks=num_users * (cfg.max_seq_len // block_size + 2),
        block_size=block_size, seed=seed,
    )  # fmt: skip
    cache.add_users(num_users)
    done = [0, 1, block_size, 7, 0]
    items, actions, ts, offsets = jagged(hist, done, [0] * num_users)
    k, v, _ = model.prefill(items, actions, ts, offsets)
    cache.write([s for b in range(num_users) for s in cache.slots(b, done[b])], k, v, ts)
    plans = [[40, 0, 1, 17, 33], [1, 40, 0, 2, 40], [0, 16, 40, 1, 5], [3, 0, 0, 40, 1]]
    for plan in plans:
        step = [min(n, cfg.max_seq_len - d) for n, d in zip(plan, done)]
        items, actions, ts, offsets = jagged(hist, step, done)
        tables, lens = cache.batch_tables()
        k_new, v_new, user_emb = model.extend(
            items, actions, ts, offsets, cache.kv, cache.ts, tables, lens
        )
        slots = [s for b in range(num_users) for s in cache.slots(b, step[b])]
        cache.write(slots, k_new, v_new, ts)
        done = [d + n for d, n in zip(done, step)]
        moved = [b for b in range(num_users) if step[b]]
        items, actions, ts, offsets = jagged(
            [hist[b] for b in moved], [done[b] for b in moved], [0] * len(moved)
        )
        k_ref, _, emb_ref = model.prefill(items, actions, ts, offsets)
        assert rel_err(user_emb[moved], emb_ref) < REL_TOL
        idle = [b for b in range(num_users) if not step[b]]
        assert torch.equal(user_emb[idle], torch.zeros_like(user_emb[idle]))
        # the new tokens' keys are the recompute's keys at the same positions
        ends = torch.tensor([done[b] for b in moved]).cumsum(0)
        new_rows = torch.cat([torch.arange(e - step[b], e) for e, b in zip(ends.tolist(), moved)])
        assert rel_err(k_new, k_ref[:, new_rows]) < REL_TOL


@torch.no_grad()
def test_extend_ignores_padding_tokens_past_the_offsets() -> None:
    """GraphedModel pads a batch with tokens past offsets[-1] (they fall to the last
    user, after its own): the real users' outputs do not change."""
    model = random_model(11)
    cfg = model.config
    gen = torch.Generator().manual_seed(11)
    lens = [3, 0, 2]
    hist = [random_history(cfg, 8, gen) for _ in lens]
    cache = FakePagedCache(model, num_blocks=12, block_size=4, seed=11)
    cache.add_users(len(lens))
    items, actions, ts, offsets = jagged(hist, lens, [0] * len(lens))
    tables, cached = cache.batch_tables()
    want = model.extend(items, actions, ts, offsets, cache.kv, cache.ts, tables, cached)
    pad = torch.zeros(3, dtype=torch.int64)
    got = model.extend(
        torch.cat([items, pad + 1]), torch.cat([actions, pad + 1]), torch.cat([ts, pad]),
        offsets, cache.kv, cache.ts, tables, cached,
    )  # fmt: skip
    n = items.shape[0]
    assert rel_err(got[0][:, :n], want[0]) < 1e-6 and rel_err(got[1][:, :n], want[1]) < 1e-6
    assert rel_err(got[2], want[2]) < 1e-6


def filled_cache(model: HSTU, hist, lens, block_size: int, seed: int) -> FakePagedCache:
    """A cache holding a full recompute (prefill) of the first lens[b] tokens of each user."""
    cfg = model.config
    cache = FakePagedCache(
        model,
        num_blocks=len(lens) * (cfg.max_seq_len // block_size + 2),
        block_size=block_size,
        seed=seed,
    )
    cache.add_users(len(lens))
    items, actions, ts, offsets = jagged(hist, lens, [0] * len(lens))
    if items.numel():
        k, v, _ = model.prefill(items, actions, ts, offsets)
        cache.write([s for b, n in enumerate(lens) for s in cache.slots(b, n)], k, v, ts)
    return cache


@pytest.mark.parametrize("seed", range(4))
@torch.no_grad()
def test_rank_reads_cache_only_and_matches_full_recompute(seed: int) -> None:
    model = random_model(100 + seed)
    cfg = model.config
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [rng.randint(0, cfg.max_seq_len - 1) for _ in range(4)]
    lens[0] = 0
    hist = [random_history(cfg, max(n, 1), gen) for n in lens]
    # Cache built incrementally (one extend per token) vs in one prefill, different layouts.
    inc = FakePagedCache(model, num_blocks=4 * cfg.max_seq_len, block_size=3, seed=seed)
    inc.add_users(len(lens))
    for p in range(max(lens)):
        step = [1 if p < n else 0 for n in lens]
        items, actions, ts, offsets = jagged(hist, step, [p] * len(lens))
        tables, cl = inc.batch_tables()
        k, v, _ = model.extend(items, actions, ts, offsets, inc.kv, inc.ts, tables, cl)
        inc.write([s for b in range(len(lens)) for s in inc.slots(b, step[b])], k, v, ts)
    full = filled_cache(model, hist, lens, block_size=4, seed=seed + 1)

    n_cand = rng.randint(1, 5)
    cand = torch.randint(cfg.first_item_row, cfg.num_items, (len(lens), n_cand), generator=gen)
    query_ts = torch.stack([h[2][max(n - 1, 0)] for h, n in zip(hist, lens)])
    before = (inc.kv.clone(), inc.ts.clone())
    scores_inc = model.rank(cand, query_ts, inc.kv, inc.ts, *inc.batch_tables())
    scores_full = model.rank(cand, query_ts, full.kv, full.ts, *full.batch_tables())
    assert scores_inc.shape == (len(lens), n_cand, cfg.num_tasks)
    assert ((scores_inc > 0) & (scores_inc < 1)).all()
    assert rel_err(scores_inc, scores_full) < REL_TOL
    assert torch.equal(inc.kv.nan_to_num(7.0), before[0].nan_to_num(7.0))
    assert torch.equal(inc.ts, before[1])

    # Independent check: a candidate is the history plus one CANDIDATE token, recomputed.
    for b, n in enumerate(lens):
        for c in range(n_cand):
            items = torch.cat([hist[b][0][:n], cand[b, c : c + 1]])
            actions = torch.cat([hist[b][1][:n], torch.tensor([int(Action.CANDIDATE)])])
            ts = torch.cat([hist[b][2][:n], query_ts[b : b + 1]])
            z = model.prefill_states(items, actions, ts, torch.tensor([0, n + 1]))[2]
            want = torch.sigmoid(model.task_head(z[-1]))
            assert rel_err(scores_inc[b, c], want) < REL_TOL


@pytest.mark.parametrize("seed", range(3))
@torch.no_grad()
def test_later_tokens_never_change_earlier_outputs(seed: int) -> None:
    model = random_model(200 + seed)
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    n = cfg.max_seq_len
    items, actions, ts = random_history(cfg, n, gen)
    offsets = torch.tensor([0, n])
    k, v, z = model.prefill_states(items, actions, ts, offsets)
    cut = n // 2
    items2, actions2, ts2 = items.clone(), actions.clone(), ts.clone()
    items2[cut:] = (items2[cut:] % (cfg.num_items - 1)) + 1
    actions2[cut:] = (actions2[cut:] % (NUM_ACTIONS - 1)) + 1
    ts2[cut:] += 12345
    k2, v2, z2 = model.prefill_states(items2, actions2, ts2, offsets)
    torch.testing.assert_close(k2[:, :cut], k[:, :cut], rtol=0, atol=0)
    torch.testing.assert_close(v2[:, :cut], v[:, :cut], rtol=0, atol=0)
    torch.testing.assert_close(z2[:cut], z[:cut], rtol=0, atol=0)
    assert not torch.allclose(z2[cut:], z[cut:])


@torch.no_grad()
def test_users_in_a_batch_do_not_see_each_other() -> None:
    model = random_model(7)
    cfg = model.config
    gen = torch.Generator().manual_seed(7)
    lens = [3, 1, cfg.max_seq_len, 5]
    hist = [random_history(cfg, n, gen) for n in lens]
    k, v, emb = model.prefill(*jagged(hist, lens, [0] * 4))
    start = 0
    for b, n in enumerate(lens):
        kb, vb, eb = model.prefill(*jagged([hist[b]], [n], [0]))
        assert rel_err(k[:, start : start + n], kb) < REL_TOL
        assert rel_err(v[:, start : start + n], vb) < REL_TOL
        assert rel_err(emb[b : b + 1], eb) < REL_TOL
        torch.testing.assert_close(eb.norm(dim=-1), torch.ones(1))
        start += n


@torch.no_grad()
def test_retrieve_skips_padding_oov_and_excluded_rows() -> None:
    model = random_model(3)
    cfg = model.config
    user = torch.nn.functional.normalize(torch.randn(2, cfg.d_model), dim=-1)
    table = model.item_table()
    # Excluding user 0's best retrievable row pushes it out of the top k - 1.
    best = int((user[0] @ table.t())[cfg.first_item_row :].argmax()) + cfg.first_item_row
    exclude = torch.tensor([[best, -1], [-1, -1]])
    k = cfg.num_items - cfg.first_item_row
    scores, idx = model.retrieve(user, k, exclude)
    assert idx.shape == (2, k)
    assert (idx[1] >= cfg.first_item_row).all()
    assert sorted(idx[1].tolist()) == list(range(cfg.first_item_row, cfg.num_items))
    assert best not in idx[0, : k - 1].tolist()
    assert scores[0, -1] == float("-inf")
    assert torch.all(scores[1, :-1] >= scores[1, 1:])
    torch.testing.assert_close(scores[1], (user[1] @ table.t())[idx[1]])


@torch.no_grad()
def test_prefill_width_changes_cost_not_results() -> None:
    """Rows as wide as the longest history (rounded to 64) give the max_seq_len result."""
    cfg = HSTUConfig(
        num_items=50, d_model=16, num_layers=2, num_heads=2, head_dim=8, max_seq_len=256,
        num_time_buckets=8, task_hidden=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = HSTU(cfg).eval()
    for layer in model.layers:
        layer.pos_bias.normal_(0, 0.5)
        layer.time_bias.normal_(0, 0.5)
    gen = torch.Generator().manual_seed(0)
    lens = [1, 40, 7, 65]
    hist = [random_history(cfg, n, gen) for n in lens]
    items, actions, ts, offsets = jagged(hist, lens, [0] * len(lens))
    assert model.dense_width(offsets) == 128  # longest 65, rounded up to 64s
    assert model.dense_width(offsets[:3]) == 64
    tight = model.prefill_states(items, actions, ts, offsets)
    full = model.prefill_states(items, actions, ts, offsets, width=cfg.max_seq_len)
    for got, want in zip(tight, full, strict=True):
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("fused_layers", [False, True])
@torch.no_grad()
def test_fused_extend_and_rank_equal_the_torch_path(monkeypatch, fused_layers: bool) -> None:
    """The model through the fused kernels (attention and layer halves; CUDA, or the
    Triton CPU interpreter with the switches forced) equals its torch path: multi-token
    extends with idle users, then rank over the cache they built, fp32. ``rank`` hands
    the candidate kernel its projection before the SiLU, or after it with the fused layer
    halves."""
    from streamrec.models import hstu as hstu_module
    from tests.models.kernel_device import kernel_device

    device = kernel_device(monkeypatch)
    if device == "cpu":  # the interpreter: force the switches that want CUDA tensors
        # (the torch-backend model must keep its torch path: it is the reference)
        monkeypatch.setattr(
            hstu_module, "fused_attention_enabled", lambda backend, *a: backend != "torch"
        )
        monkeypatch.setattr(hstu_module.HSTULayer, "fusable", lambda self, x: True)
    cfg = HSTUConfig(
        num_items=60, d_model=64, num_layers=2, num_heads=2, head_dim=32, max_seq_len=64,
        num_time_buckets=10, task_hidden=8,
    )  # fmt: skip
    torch.manual_seed(0)
    fused = HSTU(cfg, fused_layers=fused_layers).eval()
    for layer in fused.layers:
        layer.pos_bias.normal_(0, 0.5)
        layer.time_bias.normal_(0, 0.5)
    plain = HSTU(cfg, attention_backend="torch").eval()
    plain.load_state_dict(fused.state_dict())
    gen = torch.Generator().manual_seed(0)
    num_users = 4
    hist = [random_history(cfg, cfg.max_seq_len, gen) for _ in range(num_users)]
    cache = FakePagedCache(fused, num_blocks=num_users * 10, block_size=8, seed=0)
    cache.add_users(num_users)
    done = [0] * num_users
    for plan in ([5, 0, 1, 20], [1, 9, 0, 17], [0, 20, 3, 1]):
        items, actions, ts, offsets = jagged(hist, plan, done)
        tables, lens = cache.batch_tables()
        args = (items, actions, ts, offsets, cache.kv, cache.ts, tables, lens)
        want = plain.extend(*args)
        got = fused.to(device).extend(*(a.to(device) for a in args))
        for g, w in zip(got, want, strict=True):
            assert rel_err(g.cpu(), w) < REL_TOL
        cache.write([s for b in range(num_users) for s in cache.slots(b, plan[b])], *want[:2], ts)
        done = [d + n for d, n in zip(done, plan)]
    # GraphedModel's padding: tokens past offsets[-1] fall to the last user, after its own
    items, actions, ts, offsets = jagged(hist, [2, 0, 1, 0], done)
    pad = torch.ones(3, dtype=torch.int64)
    tables, lens = cache.batch_tables()
    args = (torch.cat([items, pad]), torch.cat([actions, pad]), torch.cat([ts, pad * 0]))
    args += (offsets, cache.kv, cache.ts, tables, lens)
    want_emb = plain.extend(*args)[2]
    assert rel_err(fused.extend(*(a.to(device) for a in args))[2].cpu(), want_emb) < REL_TOL
    cand = torch.randint(cfg.first_item_row, cfg.num_items, (num_users, 6), generator=gen)
    query_ts = torch.stack([h[2][max(n - 1, 0)] for h, n in zip(hist, done)])
    tables, lens = cache.batch_tables()
    args = (cand, query_ts, cache.kv, cache.ts, tables, lens)
    want_r = plain.rank(*args)
    got_r = fused.rank(*(a.to(device) for a in args))
    assert rel_err(got_r.cpu(), want_r) < REL_TOL
