"""MovieLens-small, CPU: what generation predicts and how often a trained draft is right.

Trains (unless given) a 4-layer target and a 2-layer draft distilled from it, then for
each draft and each k runs
``offline.generation_evaluation``: HR@1/HR@10 of the ranked list (retrieval + task heads),
of retrieval alone and of the generated continuation, the draft's acceptance rate and
whether speculative greedy output equals the target's greedy output for every user.
Writes bench/results/movielens_speculative.json, whose acceptance rate the H200 benchmark
(bench/speculative_bench.py) forces at the reference shapes.

    .venv/bin/python -m bench.movielens_generation \\
        --ratings ../shared/data/movielens-small/ratings.csv --work /tmp/spec-ml

(training the target and the draft: ~20 min each here, under a load average of ~13 on
2 cores; with ``--model``/``--draft`` given, the evaluation alone: ~3-4 min per draft and
k.)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from bench._report import print_table, write_results
from streamrec.models.checkpoint import load_checkpoint
from streamrec.offline.datasets import read_movielens
from streamrec.offline.distillation import DraftConfig, train_draft
from streamrec.offline.generation_evaluation import evaluate_generation
from streamrec.offline.training import TrainConfig, train

TARGET = TrainConfig(num_layers=4, epochs=6, model_name="hstu-ml-4l")
DRAFT = TrainConfig(epochs=4, dropout=0.1)
# 2 layers, started from the target's first two; a window as long as the target's context
# at k = 20 (75 - 20 - 4 - 1 = 50 tokens).
DRAFT_SHAPE = DraftConfig(num_layers=2, max_seq_len=75, distill_weight=0.9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ratings", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/spec-ml"))
    parser.add_argument("--model", type=Path, help="a trained target (else trained here)")
    parser.add_argument(
        "--draft", type=Path, nargs="+", help="its draft(s) (else one is distilled here)"
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 20])
    parser.add_argument("--gamma", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    log = read_movielens(args.ratings)
    model = args.model or args.work / "target"
    if args.model is None and not (model / "meta.json").exists():
        print(f"training the target into {model} ...", flush=True)
        train(log, model, TARGET, progress=None)
    drafts = args.draft or [args.work / "draft2"]
    if args.draft is None and not (drafts[0] / "meta.json").exists():
        print(f"distilling the draft into {drafts[0]} ...", flush=True)
        train_draft(log, model, drafts[0], DRAFT, DRAFT_SHAPE, progress=None)
    rows: list[dict[str, object]] = []
    for draft in drafts:
        layers = load_checkpoint(draft).config.num_layers
        for k in args.ks:
            result = evaluate_generation(model, log, draft_dir=draft, k=k, gamma=args.gamma)
            row = {"draft_layers": layers, **asdict(result)}
            row["acceptance"] = row.pop("acceptance_rate")
            rows.append(row)
    path = write_results("movielens_speculative", rows, {"ratings": str(args.ratings)})
    print_table([{key: r[key] for key in ("draft_layers", "k", "gamma", "acceptance",
                  "greedy_identical",
                  "ranked_hr10", "retrieval_hr10", "first_generated_hr1", "generated_hr10")}
                 for r in rows])  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
