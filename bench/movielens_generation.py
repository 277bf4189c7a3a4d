"""MovieLens-small, CPU: what generation predicts and how often a trained draft is right.

Trains (unless given) a 4-layer target and two 2-layer drafts distilled from it: one on
the data alone (``rollout_k = 0``, the recipe before issue 19's on-policy phase), one
that then trains on the target's own greedy continuations (``offline/rollouts.py``).
Every ``--holdout-every``-th user is held out of those rollouts, so the acceptance over
those users is that of contexts the draft never trained on. For each draft and k it runs
``offline.generation_evaluation`` over all users and over the held-out ones: HR@1/HR@10
of the ranked list (retrieval + task heads), of retrieval alone and of the generated
continuation, the draft's acceptance rate and whether speculative greedy output equals
the target's for every user. Writes bench/results/movielens_speculative.json, whose
held-out acceptance the H200 benchmark (bench/speculative_bench.py) forces at the
reference shapes.

    .venv/bin/python -m bench.movielens_generation \\
        --ratings ../shared/data/movielens-small/ratings.csv --work /tmp/spec-ml \\
        [--gammas 4 2 3 6] [--catalogs 0 500 1000]

(on an idle 2-core machine: the target ~2.5 min, the data-only draft ~4.5 min, the
on-policy draft ~4.5 + 4 + 8 min (distillation, rollouts, on-policy epochs); each
evaluation ~1 min per draft and k.)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from bench._report import print_table, write_results
from streamrec.models.checkpoint import load_checkpoint
from streamrec.offline.datasets import InteractionLog, read_movielens
from streamrec.offline.distillation import DraftConfig, train_draft
from streamrec.offline.generation_evaluation import evaluate_generation
from streamrec.offline.training import TrainConfig, train
from streamrec.pipeline.draft_catalog import DRAFT_ITEMS

TARGET = TrainConfig(num_layers=4, epochs=6, model_name="hstu-ml-4l")
DRAFT = TrainConfig(epochs=4, dropout=0.1)
# 2 layers, started from the target's first two; a window as long as the target's context
# at k = 20 (75 - 20 - 4 - 1 = 50 tokens).
ON_POLICY = DraftConfig(num_layers=2, max_seq_len=75, distill_weight=0.9)
DATA_ONLY = replace(ON_POLICY, rollout_k=0)
COLUMNS = ("draft", "population", "users", "k", "gamma", "draft_catalog", "acceptance",
           "greedy_identical", "target_calls_per_batch", "row_rounds_per_batch", "ranked_hr10",
           "retrieval_hr10", "first_generated_hr1", "generated_hr10")  # fmt: skip


def held_out(log: InteractionLog, every: int) -> tuple[np.ndarray, np.ndarray]:
    """(users the rollouts may use, users they never see): every ``every``-th is held out."""
    users = np.arange(log.num_users)
    return users[users % every != 0], users[users % every == 0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ratings", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/spec-ml"))
    parser.add_argument("--model", type=Path, help="a trained target (else trained here)")
    parser.add_argument(
        "--draft", type=Path, nargs="+",
        help="drafts to evaluate (else a data-only and an on-policy draft are trained here)",
    )  # fmt: skip
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 20])
    parser.add_argument(
        "--gammas", type=int, nargs="+", default=[4],
        help="draft items per round; the first for every row, the others on held-out users",
    )  # fmt: skip
    parser.add_argument(
        "--catalogs", type=int, nargs="+", default=[0],
        help="generation.draft_catalog values (0: the whole catalog), as --gammas",
    )  # fmt: skip
    parser.add_argument("--holdout-every", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    log = read_movielens(args.ratings)
    seen, unseen = held_out(log, args.holdout_every)
    model = args.model or args.work / "target"
    if args.model is None and not (model / "meta.json").exists():
        print(f"training the target into {model} ...", flush=True)
        train(log, model, TARGET, progress=None)
    drafts = args.draft or [args.work / "draft2", args.work / "draft2-on-policy"]
    if args.draft is None:
        for path, shape in zip(drafts, (DATA_ONLY, ON_POLICY), strict=True):
            if not (path / "meta.json").exists():
                print(f"distilling {path} ...", flush=True)
                train_draft(log, model, path, DRAFT, shape, rollout_log=log.subset(seen),
                            progress=None)  # fmt: skip
    rows: list[dict[str, object]] = []
    for draft in drafts:
        ckpt = load_checkpoint(draft)
        training, layers = ckpt.meta.get("training", {}), ckpt.config.num_layers
        has_items = (draft / DRAFT_ITEMS).exists()
        for population, part in (("all", log), ("held_out", log.subset(unseen))):
            # the default row of each k, then (held-out users only) the other gammas and
            # catalogs: what they change is acceptance on contexts the draft never saw
            settings = [(k, args.gammas[0], args.catalogs[0]) for k in args.ks]
            if population == "held_out":
                settings += [(max(args.ks), g, c) for g in args.gammas for c in args.catalogs
                             if (g, c) != (args.gammas[0], args.catalogs[0])]  # fmt: skip
            for k, gamma, catalog in settings:
                if catalog and not has_items:
                    continue
                result = evaluate_generation(model, part, draft_dir=draft, k=k, gamma=gamma,
                                             draft_catalog=catalog, report=None)  # fmt: skip
                row: dict[str, object] = {"draft": draft.name, "population": population,
                                          "draft_layers": layers, "draft_catalog": catalog,
                                          "on_policy": training.get("on_policy") or None,
                                          **asdict(result)}  # fmt: skip
                row["acceptance"] = row.pop("acceptance_rate")
                rows.append(row)
                print_table([{key: row[key] for key in COLUMNS}])
    meta = {"ratings": str(args.ratings), "holdout_every": args.holdout_every}
    path = write_results("movielens_speculative", rows, meta)
    print_table([{key: r[key] for key in COLUMNS} for r in rows])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
