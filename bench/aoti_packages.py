"""The reference models as model directories, and their AOTI packages compiled ahead.

The H200 benches that serve AOTI (the ``incremental-aoti-*`` paths of ``h200_bench.py``'s
speedup section and ``startup_bench.py``) read one model directory per reference workload
(deterministic: ``h200_common.build_model``, saved once) and its packages from one cache
directory, so one export serves all of them. Compiling is the slow part (the 8-layer
``extend`` took 128 s on the H200), so this module compiles every package the benches
need at once: the workloads side by side, each package's entry points in parallel
processes (``export_model(jobs=...)``). A second run finds everything and takes seconds.

    CXX=/usr/bin/g++ python3 -m bench.aoti_packages --workloads HSTU-8L HSTU-3L

HSTU-8L gets all four entry points (``startup_bench`` serves it like the worker does);
HSTU-3L gets ``extend`` and ``rank`` (only the speedup section uses it).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench._report import print_table, write_results
from bench.h200_common import build_model
from bench.reference_config import REFERENCE_WORKLOADS, ReferenceWorkload
from streamrec.models.aoti_export import ENTRY_POINTS, ExportConfig, export_model
from streamrec.models.checkpoint import META, save_checkpoint
from streamrec.models.package_cache import PackageFiles
from streamrec.models.vocabulary import ItemVocabulary

MODELS_DIR = Path(".streamrec-cache/bench-models")
CACHE_DIR = Path(".streamrec-cache/bench-aoti")
SPEEDUP_ENTRY_POINTS = ("extend", "rank")
# What each workload is compiled for: the worker's four graphs for 8L (startup bench).
ENTRY_POINTS_FOR = {"HSTU-8L": ENTRY_POINTS, "HSTU-3L": SPEEDUP_ENTRY_POINTS}


def workload(name: str) -> ReferenceWorkload:
    return next(w for w in REFERENCE_WORKLOADS if w.name == name)


def reference_model_dir(w: ReferenceWorkload, root: Path = MODELS_DIR) -> Path:
    """``w``'s model directory (the bench model: random weights, seed 0), saved once.

    The same bytes every time, hence the same ``model_version`` and package key, on
    every machine with the same torch.
    """
    path = root / w.name
    if (path / META).is_file():
        return path
    if path.exists():  # a save that did not finish
        shutil.rmtree(path)
    model = build_model(w)
    cfg = model.config
    # the ids the worker bench streams (i0, i1, …), known to the vocabulary
    names = (f"i{n}" for n in range(cfg.num_items - 1 - cfg.num_oov_buckets))
    vocab = ItemVocabulary(list(names), num_oov_buckets=cfg.num_oov_buckets)
    # Worker processes of one bench may build it at once (a fresh machine with carried
    # packages): each saves under its own name, the first rename wins, the rest discard.
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{w.name}-", dir=root))
    save_checkpoint(tmp, model, vocab, {"model_name": w.name})
    try:
        tmp.rename(path)
    except OSError:
        if not (path / META).is_file():
            raise
        shutil.rmtree(tmp)
    del model
    torch.cuda.empty_cache()
    return path


def prepare(
    names: list[str], cache_dir: Path = CACHE_DIR, progress: bool = True
) -> dict[str, PackageFiles]:
    """Every package the benches need, compiled where missing (in parallel)."""
    dirs = {name: reference_model_dir(workload(name)) for name in names}

    def build(name: str) -> PackageFiles:
        entry_points = ENTRY_POINTS_FOR.get(name, SPEEDUP_ENTRY_POINTS)
        return export_model(
            dirs[name], "cuda", cache_dir, config=ExportConfig(entry_points=entry_points),
            progress=(lambda m: print(f"{name}: {m}", file=sys.stderr, flush=True))
            if progress else None,
            jobs=len(entry_points),
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        return dict(zip(names, pool.map(build, names)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--workloads", nargs="+", default=["HSTU-8L", "HSTU-3L"],
        choices=[w.name for w in REFERENCE_WORKLOADS],
    )  # fmt: skip
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    parser.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the reference packages are compiled for the GPU")
    start = time.perf_counter()
    packages = prepare(args.workloads, args.cache_dir)
    wall = time.perf_counter() - start
    rows: list[dict[str, object]] = []
    for name, package in packages.items():
        for entry, timing in sorted(package.manifest.get("timings", {}).items()):
            rows.append({
                "workload": name, "entry_point": entry,
                "export_s": round(float(timing["export_s"]), 1),
                "compile_s": round(float(timing["compile_s"]), 1),
                "mb": round(package.files[entry].stat().st_size / 1e6, 1),
            })  # fmt: skip
    print(f"packages ready in {wall:.0f} s (compile times: when each was built)")
    print_table(rows)
    meta = {"wall_s": round(wall, 1), "cache_dir": str(args.cache_dir)}
    save_results("aoti_packages", rows, meta, args.out)
    return 0


def save_results(
    name: str, rows: list[dict[str, object]], meta: dict[str, object], out: str | None
) -> None:
    """bench/results/<name>.json, and a copy in ``out`` (the device run's $OUT) if given."""
    print(f"wrote {write_results(name, rows, meta)}")
    if out:
        print(f"wrote {write_results(name, rows, meta, Path(out))}")


if __name__ == "__main__":
    raise SystemExit(main())
