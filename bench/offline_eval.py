"""The offline protocol of issue 22 on MovieLens-small: HSTU vs SASRec-style vs most-popular,
with the ablations of the task heads and of the time bias, over seeds.

Each variant is trained with ``TrainConfig``'s defaults (validation = each user's
second-to-last event, early stopping, the best epoch kept), scored on the last event by
``streamrec.offline.evaluation``, and compared to HSTU by a paired bootstrap over users
and seeds (``streamrec.offline.comparison``). Models go to ``--models`` and are reused
when trained alike, so an interrupted run resumes. CPU, one thread per training.

    .venv/bin/python -m bench.offline_eval --ratings ../shared/data/movielens-small/ratings.csv

(the same as ``streamrec eval --ratings R --seeds 5 --ablation no-task-heads --ablation
no-time-bias --ablation-seeds 5 --lr-grid 0.005,0.002 --out DIR --json FILE``.) The
learning rate of HSTU and of SASRec is chosen on validation (seed 0) from ``--lr-grid``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from bench._report import machine_info
from streamrec.offline.comparison import ABLATIONS, ComparisonConfig, run_comparison
from streamrec.offline.datasets import read_movielens
from streamrec.offline.training import TrainConfig

RESULTS = Path(__file__).parent / "results" / "offline_eval_movielens.json"
DEFAULT_RATINGS = Path("../shared/data/movielens-small/ratings.csv")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ratings", type=Path, default=DEFAULT_RATINGS, help="ratings.csv")
    parser.add_argument("--seeds", type=int, default=5, help="seeds of HSTU and SASRec")
    parser.add_argument("--ablation-seeds", type=int, default=5, help="seeds of each ablation")
    parser.add_argument("--epochs", type=int, default=TrainConfig.epochs, help="most epochs")
    parser.add_argument("--patience", type=int, default=TrainConfig.patience)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--lr-grid", default="0.005,0.002", help="rates tried on seed 0, chosen on validation"
    )
    parser.add_argument(
        "--models", type=Path, default=Path(".streamrec-cache/offline-eval"), help="model dirs"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    log = read_movielens(args.ratings)
    train_cfg = TrainConfig(epochs=args.epochs, patience=args.patience, threads=args.threads)
    compare = ComparisonConfig(
        seeds=args.seeds,
        ablations=tuple(ABLATIONS),
        ablation_seeds=args.ablation_seeds,
        lr_grid=tuple(float(lr) for lr in args.lr_grid.split(",") if lr),
    )
    report = run_comparison(log, args.models, train_cfg, compare, progress=sys.stderr)
    print(report.table())
    data = {
        **report.to_dict(),
        "command": " ".join(["python -m bench.offline_eval", *(argv or sys.argv[1:])]),
        "equivalent_cli": (
            f"streamrec eval --ratings {args.ratings} --seeds {args.seeds} --ablation "
            f"no-task-heads --ablation no-time-bias --ablation-seeds {args.ablation_seeds} "
            f"--epochs {args.epochs} --patience {args.patience} --threads {args.threads} "
            f"--lr-grid {args.lr_grid} --out {args.models}"
        ),
        "train_config": {k: v for k, v in train_cfg.__dict__.items() if not k.startswith("_")},
        "data": {"ratings": str(args.ratings), "users": log.num_users, "events": log.num_events},
        "wall_seconds": round(time.perf_counter() - started, 1),
        "machine": machine_info(),
    }
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], args.out.name).write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
