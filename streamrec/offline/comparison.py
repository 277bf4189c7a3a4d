"""The offline protocol of issue 22: HSTU against baselines and ablations over seeds.

Every variant is trained with the same ``TrainConfig`` (validation split, early stopping,
the best epoch's weights kept) for seeds 0..N-1 and scored on the test split by the same
code (``evaluation.evaluate``). The report gives mean ± standard deviation over seeds per
metric and, for every other variant, the paired bootstrap interval of HSTU minus it
(``bootstrap.py``: users and seeds resampled). Nothing is chosen on the test split: the
epoch is chosen on validation, and so is the learning rate when ``lr_grid`` is given (seed
0 of HSTU and of SASRec for each rate, the best validation NDCG@k wins); every other
hyperparameter is ``TrainConfig``'s default.

Models land in ``work_dir/<variant>-seed<s>``; a directory whose recorded training config
equals the one asked for is evaluated again rather than retrained, so an interrupted
protocol resumes where it stopped.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from streamrec.errors import ConfigError
from streamrec.models.checkpoint import META
from streamrec.offline.bootstrap import BootstrapConfig, Interval, paired_bootstrap
from streamrec.offline.datasets import InteractionLog
from streamrec.offline.evaluation import EvalResult, evaluate
from streamrec.offline.ranking import METRICS, RankingMetrics, UserMetrics
from streamrec.offline.sasrec import train_sasrec
from streamrec.offline.training import TrainConfig, TrainResult, train

MODEL = "hstu"
POPULAR = "most-popular"
SASREC = "sasrec"
BASELINES = (POPULAR, SASREC)
# HSTU with one ingredient removed: the TrainConfig fields that remove it.
ABLATIONS: dict[str, dict[str, Any]] = {
    "no-task-heads": {"task_weight": 0.0},
    "no-time-bias": {"time_bias": False},
}
Trainer = Callable[..., TrainResult]


@dataclass(frozen=True)
class ComparisonConfig:
    """Which variants, how many seeds each, and the metric cut-off."""

    seeds: int = 5
    baselines: tuple[str, ...] = BASELINES
    ablations: tuple[str, ...] = ()
    ablation_seeds: int | None = None  # None: ``seeds``
    k: int = 10
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    # Learning rates tried for HSTU and for SASRec, seed 0, chosen by validation NDCG@k
    # (the ablations take HSTU's); empty: TrainConfig's lr for both.
    lr_grid: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.seeds, int) or self.seeds < 1:
            raise ConfigError(f"--seeds {self.seeds!r}: must be an int >= 1")
        if self.ablation_seeds is not None and not 1 <= self.ablation_seeds <= self.seeds:
            raise ConfigError(f"ablation_seeds={self.ablation_seeds} must be in [1, {self.seeds}]")
        bad = [b for b in self.baselines if b not in BASELINES]
        if bad:
            raise ConfigError(f"--baseline {bad[0]!r}: expected one of {', '.join(BASELINES)}")
        bad = [a for a in self.ablations if a not in ABLATIONS]
        if bad:
            raise ConfigError(f"--ablation {bad[0]!r}: expected one of {', '.join(ABLATIONS)}")
        if self.k < 1:
            raise ConfigError(f"--k {self.k}: must be >= 1")
        if any(not lr > 0 for lr in self.lr_grid):
            raise ConfigError(f"--lr-grid {list(self.lr_grid)}: every rate must be > 0")

    def variants(self) -> list[tuple[str, int]]:
        """(variant, number of seeds) of every trained model, HSTU first."""
        out = [(MODEL, self.seeds)]
        if SASREC in self.baselines:
            out.append((SASREC, self.seeds))
        out += [(f"{MODEL}-{a}", self.ablation_seeds or self.seeds) for a in self.ablations]
        return out


@dataclass(frozen=True)
class Run:
    """One trained model's test figures and what its training did."""

    variant: str
    seed: int
    model_version: str
    test: RankingMetrics
    lr: float
    validation_ndcg: float  # at the kept epoch
    best_epoch: int
    epochs_run: int
    train_seconds: float
    reused: bool
    per_user: UserMetrics = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("per_user", "test")}
        return {**out, **asdict(self.test)}


def _config_for(variant: str, seed: int, base: TrainConfig, lrs: dict[str, float]) -> TrainConfig:
    family = SASREC if variant == SASREC else MODEL
    cfg = replace(base, seed=seed, lr=lrs.get(family, base.lr))
    if variant.startswith(f"{MODEL}-"):
        cfg = replace(cfg, **ABLATIONS[variant.removeprefix(f"{MODEL}-")], model_name=variant)
    return cfg


def _same_stop(training: dict[str, Any], cfg: TrainConfig) -> bool:
    """Whether a recorded run would have stopped where it did under ``cfg.patience``.

    A run that went through every epoch never met its patience; a larger one (or 0,
    never) would not have met it either, so the weights are the same.
    """
    old = training.get("patience")
    if old == cfg.patience:
        return True
    ran_all = training.get("epochs_run") == cfg.epochs
    return ran_all and isinstance(old, int) and (cfg.patience == 0 or cfg.patience >= old > 0)


def _reusable(model_dir: Path, cfg: TrainConfig) -> dict[str, Any] | None:
    """The directory's training record if training with ``cfg`` would give its weights."""
    try:
        meta = json.loads((model_dir / META).read_text())
    except (OSError, ValueError):
        return None
    training = meta.get("training", {})
    expected = asdict(cfg)
    if SASREC in model_dir.name:
        expected = {**expected, "task_weight": 0.0, "model_name": SASREC}
    same = all(training.get(k) == v for k, v in expected.items() if k != "patience")
    return training if same and _same_stop(training, cfg) else None


def _train_or_reuse(
    variant: str, cfg: TrainConfig, log: InteractionLog, model_dir: Path, progress: TextIO | None
) -> tuple[dict[str, Any], bool]:
    record = _reusable(model_dir, cfg)
    if record is not None:
        return record, True
    trainer: Trainer = train_sasrec if variant == SASREC else train
    trainer(log, model_dir, cfg, progress=progress)
    record = _reusable(model_dir, cfg)
    assert record is not None, model_dir
    return record, False


def _model_dir(root: Path, variant: str, cfg: TrainConfig, base: TrainConfig) -> Path:
    tag = "" if cfg.lr == base.lr else f"-lr{cfg.lr:g}"
    return root / f"{variant}{tag}-seed{cfg.seed}"


def _validation_of(record: dict[str, Any]) -> float:
    """Validation NDCG@10 of the kept epoch, from a model's training record."""
    scores = record.get("validation_ndcg10") or [float("nan")]
    best = int(record.get("best_epoch", 0))
    return float(scores[best - 1] if best else scores[-1])


def _select_lr(
    family: str, base: TrainConfig, grid: tuple[float, ...], log: InteractionLog, root: Path,
    progress: TextIO | None,
) -> tuple[float, dict[float, float]]:  # fmt: skip
    """The rate of ``grid`` whose seed-0 model scores best on validation (first on ties)."""
    scores: dict[float, float] = {}
    for lr in grid:
        cfg = _config_for(family, 0, base, {family: lr})
        record, _ = _train_or_reuse(family, cfg, log, _model_dir(root, family, cfg, base), progress)
        scores[lr] = _validation_of(record)
        if progress is not None:
            progress.write(f"select {family} lr {lr:g}: validation NDCG@10 {scores[lr]:.4f}\n")
    return max(grid, key=lambda lr: scores[lr]), scores


def _run(
    variant: str, seed: int, base: TrainConfig, lrs: dict[str, float], log: InteractionLog,
    work_dir: Path, k: int, progress: TextIO | None,
) -> tuple[Run, EvalResult]:  # fmt: skip
    cfg = _config_for(variant, seed, base, lrs)
    model_dir = _model_dir(work_dir, variant, cfg, base)
    record, reused = _train_or_reuse(variant, cfg, log, model_dir, progress)
    result = evaluate(model_dir, log, k=k, device=cfg.device, report=None)
    assert result.per_user is not None
    best = int(record.get("best_epoch", 0))
    run = Run(
        variant=variant,
        seed=seed,
        model_version=result.model_version,
        test=result.model,
        lr=cfg.lr,
        validation_ndcg=_validation_of(record),
        best_epoch=best,
        epochs_run=int(record.get("epochs_run", cfg.epochs)),
        train_seconds=float(record.get("seconds", 0.0)),
        reused=reused,
        per_user=result.per_user,
    )
    return run, result


@dataclass(frozen=True)
class ComparisonReport:
    runs: dict[str, list[Run]]  # variant -> runs by seed (most-popular: one, seed -1)
    intervals: dict[str, dict[str, Interval]]  # other variant -> metric -> HSTU − other
    k: int
    num_users: int
    seconds: float
    # family -> {"grid": {lr: validation NDCG@k of seed 0}, "chosen": lr}; empty: no grid
    selection: dict[str, dict[str, Any]] = field(default_factory=dict)

    def summary(self, variant: str) -> dict[str, tuple[float, float]]:
        """metric -> (mean, sample standard deviation over seeds; 0 for one run)."""
        runs = self.runs[variant]
        out = {}
        for m in METRICS:
            values = np.array([r.test.get(m) for r in runs])
            out[m] = (float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0)
        return out

    def table(self) -> str:
        k = self.k
        head = f"{'model':<22}{'runs':>5}{f'HR@{k}':>18}{f'NDCG@{k}':>18}{'MRR':>18}"
        lines = [head + f"{f'val NDCG@{k}':>14}  kept epoch per seed"]
        for variant, runs in self.runs.items():
            s = self.summary(variant)
            cells = "".join(f"{f'{s[m][0]:.4f} ± {s[m][1]:.4f}':>18}" for m in METRICS)
            val = np.array([r.validation_ndcg for r in runs])
            val_cell = f"{np.nanmean(val):.4f}" if np.isfinite(val).any() else "-"
            epochs = (
                "-"
                if variant == POPULAR
                else " ".join(f"{r.best_epoch}/{r.epochs_run}" for r in runs)
            )
            lines.append(f"{variant:<22}{len(runs):>5}{cells}{val_cell:>14}  {epochs}")
        for other, by_metric in self.intervals.items():
            cells = "  ".join(f"{m.upper()} {by_metric[m]}" for m in METRICS)
            lines.append(f"{MODEL} − {other}: {cells}")
        for family, sel in self.selection.items():
            tried = ", ".join(f"{lr:g}: {v:.4f}" for lr, v in sel["grid"].items())
            lines.append(f"{family} lr chosen on validation (seed 0): {sel['chosen']:g} ({tried})")
        lines.append(
            f"users={self.num_users}; mean ± std over seeds; intervals: paired bootstrap of "
            "users (and seeds); kept epoch = best validation epoch / epochs run"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "num_users": self.num_users,
            "seconds": round(self.seconds, 1),
            "selection": {
                f: {
                    "chosen": sel["chosen"],
                    "grid": {f"{lr:g}": v for lr, v in sel["grid"].items()},
                }
                for f, sel in self.selection.items()
            },
            "summary": {
                v: {m: {"mean": mu, "std": sd} for m, (mu, sd) in self.summary(v).items()}
                for v in self.runs
            },
            "runs": {v: [r.to_dict() for r in runs] for v, runs in self.runs.items()},
            "intervals": {
                f"{MODEL} - {o}": {m: i.to_dict() for m, i in by.items()}
                for o, by in self.intervals.items()
            },
        }


def run_comparison(
    log: InteractionLog,
    work_dir: Path | str,
    train_config: TrainConfig | None = None,
    config: ComparisonConfig | None = None,
    *,
    progress: TextIO | None = sys.stderr,
) -> ComparisonReport:
    """Train (or reuse) every variant × seed, score the test split, compare to HSTU."""
    started = time.monotonic()
    base = train_config or TrainConfig()
    cfg = config or ComparisonConfig()
    root = Path(work_dir)
    runs: dict[str, list[Run]] = {}
    popular: Run | None = None
    lrs: dict[str, float] = {}
    selection: dict[str, dict[str, Any]] = {}
    families = [MODEL] + ([SASREC] if SASREC in cfg.baselines else [])
    for family in families if cfg.lr_grid else []:
        chosen, scores = _select_lr(family, base, cfg.lr_grid, log, root, progress)
        lrs[family] = chosen
        selection[family] = {"grid": scores, "chosen": chosen}
    # Seed-major: an interrupted protocol leaves every variant with the same seeds done.
    order = [(v, s) for s in range(cfg.seeds) for v, n in cfg.variants() if s < n]
    for variant, seed in order:
        run, result = _run(variant, seed, base, lrs, log, root, cfg.k, progress)
        runs.setdefault(variant, []).append(run)
        if progress is not None:
            how = "reused" if run.reused else f"trained {run.train_seconds:.0f} s"
            progress.write(
                f"{variant} seed {seed}: {how}, epoch {run.best_epoch}/{run.epochs_run}, "
                f"test HR@{cfg.k} {run.test.hr:.4f} NDCG@{cfg.k} {run.test.ndcg:.4f} "
                f"({run.model_version})\n"
            )
            progress.flush()
        if popular is None and POPULAR in cfg.baselines:
            assert result.popular_per_user is not None
            popular = replace(
                run, variant=POPULAR, seed=-1, model_version="-", test=result.popular,
                validation_ndcg=float("nan"), best_epoch=0, epochs_run=0,
                train_seconds=0.0, per_user=result.popular_per_user,
            )  # fmt: skip
    if popular is not None:
        runs[POPULAR] = [popular]
    intervals: dict[str, dict[str, Interval]] = {}
    mine = runs[MODEL]
    for other, theirs in runs.items():
        if other == MODEL:
            continue
        intervals[other] = {
            m: paired_bootstrap(
                np.stack([r.per_user.get(m) for r in mine]),
                np.stack([r.per_user.get(m) for r in theirs]),
                cfg.bootstrap,
            )
            for m in METRICS
        }
    return ComparisonReport(
        runs=runs,
        intervals=intervals,
        k=cfg.k,
        num_users=len(mine[0].per_user.hr),
        seconds=time.monotonic() - started,
        selection=selection,
    )
