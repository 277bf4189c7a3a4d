"""``streamrec eval``: one model directory, or the seeded protocol against baselines.

``--model DIR`` scores one trained model (HSTU or SASRec-style) against most-popular on
the test split (``--split validation``: the second-to-last events). ``--seeds N`` runs
``offline.comparison``: trains HSTU and each ``--baseline`` (and ``--ablation``) for
seeds 0..N-1 into ``--out`` (reusing what is already there), scores them all by the same
code and prints mean ± std per metric and the paired bootstrap interval of HSTU minus
each other variant; ``--json FILE`` writes the per-seed figures too.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from streamrec.errors import ConfigError
from streamrec.offline.comparison import ABLATIONS, BASELINES, ComparisonConfig, run_comparison
from streamrec.offline.datasets import InteractionLog
from streamrec.offline.evaluation import evaluate
from streamrec.offline.training import TrainConfig


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``eval`` other than the data and device ones."""
    parser.add_argument("--model", type=Path, metavar="DIR", help="model directory to score")
    parser.add_argument("--k", type=int, default=10, help="cut-off of HR@k and NDCG@k")
    parser.add_argument(
        "--exclude-history", action="store_true", help="never rank a user's own past items"
    )
    parser.add_argument(
        "--split", choices=("test", "validation"), default="test",
        help="held-out event scored with --model: the last, or the second-to-last",
    )  # fmt: skip
    parser.add_argument(
        "--seeds", type=int, metavar="N",
        help="train and compare HSTU and the baselines for seeds 0..N-1 (no --model)",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", action="append", choices=BASELINES, metavar="NAME",
        help=f"with --seeds: a baseline to compare with ({', '.join(BASELINES)}; "
        "repeatable; default: both)",
    )  # fmt: skip
    parser.add_argument(
        "--ablation", action="append", choices=sorted(ABLATIONS), metavar="NAME",
        help=f"with --seeds: HSTU without one part ({', '.join(sorted(ABLATIONS))}; repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--ablation-seeds", type=int, metavar="N", help="seeds of each ablation (default: --seeds)"
    )
    parser.add_argument(
        "--out", type=Path, metavar="DIR",
        help="with --seeds: where the models go (reused if trained alike; default: a temp dir)",
    )  # fmt: skip
    train = TrainConfig()
    parser.add_argument("--epochs", type=int, default=train.epochs, help="most epochs per run")
    parser.add_argument(
        "--patience", type=int, default=train.patience,
        help="stop after this many epochs without a better validation NDCG@10",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads per training (0: torch's)"
    )
    parser.add_argument(
        "--lr-grid", metavar="LR,LR", default="",
        help="with --seeds: learning rates tried on seed 0 of HSTU and SASRec, the best "
        "validation NDCG@k kept (default: TrainConfig's lr only)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="FILE", help="with --seeds: write figures")


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"--lr-grid {text!r}: expected numbers separated by commas") from None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    except OSError as exc:
        raise ConfigError(f"--json {str(path)!r}: {exc.strerror}") from None


def run_eval(args: argparse.Namespace, data: InteractionLog) -> int:
    """Handler of ``streamrec eval`` (args.device already resolved); returns 0."""
    if args.seeds is None:
        if args.model is None:
            raise ConfigError("eval needs --model DIR (one model) or --seeds N (the protocol)")
        log = data.without_last() if args.split == "validation" else data
        evaluate(args.model, log, k=args.k, exclude_history=args.exclude_history,
                 device=args.device, report=sys.stdout)  # fmt: skip
        return 0
    if args.model is not None:
        raise ConfigError("--model and --seeds exclude each other (--out DIR holds the models)")
    compare = ComparisonConfig(
        seeds=args.seeds,
        baselines=tuple(args.baseline or BASELINES),
        ablations=tuple(args.ablation or ()),
        ablation_seeds=args.ablation_seeds,
        k=args.k,
        lr_grid=_rates(args.lr_grid),
    )
    train_cfg = TrainConfig(
        epochs=args.epochs, patience=args.patience, threads=args.threads, device=args.device
    )
    with tempfile.TemporaryDirectory(prefix="streamrec-eval-") as tmp:
        report = run_comparison(
            data, args.out or Path(tmp), train_cfg, compare, progress=sys.stderr
        )
    print(report.table())
    if args.json is not None:
        command = ["streamrec", *sys.argv[1:]]
        _write_json(args.json, {**report.to_dict(), "command": " ".join(command)})
    return 0
