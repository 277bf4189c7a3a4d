"""``streamrec export``: compile a model directory into the AOTI package cache.

The worker loads from the same cache with the same ``ExportConfig`` (``--retrieve-k``
must cover the worker's ``model.num_candidates``), so exporting ahead of a deploy turns
the worker's start into a load (seconds) instead of a compile (minutes). ``--jobs N``
compiles N entry points at a time, each in its own process (each loads the model: mind
the memory of an 8-layer, 1M-item model, several GB per process).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from streamrec.errors import ExportError
from streamrec.models.aoti_export import ENTRY_POINTS, ExportConfig, export_model
from streamrec.models.config import DTYPES


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", type=Path, default=Path(".streamrec-cache/model"))
    parser.add_argument("--cache-dir", type=Path, default=Path(".streamrec-cache/aoti"))
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: the model's config")
    parser.add_argument(
        "--retrieve-k", type=int, default=ExportConfig().retrieve_k,
        help="largest k retrieve serves (>= model.num_candidates of the worker)",
    )  # fmt: skip
    parser.add_argument("--entry-points", default=",".join(ENTRY_POINTS))
    parser.add_argument("--force", action="store_true", help="recompile even on a cache hit")
    parser.add_argument(
        "--jobs", type=int, default=1, help="entry points compiled at once (one process each)"
    )


def run_export(args: argparse.Namespace) -> int:
    """Handler of ``streamrec export``; returns the exit status (errors name the cause)."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    start = time.perf_counter()
    try:
        config = ExportConfig(
            entry_points=tuple(args.entry_points.split(",")), retrieve_k=args.retrieve_k
        )
        directory = export_model(
            args.model_dir, device, args.cache_dir, dtype=args.dtype, config=config,
            progress=progress, force=args.force, jobs=args.jobs,
        ).directory  # fmt: skip
    except ExportError as exc:
        progress(f"export failed: {exc}")
        return 1
    progress(f"export: {directory} ({time.perf_counter() - start:.1f} s)")
    print(directory)
    return 0
