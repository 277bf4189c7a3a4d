"""``streamrec export``: compile a model directory into the AOTI package cache.

The worker loads from the same cache with the same ``ExportConfig`` (``--retrieve-k``
must cover the worker's ``scoring.num_candidates``), so exporting ahead of a deploy turns
the worker's start into a load (seconds) instead of a compile (minutes). The model
directory, the cache and the device come from the worker's configuration (``--model``,
``--cache-dir``, ``--device`` are its shortcuts), so the package built is the one the
worker with that configuration looks for, at its precision too (``cache.kv_dtype``,
``model.weight_dtype``, e.g. ``--set cache.kv_dtype=fp8_e4m3``). ``--jobs N`` compiles
N entry points at a time, each in its own process (each loads the model: mind the
memory of an 8-layer, 1M-item model, several GB per process).
"""

from __future__ import annotations

import argparse
import sys
import time

from streamrec.errors import ExportError
from streamrec.models.aoti_export import ENTRY_POINTS, ExportConfig, export_model
from streamrec.models.config import DTYPES
from streamrec.worker.config import WorkerConfig
from streamrec.worker.model_loader import export_config_for


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The export-only flags (the rest are the worker's config flags)."""
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: the model's config")
    parser.add_argument(
        "--retrieve-k", type=int,
        help="largest k retrieve serves (default: the worker's, max of "
        f"{ExportConfig().retrieve_k} and scoring.num_candidates)",
    )  # fmt: skip
    parser.add_argument(
        "--entry-points", default=",".join(ENTRY_POINTS), help="model methods to compile"
    )
    parser.add_argument("--force", action="store_true", help="recompile even on a cache hit")
    parser.add_argument(
        "--jobs", type=int, default=1, help="entry points compiled at once (one process each)"
    )


def run_export(args: argparse.Namespace, config: WorkerConfig, device: str) -> int:
    """Handler of ``streamrec export``; returns the exit status (errors name the cause)."""

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    start = time.perf_counter()
    model_cfg = config.model
    retrieve_k = args.retrieve_k or export_config_for(config.scoring).retrieve_k
    try:
        export = ExportConfig(
            entry_points=tuple(args.entry_points.split(",")), retrieve_k=retrieve_k,
            precision=config.precision,
        )  # fmt: skip
        directory = export_model(
            model_cfg.model_dir, device, model_cfg.aoti_cache_dir, dtype=args.dtype,
            config=export, progress=progress, force=args.force, jobs=args.jobs,
        ).directory  # fmt: skip
    except ExportError as exc:
        progress(f"export failed: {exc}")
        return 1
    progress(f"export: {directory} ({time.perf_counter() - start:.1f} s)")
    print(directory)
    return 0
