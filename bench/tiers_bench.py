"""Catalogs and user populations beyond GPU memory, on the H200 (issue 20).

Two sections, each guarded so a failure in one still writes the other's rows:

``embedding``: a catalog of ``--items`` (20M) bf16 rows of D=512 (~20 GB), generated on
  the GPU and copied to pageable host memory once; item popularity is Zipf(``--zipf``).
  One step = HSTU-8L ``extend`` of one new event per user (B=64, history 2,048, paged
  cache) + retrieval over the retrievable set (the 1M most popular items) + ``rank`` of
  256 candidates per user; the new events' items and the candidates are Zipf draws (what
  a popularity-skewed model retrieves), the same draws for every row. The GPU part is two
  CUDA graphs (extend + retrieve, rank), the fastest path, so the cache's host work is
  the largest share it can be. Rows: the all-GPU table, then the embedding cache at
  several slot counts (warmed up first): hit rate, step p50, cost vs all-GPU, bytes
  copied per step, and whether the task scores are bitwise those of the all-GPU table.
  Then serving's path where the cache has room for the retrievable set (``ItemCatalog``
  pins its members): the candidates are the retrieved members, their slots come from a
  device table (no device -> host round trip), against the all-GPU table ranking the same
  retrieved members (rows ``embedding cache, set pinned``).
  Plus exact retrieval over all 20M rows vs over the retrievable set.
  Target: at a 90 % hit rate the step costs <= 10 % more than with the all-GPU table.

``disk``: HSTU-8L users of 2,048 tokens (32 MB of K/V each) through GPU -> host -> disk
  and back via the serving ``ModelStep`` (B=1 steps, 256 candidates): disk -> GPU onload
  GB/s (page cache and cold, after ``posix_fadvise(DONTNEED)``), and the step time of a
  GPU hit, a prefetched disk hit, a disk hit read inside the step (cold) and a miss
  (prefill of the whole history). Target: a disk hit costs <= 1/5 of a prefill. The disk
  tier has its default device slots (``DiskTier(device_slots=4)``): a read holding one is
  copied to the GPU as it lands, so its step only scatters device -> device; the rows say
  how many of their hits were so device-staged (the 12-user onload: at most 4 of them).

    python3 -m bench.tiers_bench [--out DIR]          # H200, ~2 min
    .venv/bin/python -m bench.tiers_bench --smoke     # CPU, tiny shapes, checks the code

Writes ``bench/results/h200_tiers.json`` (``cpu_tiers_smoke.json`` with ``--smoke``) and a
copy in ``--out`` / ``$OUT`` when set; prints the tables last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench._report import print_table, write_results
from bench.tiers_disk import disk_section
from bench.tiers_shape import BASE_TS, BLOCK, H200, SMOKE, Rows, Shape, captured, sync, tier_model
from streamrec.cache.block_pool import NoRoom
from streamrec.cache.embedding_cache import EmbeddingCache
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.retrieval_set import RetrievalSet
from streamrec.models.hstu import HSTU
from streamrec.pipeline.item_catalog import ItemCatalog, retrieve_members, retrieve_set_rows


class Zipf:
    """Item rows with Zipf(s) popularity; rank r -> row by a fixed bijection (scattered)."""

    def __init__(self, items: int, first: int, s: float, seed: int) -> None:
        self.n = items - first
        self.first = first
        weights = np.arange(1, self.n + 1, dtype=np.float64) ** -s
        self.cdf = np.cumsum(weights)
        self.cdf /= self.cdf[-1]
        self.rng = np.random.default_rng(seed)
        self.mult = 2_654_435_761 % self.n or 1
        while np.gcd(self.mult, self.n) != 1:
            self.mult += 1

    def rows(self, ranks: np.ndarray) -> np.ndarray:
        return self.first + (ranks.astype(np.int64) * self.mult) % self.n

    def sample(self, shape: tuple[int, ...]) -> np.ndarray:
        ranks = np.searchsorted(self.cdf, self.rng.random(shape))
        return self.rows(np.minimum(ranks, self.n - 1))


class PagedUsers:
    """B users with ``history`` cached tokens each (random K/V) and one new slot each."""

    def __init__(self, shape: Shape, model: HSTU, device: torch.device) -> None:
        cfg = model.config
        dtype = next(model.parameters()).dtype
        geo = KVCacheConfig(cfg.num_layers, cfg.num_heads, cfg.head_dim, BLOCK, dtype)
        per_user = -(-(shape.history + 1) // BLOCK)
        self.cache = KVCache(geo, shape.batch * per_user + 4, device)
        users = [f"u{i}" for i in range(shape.batch)]
        for u in users:
            assert not isinstance(self.cache.pool.append(u, shape.history + 1), NoRoom)
        self.cache.kv.normal_(0, 1)
        self.cache.ts.copy_(BASE_TS + torch.arange(self.cache.ts.numel()).view_as(self.cache.ts))
        self.tables, lens = self.cache.batch_tables(users)
        self.lens, self.ext_lens = lens, lens - 1
        last = [
            self.cache.pool.block_table(u)[shape.history // BLOCK] * BLOCK + shape.history % BLOCK
            for u in users
        ]
        self.new_slots = torch.tensor(last, dtype=torch.int64, device=device)  # [B]
        self.actions = torch.ones(shape.batch, dtype=torch.int64, device=device)
        self.ts = torch.full((shape.batch,), BASE_TS + 10**9, dtype=torch.int64, device=device)
        self.offsets = torch.arange(shape.batch + 1, dtype=torch.int64, device=device)

    def extend_one(self, model: HSTU, items: torch.Tensor) -> torch.Tensor:
        """``extend`` of one new event per user (items [B]) and its KV write: user_emb."""
        c = self.cache
        k, v, emb = model.extend(
            items, self.actions, self.ts, self.offsets, c.kv, c.ts, self.tables, self.ext_lens
        )
        c.write(self.new_slots, k, v, self.ts)
        return emb


# ------------------------------------------------------------------ embedding section


def embedding_section(shape: Shape, device: torch.device, zipf_s: float, rows: Rows) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = tier_model(shape, device, dtype)
    first = model.config.first_item_row
    start = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(1)
    table = torch.randn(shape.items, shape.dim, device=device, dtype=dtype, generator=gen)
    table.mul_(shape.dim**-0.5)  # [V, D] the all-GPU table
    host = table.cpu()  # pageable: the cache needs no pinned table
    print(f"catalog {shape.items:,} x {shape.dim} {dtype}: {host.nbytes / 1e9:.1f} GB, "
          f"made in {time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
    zipf = Zipf(shape.items, first, zipf_s, seed=2)
    popular = zipf.rows(np.arange(shape.retrievable))
    rset = RetrievalSet(host, device, shape.retrievable, first, initial=popular)
    users = PagedUsers(shape, model, device)
    new_items = [zipf.sample((shape.batch,)) for _ in range(shape.steps)]
    cands = [zipf.sample((shape.batch, shape.cands)) for _ in range(shape.steps)]
    no_exclude = rset.excluded_rows(np.zeros((shape.batch, 0), dtype=np.int64))  # [B, 1]
    items_buf = torch.zeros(shape.batch, dtype=torch.int64, device=device)
    cands_buf = torch.zeros(shape.batch, shape.cands, dtype=torch.int64, device=device)
    c = users.cache

    def front() -> torch.Tensor:  # extend + KV write + retrieval over the set
        emb = users.extend_one(model, items_buf)
        return retrieve_members(rset, emb, shape.cands, no_exclude)[1]

    def back() -> torch.Tensor:
        return model.rank(cands_buf, users.ts, c.kv, c.ts, users.tables, users.lens)

    def run(cache: EmbeddingCache | None) -> tuple[list[float], list[torch.Tensor], int, int]:
        """Timed steps: (ms, task scores, lookups, misses) of the timed steps only."""
        model.use_item_rows(table if cache is None else cache.rows)

        def ids(items: np.ndarray) -> np.ndarray:
            return items if cache is None else cache.slots(items)

        with torch.inference_mode():
            items_buf.copy_(torch.from_numpy(ids(new_items[0])))  # valid ids for the capture
            cands_buf.copy_(torch.from_numpy(ids(cands[0])))
            calls = captured(front, back, device)
            before = None if cache is None else cache.stats()
            times, probs = [], []
            for i in range(shape.steps):
                sync(device)
                t0 = time.perf_counter()
                items_buf.copy_(torch.from_numpy(ids(new_items[i])))
                retrieved = calls[0]()
                if cache is not None:
                    retrieved.cpu()  # the serving path's round trip: retrieved rows -> slots
                cands_buf.copy_(torch.from_numpy(ids(cands[i])))
                result = calls[1]()
                sync(device)
                times.append((time.perf_counter() - t0) * 1000)
                probs.append(result.float().cpu())
        if cache is None or before is None:
            return times, probs, 0, 0
        after = cache.stats()
        return times, probs, after.lookups - before.lookups, after.misses - before.misses

    base_ms, base_probs, _, _ = run(None)
    base = float(np.median(base_ms[2:]))
    rows.append({"section": "embedding", "mode": "all-GPU table", "slots": shape.items,
                 "hit_rate": 1.0, "step_p50_ms": round(base, 3), "vs_all_gpu": 1.0,
                 "mb_copied_per_step": 0.0, "identical": True})  # fmt: skip
    for fraction in shape.slot_fractions:
        slots = int(shape.items * fraction)
        cache = EmbeddingCache(host, device, num_slots=slots)
        warm = time.perf_counter()
        chunk = max(1, min(slots // 2, 1 << 20))
        for _ in range(max(4, 2 * slots // chunk)):
            cache.slots(zipf.sample((chunk,)))  # reach the steady state before timing
        warm_s = time.perf_counter() - warm
        ms, probs, lookups, misses = run(cache)
        p50 = float(np.median(ms[2:]))
        same = all(torch.equal(a, b) for a, b in zip(probs, base_probs, strict=True))
        rows.append({"section": "embedding", "mode": "embedding cache", "slots": slots,
                     "slot_fraction": fraction, "hit_rate": round(1 - misses / lookups, 4),
                     "step_p50_ms": round(p50, 3), "vs_all_gpu": round(p50 / base, 4),
                     "mb_copied_per_step": round(misses * cache.row_bytes / shape.steps / 1e6, 3),
                     "identical": same, "warm_s": round(warm_s, 1)})  # fmt: skip
        print(rows[-1], flush=True)
        del cache
    model.use_item_rows(table)
    rows.append(_at_hit_rate(rows, 0.9))
    _pinned_rows(shape, model, table, host, rset, users, zipf, new_items, no_exclude, rows)
    _retrieval_rows(shape, device, table, rset, rows)


def _pinned_rows(
    shape: Shape, model: HSTU, table: torch.Tensor, host: torch.Tensor, rset: RetrievalSet,
    users: PagedUsers, zipf: Zipf, new_items: list[np.ndarray], no_exclude: torch.Tensor,
    rows: Rows,
) -> None:  # fmt: skip
    """Serving's path when the cache has room for the retrievable set (ItemCatalog pins
    its members): the candidates are the retrieved members, their slots come from the
    device table, so only the new events' items go through the host. Baseline: the
    all-GPU table ranking the same retrieved members."""
    device = table.device
    c = users.cache
    items_buf = torch.zeros(shape.batch, dtype=torch.int64, device=device)
    rows_buf = torch.ones(shape.batch, shape.cands, dtype=torch.int64, device=device)

    def front() -> torch.Tensor:  # extend + KV write + retrieval rows of the set
        return retrieve_set_rows(rset, users.extend_one(model, items_buf), shape.cands,
                                 no_exclude)[1]  # fmt: skip

    def run(catalog: ItemCatalog | None) -> tuple[list[float], list[torch.Tensor]]:
        model.use_item_rows(table if catalog is None else catalog.embeddings.rows)
        row_map = rset.items if catalog is None else catalog.row_slots  # set row -> model row
        assert row_map is not None

        def back() -> torch.Tensor:
            return model.rank(row_map[rows_buf], users.ts, c.kv, c.ts, users.tables, users.lens)

        def ids(items: np.ndarray) -> np.ndarray:
            return items if catalog is None else catalog.slots(items)

        with torch.inference_mode():
            items_buf.copy_(torch.from_numpy(ids(new_items[0])))
            calls = captured(front, back, device)
            times, probs = [], []
            for i in range(shape.steps):
                sync(device)
                t0 = time.perf_counter()
                items_buf.copy_(torch.from_numpy(ids(new_items[i])))
                rows_buf.copy_(calls[0]())  # on the device: no round trip
                result = calls[1]()
                sync(device)
                times.append((time.perf_counter() - t0) * 1000)
                probs.append(result.float().cpu())
        return times, probs

    base_ms, base_probs = run(None)
    base = float(np.median(base_ms[2:]))
    rows.append({"section": "embedding", "mode": "all-GPU table, retrieved candidates",
                 "slots": shape.items, "hit_rate": 1.0, "step_p50_ms": round(base, 3),
                 "vs_all_gpu": 1.0, "identical": True})  # fmt: skip
    print(rows[-1], flush=True)
    for fraction in shape.slot_fractions:
        slots = int(shape.items * fraction)
        if slots - shape.retrievable < 4 * shape.batch:
            continue  # no room to pin the set: the host-lookup rows above are the path
        cache = EmbeddingCache(host, device, num_slots=slots)
        catalog = ItemCatalog(cache, rset, min_free_slots=4 * shape.batch)
        chunk = max(1, min(slots // 2, 1 << 20))
        for _ in range(max(4, 2 * slots // chunk)):
            cache.slots(zipf.sample((min(chunk, slots - shape.retrievable - 1),)))
        before = cache.stats()
        ms, probs = run(catalog)
        after = cache.stats()
        p50 = float(np.median(ms[2:]))
        lookups, misses = after.lookups - before.lookups, after.misses - before.misses
        same = all(torch.equal(a, b) for a, b in zip(probs, base_probs, strict=True))
        rows.append({"section": "embedding", "mode": "embedding cache, set pinned",
                     "slots": slots, "slot_fraction": fraction,
                     "new_item_hit_rate": round(1 - misses / max(lookups, 1), 4),
                     "step_p50_ms": round(p50, 3), "vs_all_gpu": round(p50 / base, 4),
                     "mb_copied_per_step": round(misses * cache.row_bytes / shape.steps / 1e6, 3),
                     "identical": same})  # fmt: skip
        print(rows[-1], flush=True)
        del catalog, cache
    model.use_item_rows(table)


def _at_hit_rate(rows: Rows, target: float) -> dict[str, Any]:
    """Step cost vs the all-GPU table at ``target`` hit rate, interpolated between rows."""
    points = sorted(
        (r["hit_rate"], r["vs_all_gpu"]) for r in rows if r.get("mode") == "embedding cache"
    )
    below = [p for p in points if p[0] < target]
    above = [p for p in points if p[0] >= target]
    if not above or not below:
        cost = above[0][1] if above else float("nan")
    else:
        (h0, c0), (h1, c1) = below[-1], above[0]
        cost = c0 + (c1 - c0) * (target - h0) / (h1 - h0)
    return {"section": "embedding", "mode": f"at {target:.0%} hit rate (interpolated)",
            "hit_rate": target, "vs_all_gpu": round(cost, 4)}  # fmt: skip


def _retrieval_rows(
    shape: Shape, device: torch.device, table: torch.Tensor, rset: RetrievalSet, rows: Rows
) -> None:
    user = torch.nn.functional.normalize(
        torch.randn(shape.batch, shape.dim, device=device, dtype=table.dtype), dim=-1
    )
    none = rset.excluded_rows(np.zeros((shape.batch, 0), dtype=np.int64))
    for name, fn in (
        ("exact, all rows", lambda: torch.topk(user @ table.t(), shape.cands, dim=1)),
        ("retrievable set", lambda: retrieve_members(rset, user, shape.cands, none)),
    ):
        with torch.inference_mode():
            fn()
            sync(device)
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            sync(device)
        ms = (time.perf_counter() - t0) / 5 * 1000
        n = shape.items if name.startswith("exact") else shape.retrievable
        rows.append({"section": "retrieval", "mode": name, "rows_scored": n,
                     "batch": shape.batch, "ms": round(ms, 3)})  # fmt: skip
    t0 = time.perf_counter()
    rset.observe(np.arange(1000, dtype=np.int64) + rset.first_item_row)
    plan = rset.plan()
    rows.append({"section": "retrieval", "mode": "set refresh plan (background)",
                 "rows_scored": shape.items, "ms": round(plan.planned_s * 1000, 1),
                 "wall_ms": round((time.perf_counter() - t0) * 1000, 1)})  # fmt: skip


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--sections", nargs="+", default=["embedding", "disk"])
    parser.add_argument("--zipf", type=float, default=1.05, help="popularity exponent")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--disk-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    shape = H200 if cuda else SMOKE
    if not cuda:
        torch.set_num_threads(1)
    rows: Rows = []
    errors: list[str] = []
    started = time.perf_counter()
    for section in args.sections:
        t0 = time.perf_counter()
        try:
            if section == "embedding":
                embedding_section(shape, device, args.zipf, rows)
            elif section == "disk":
                base = Path(args.disk_dir) if args.disk_dir else None
                directory = Path(tempfile.mkdtemp(prefix="streamrec-disk-", dir=base))
                try:
                    disk_section(shape, device, directory, rows)
                finally:
                    shutil.rmtree(directory, ignore_errors=True)
            else:
                raise ValueError(f"unknown section {section!r}")
        except Exception as exc:  # keep the other section's rows
            traceback.print_exc()
            errors.append(f"{section}: {type(exc).__name__}: {exc}")
        print(f"section {section}: {time.perf_counter() - t0:.1f} s", flush=True)
        if cuda:
            torch.cuda.empty_cache()
    name = "h200_tiers" if cuda else "cpu_tiers_smoke"
    meta = {"shape": dataclasses.asdict(shape), "zipf": args.zipf, "errors": errors,
            "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    path = write_results(name, rows, meta)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(args.out) / path.name)
    for section in ("embedding", "retrieval", "disk"):
        print_table([{k: v for k, v in r.items() if k != "section"} for r in rows
                     if r["section"] == section])  # fmt: skip
    print(f"wrote {path}; errors: {errors or 'none'}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
