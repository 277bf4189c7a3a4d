"""Recall of the retrievable set against exact retrieval over the whole catalogue (issue 20).

Past the GPU budget the worker retrieves from the ``N`` items with the highest decayed
event count (``cache.RetrievalSet``) instead of the whole table. What that costs:

- recall@K = |top-K(set) ∩ top-K(all)| / K per user, averaged (the same exclusion of the
  user's recent items on both sides);
- next-item HR@10 (MovieLens, leave-last-out): how often the held-out next event is in
  the top 10 of exact retrieval, and of retrieval over the set;
- event coverage: the share of events whose item is a member (a next-item hit needs it).

The set is built by the serving code itself (``observe`` every event, then ``refresh``).

- ``zipf-uniform-users`` (synthetic, 100k items, D=64, Zipf(s) events, users pointing in
  random directions): a model with no popularity bias, the worst case (recall ≈ N / V);
- ``movielens`` (``--model DIR`` from ``streamrec train``): a trained HSTU on
  MovieLens-small (9.7k items), user vectors from ``prefill`` of each user's history,
  exact retrieval = every retrievable row.

    .venv/bin/python -m bench.retrieval_set_recall [--model /tmp/ml-model]

Writes ``bench/results/retrieval_set_recall.json``; prints the table last.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench._report import print_table, write_results
from streamrec.cache.retrieval_set import RetrievalSet
from streamrec.pipeline.item_catalog import retrieve_members

FIRST = 17  # padding + 16 OOV rows, as in a trained model
EXCLUDE = 16
KS = (20, 100)


def _recall(
    user: torch.Tensor,
    table: torch.Tensor,
    events: np.ndarray,
    recent: np.ndarray,
    sizes: list[int],
    first: int,
    targets: np.ndarray | None = None,
) -> list[dict[str, object]]:
    """Rows of recall@K (and HR@10 of ``targets``) per set size; ``table`` [V, D]."""
    num_items = table.shape[0]
    scores = user @ F.normalize(table.float(), dim=-1).t()  # [U, V]
    scores[:, :first] = float("-inf")
    valid = recent >= 0
    scores[torch.from_numpy(np.nonzero(valid)[0]), torch.from_numpy(recent[valid])] = -np.inf
    exact = torch.topk(scores, max(KS), dim=1).indices.numpy()  # [U, K]
    out: list[dict[str, object]] = []
    for size in [*sizes, num_items - first]:
        rset = RetrievalSet(table, "cpu", size, first, half_life_events=1e12, hysteresis=0.0)
        rset.observe(events)
        rset.refresh()
        got = retrieve_members(rset, user, max(KS), rset.excluded_rows(recent))[1].numpy()  # [U, K]
        row: dict[str, object] = {"set_size": size, "set_share": round(size / num_items, 4)}
        for k in KS:
            hits = [len(set(exact[u, :k]) & set(got[u, :k])) for u in range(len(user))]
            row[f"recall@{k}"] = round(float(np.mean(hits)) / k, 4)
        row["event_coverage"] = round(float(np.isin(events, rset.members).mean()), 4)
        if targets is not None:
            row["hr@10_exact"] = round(float((exact[:, :10] == targets[:, None]).any(1).mean()), 4)
            row["hr@10_set"] = round(float((got[:, :10] == targets[:, None]).any(1).mean()), 4)
        out.append(row)
    return out


def zipf_catalog(
    num_items: int, dim: int, users: int, history: int, s: float, seed: int
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Item vectors [V, D], histories [U, L] of Zipf(s) draws (rank -> scattered row)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(num_items, dim, generator=gen)
    n = num_items - FIRST
    cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -s)
    cdf /= cdf[-1]
    rng = np.random.default_rng(seed)
    ranks = np.minimum(np.searchsorted(cdf, rng.random((users, history))), n - 1)
    perm = rng.permutation(n) + FIRST
    return table, perm[ranks], perm


def synthetic_rows(args: argparse.Namespace) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    sizes = [int(args.items * f) for f in (0.01, 0.05, 0.1, 0.25)]
    for s in args.zipf:
        table, hist, _ = zipf_catalog(args.items, 64, args.users, 50, s, seed=7)
        user = F.normalize(torch.randn(args.users, 64, generator=torch.Generator().manual_seed(8)))
        for row in _recall(user, table, hist.reshape(-1), hist[:, -EXCLUDE:], sizes, FIRST):
            rows.append({"catalog": "zipf-uniform-users", "items": args.items, "zipf": s, **row})
            print(rows[-1], flush=True)
    return rows


def movielens_rows(model_dir: Path, ratings: Path) -> list[dict[str, object]]:
    """Leave-last-out: user vectors from all events but the last, which is the target."""
    from streamrec.models.checkpoint import load_checkpoint
    from streamrec.offline.datasets import read_movielens

    ckpt = load_checkpoint(model_dir, dtype="float32")
    model, vocab, cfg = ckpt.model, ckpt.vocab, ckpt.config
    history, held_out = read_movielens(ratings).leave_last_out()
    rows = vocab.lookup(history.items.tolist())
    targets = vocab.lookup(held_out.items.tolist())
    embs, recents = [], []
    with torch.inference_mode():
        for u in range(history.num_users):
            span = history.user_slice(u)
            idx = np.arange(max(span.start, span.stop - cfg.max_seq_len), span.stop)
            _, _, emb = model.prefill(
                torch.from_numpy(rows[idx]),
                torch.from_numpy(history.actions[idx]),
                torch.from_numpy(history.ts_ms[idx]),
                torch.tensor([0, len(idx)], dtype=torch.int64),
            )
            embs.append(emb[0])
            tail = rows[idx][-EXCLUDE:]
            recents.append(np.pad(tail, (0, EXCLUDE - len(tail)), constant_values=-1))
    table = model.item_emb.weight.detach()
    sizes = [int(cfg.num_items * f) for f in (0.05, 0.1, 0.25, 0.5)]
    out = []
    recent = np.stack(recents)
    for row in _recall(torch.stack(embs), table, rows, recent, sizes, cfg.first_item_row, targets):
        out.append({"catalog": "movielens", "items": cfg.num_items, "zipf": "", **row})
        print(out[-1], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--users", type=int, default=2_000)
    parser.add_argument("--zipf", type=float, nargs="+", default=[0.8, 1.05])
    parser.add_argument("--model", type=Path, default=None, help="a trained model directory")
    parser.add_argument(
        "--ratings", type=Path, default=Path("../shared/data/movielens-small/ratings.csv")
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = synthetic_rows(args)
    if args.model is not None:
        rows += movielens_rows(args.model, args.ratings)
    meta = {"ks": KS, "exclude_recent": EXCLUDE, "seconds": round(time.perf_counter() - start)}
    path = write_results("retrieval_set_recall", rows, meta)
    print_table(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
