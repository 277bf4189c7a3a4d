"""Shared output of the benchmarks: a plain-text table on stdout and a JSON file.

Every figure in BENCHMARKS.md must be traceable to the machine and library versions that
produced it, so the JSON always carries them next to the rows.
"""

from __future__ import annotations

import cProfile
import datetime as dt
import io
import json
import os
import platform
import pstats
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"
VERSIONED_PACKAGES = ("streamrec", "torch", "numpy", "msgpack", "orjson", "aiokafka", "redis")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _gpu_info() -> list[str]:
    """GPU names, but only when torch is already imported: importing it costs seconds."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


_PROBE = """
import gc, time
gc.disable()
best = float("inf")
for _ in range(REPEATS):
    t0 = time.perf_counter()
    rows = [(i, -i * 0.5, [i, i + 1]) for i in range(50_000)]
    rows.sort(key=lambda row: row[1])
    sum(len(items) for _, _, items in rows)
    {user: score for user, score, _ in rows}
    best = min(best, time.perf_counter() - t0)
print(best * 1e3)
"""


def python_probe_ms(repeats: int = 5) -> float:
    """Best of ``repeats`` timings of a fixed pure-Python workload (tuples, lists, a sort,
    a dict) in a fresh interpreter: the same host path ran 2-4x apart on GPU hosts of one
    kind and on the CPU machine from one day to the next (BENCHMARKS.md, issue 13), so
    host-bound rows carry the host's speed. A fresh process, without the collector, so that
    the bench's own threads and heap are not what it times (in the bench process after a
    run: 104.9 ms on a GPU host that gave 28.9 before it)."""
    script = _PROBE.replace("REPEATS", str(repeats))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    return round(float(done.stdout), 2)


def machine_info() -> dict[str, object]:
    versions: dict[str, str] = {}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "gpus": _gpu_info(),
        "versions": versions,
    }


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def print_table(rows: Sequence[Mapping[str, object]]) -> None:
    """Columns are the union of the rows' keys in first-seen order; numbers right-aligned."""
    if not rows:
        print("(no rows)")
        return
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_cell(row.get(col, "")) for col in columns] for row in rows]
    widths = [max(len(col), *(len(r[i]) for r in cells)) for i, col in enumerate(columns)]
    numeric = [
        all(isinstance(row.get(col), int | float) for row in rows if col in row) for col in columns
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)
        ).rstrip()

    print(line(columns))
    print("  ".join("-" * w for w in widths))
    for row_cells in cells:
        print(line(row_cells))


def write_results(
    name: str,
    rows: list[dict[str, object]],
    meta: dict[str, object],
    results_dir: Path = RESULTS_DIR,
) -> Path:
    """Write ``results_dir/<name>.json`` (rows + meta + machine), atomically; returns the path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    document = {
        "benchmark": name,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "meta": meta,
        "rows": rows,
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def profile_text(prof: cProfile.Profile, lines: int) -> str:
    """The ``lines`` functions with the most cumulative time of a cProfile, as text."""
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(lines)
    return text.getvalue()
