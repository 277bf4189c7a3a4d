"""The demo's model: a small HSTU trained in seconds (synthetic) to about 3 CPU-minutes
(MovieLens), kept for the next run.

The model directory is cached under ``.streamrec-cache/demo/`` by data set and recipe,
so a second ``make demo`` starts serving at once, and the same model version can be
exported ahead (``streamrec export --model DIR``) to show the AOTInductor path. A model
is written to a temporary directory and renamed into place, so an interrupted training
never leaves a half-written model to be picked up later.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Final, TextIO

import numpy as np

from streamrec.models.checkpoint import META
from streamrec.offline.datasets import InteractionLog, SyntheticSpec, synthetic_log
from streamrec.offline.training import TrainConfig, train
from streamrec.tools.demo_data import DemoSource

DEMO_CACHE: Final = Path(".streamrec-cache/demo")

_SMALL: Final = TrainConfig(
    epochs=2,
    batch_size=64,
    seq_len=32,
    max_seq_len=64,
    num_negatives=64,
    d_model=32,
    num_layers=2,
    num_heads=2,
    head_dim=16,
    num_oov_buckets=4,
    dropout=0.0,
    lr=3e-3,
    model_name="demo-hstu",
)
# Synthetic chains are learnt in seconds. MovieLens needs the full softmax over its ~9.7k
# movies to beat most-popular, here on each user's most recent events only (one window
# each, 31.5k tokens an epoch). Seen on MovieLens-small (HR@10 model / most-popular,
# leave-last-out on those events): 10 epochs lr 3e-3 1.19x; lr 1e-2: 10 epochs 0.88x,
# 15 epochs 1.94x, 20 epochs 1.63x; sampled softmax (512 negatives) stayed below 1x.
RECIPES: Final = {
    "synthetic": _SMALL,
    "movielens": replace(_SMALL, epochs=15, seq_len=64, num_negatives=0, lr=1e-2),
}
MOVIELENS_TAIL: Final = 65  # the last events of each user that the MovieLens model sees


@dataclass(frozen=True)
class DemoModel:
    model_dir: Path
    trained_s: float  # 0 when a cached model was reused
    cached: bool


def recent_events(log: InteractionLog, per_user: int) -> InteractionLog:
    """Each user's last ``per_user`` events (all of them for shorter histories)."""
    keep = np.minimum(log.lengths(), per_user)  # [U]
    ends = log.offsets[1:]
    idx = np.concatenate([np.arange(end - k, end) for end, k in zip(ends, keep)])  # [E']
    return InteractionLog(
        users=log.users,
        offsets=np.concatenate([[0], np.cumsum(keep)]).astype(np.int64),
        items=log.items[idx],
        actions=log.actions[idx],
        ts_ms=log.ts_ms[idx],
    )


def training_log(source: DemoSource) -> InteractionLog:
    if source.name == "movielens":
        return recent_events(source.log, MOVIELENS_TAIL)
    return source.log


def _cache_dir(source: DemoSource, config: TrainConfig) -> Path:
    log = source.log
    digest = hashlib.sha256(json.dumps(asdict(config), sort_keys=True).encode())
    digest.update(f"{log.num_users}/{log.num_events}/{int(log.ts_ms.sum())}".encode())
    return DEMO_CACHE / f"{source.name}-{digest.hexdigest()[:10]}"


def demo_model_dir(source: DemoSource) -> Path:
    """Where the demo model for ``source`` lives (whether or not it is trained yet)."""
    return _cache_dir(source, RECIPES[source.name])


def is_trained(model_dir: Path) -> bool:
    return (model_dir / META).is_file()  # written last by save_checkpoint


def ensure_demo_model(
    source: DemoSource, model_dir: Path, *, retrain: bool, progress: TextIO | None = None
) -> DemoModel:
    """The model in ``model_dir`` if it is complete (and not ``retrain``), else trained now."""
    if not retrain and is_trained(model_dir):
        return DemoModel(model_dir, 0.0, True)
    started = time.monotonic()
    scratch = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    train(training_log(source), scratch, RECIPES[source.name], progress=progress)
    shutil.rmtree(model_dir, ignore_errors=True)
    scratch.rename(model_dir)
    return DemoModel(model_dir, time.monotonic() - started, False)


def train_demo_model(out_dir: Path, progress: TextIO | None = None) -> Path:
    """A small HSTU on synthetic chains: a few seconds on two CPU cores (benchmarks use it)."""
    data = synthetic_log(SyntheticSpec(num_users=300, num_items=200, events_per_user=30, seed=0))
    return train(data, out_dir, RECIPES["synthetic"], progress=progress).model_dir
