"""PNG plots of ``bench/results/h200.json`` (issue 8): latency vs batch, speedup vs layers,
hit-rate curve. matplotlib is on the GPU image, not in the project's CPU venv.

    python3 -m bench.plots --results bench/results/h200.json --out bench/results
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def _best(rows: list[Row], prefix: str) -> dict[tuple[str, int], float]:
    """Fastest p50 per (workload, batch) among paths starting with ``prefix``."""
    best: dict[tuple[str, int], float] = {}
    for r in rows:
        if r.get("section") == "speedup" and str(r["path"]).startswith(prefix):
            key = (str(r["workload"]), int(r["batch"]))
            best[key] = min(best.get(key, float("inf")), float(r["p50_ms"]))
    return best


def plot_all(rows: list[Row], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    series: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        if r.get("section") == "speedup":
            series[(str(r["workload"]), str(r["path"]))].append((int(r["batch"]), r["p50_ms"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (workload, path), points in sorted(series.items()):
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=f"{workload} {path}")
    ax.set(xscale="log", yscale="log", xlabel="batch (users)", ylabel="p50 step latency (ms)")
    ax.set_title("H200: full recompute vs incremental step (history 2048, 256 candidates)")
    ax.legend(fontsize=6)
    written.append(_save(fig, out / "latency_vs_batch.png"))

    base, inc = _best(rows, "recompute"), _best(rows, "incremental")
    fig, ax = plt.subplots(figsize=(6, 4))
    for batch in sorted({b for _, b in base}):
        pts = sorted(
            (int(w.split("-")[1].rstrip("L")), base[(w, b)] / inc[(w, b)])
            for (w, b) in base
            if b == batch and (w, b) in inc
        )
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=f"batch {batch}")
    ax.set(xlabel="layers", ylabel="speedup (best recompute / best incremental)")
    ax.legend()
    written.append(_save(fig, out / "speedup_vs_layers.png"))

    hits = sorted(
        (float(r["hit_rate"]), float(r["p50_ms"])) for r in rows if r.get("section") == "hitrate"
    )
    if hits:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs, ys = zip(*hits)
        ax.plot([100 * x for x in xs], ys, marker="o")
        ax.set(xlabel="GPU hit rate (%) (misses onloaded from pinned host)", ylabel="p50 ms")
        ax.set_title("HSTU-8L batch 64 step latency vs hit rate")
        written.append(_save(fig, out / "hit_rate.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results", nargs="+", default=["bench/results/h200.json"], help="rows are merged"
    )
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    rows = [
        row
        for name in args.results
        for row in json.loads(Path(name).read_text(encoding="utf-8"))["rows"]
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for path in plot_all(rows, out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
