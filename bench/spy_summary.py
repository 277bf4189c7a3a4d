"""Where the worker processes' threads spend their samples: a py-spy raw profile, summed.

``py-spy record --subprocesses --threads --format raw`` of a three-worker bench run is
~16 MB of folded stacks (the device tool brings back far less), and most of its samples
are set-up: imports, the model load, the bench's history preload. This reads the raw
file, keeps the samples of the processes asked for (default: the bench's worker
processes), drops every stack that passes through a set-up frame, and
writes per thread the share of its samples by innermost frame (self) and by any frame
(inclusive). Samples whose innermost frame is ``Runner.run`` are counted apart: with
uvloop that is its C code (socket reads and writes, the poll), not Python.

A raw line is ``frame;frame;... count``; with ``--subprocesses`` the first frames are
``process PID:"command line"`` (the command may hold ';'), then ``thread (TID): name``.

    python -m bench.spy_summary spy.txt --out bench/results/worker_profile_X.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Frames of set-up: a stack through any of them is not serving time.
SETUP_FRAMES = (
    "_preload", "loaded_model", "_find_and_load", "prepare (multiprocessing",
    "freeze_heap", "_exitfunc", "capture_serving_graphs", "model_version (streamrec/models",
)  # fmt: skip
# A frame only the worker processes run (bench/worker_side.py's entry point).
WORKER_FRAME = "child_main (bench/worker_side.py"
_THREAD = re.compile(r";?thread \((\d+)\)(?:: ([^;]*))?;")
_PROCESS = re.compile(r'process (\d+):"')
_LINE_NO = re.compile(r":\d+\)$")


@dataclass
class ThreadProfile:
    """Samples of one thread name over the chosen processes."""

    samples: int = 0
    native: int = 0  # innermost frame Runner.run: uvloop's C code
    self_counts: Counter[str] = field(default_factory=Counter)
    inclusive: Counter[str] = field(default_factory=Counter)

    def add(self, frames: Sequence[str], count: int) -> None:
        if frames and frames[-1].startswith("Runner.run"):
            self.native += count
            return
        self.samples += count
        self.self_counts[_LINE_NO.sub(")", frames[-1]) if frames else "<none>"] += count
        for name in {_LINE_NO.sub(")", f) for f in frames}:
            self.inclusive[name] += count

    def summary(self, top: int) -> dict[str, object]:
        total = max(self.samples, 1)

        def shares(counts: Counter[str], n: int) -> dict[str, float]:
            # frames under nearly every sample are the thread's roots: no information
            common = counts.most_common(n + 20)
            return {k: round(100 * v / total, 1) for k, v in common if v < 0.98 * total}

        return {
            "samples": self.samples,
            "uvloop_native_samples": self.native,
            "self_pct": shares(self.self_counts, top),
            "inclusive_pct": shares(self.inclusive, top + 12),
        }


def parse_line(line: str) -> tuple[str, str, list[str], int] | None:
    """(pid, thread name, frames below the thread, count), or None for a malformed line."""
    stack, _, count = line.rstrip("\n").rpartition(" ")
    match = _THREAD.search(stack)
    if not stack or not count.isdigit() or match is None:
        return None
    pids = _PROCESS.findall(stack[: match.start() + 1])
    pid = pids[-1] if pids else match.group(1)
    rest = stack[match.end() :]
    return pid, match.group(2) or "", rest.split(";") if rest else [], int(count)


def summarize(
    lines: Iterable[str],
    pids: set[str] | None = None,
    setup: Sequence[str] = SETUP_FRAMES,
) -> dict[str, ThreadProfile]:
    """Profiles by thread name; ``pids`` None: the worker processes (a stack of theirs
    passes through WORKER_FRAME)."""
    parsed = [p for p in map(parse_line, lines) if p is not None]
    if pids is None:
        pids = {pid for pid, _, frames, _ in parsed if any(WORKER_FRAME in f for f in frames)}
    threads: dict[str, ThreadProfile] = defaultdict(ThreadProfile)
    for pid, name, frames, count in parsed:
        if pid not in pids or any(s in f for f in frames for s in setup):
            continue
        threads[name or "<unnamed>"].add(frames, count)
    return dict(threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("raw", type=Path, help="py-spy record --format raw output")
    parser.add_argument(
        "--pids", nargs="*", default=None, help="processes (default: the bench's workers)"
    )
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--source", default="", help="what was profiled (kept in the JSON)")
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args(argv)
    with ns.raw.open(encoding="utf-8", errors="replace") as raw:
        threads = summarize(raw, set(ns.pids) if ns.pids is not None else None)
    if not threads:
        print(f"{ns.raw}: no samples of the chosen processes", file=sys.stderr)
        return 1
    out: dict[str, object] = {"benchmark": "worker_profile", "source": ns.source}
    summaries = {name: prof.summary(ns.top) for name, prof in sorted(threads.items())}
    out |= summaries
    if ns.out is not None:
        ns.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {ns.out}")
    for name, prof in sorted(threads.items(), key=lambda kv: -kv[1].samples):
        print(f"{name}: {prof.samples} samples (+{prof.native} in uvloop's C code)")
        inclusive = summaries[name]["inclusive_pct"]
        assert isinstance(inclusive, dict)
        for frame, pct in list(inclusive.items())[:12]:
            print(f"  {pct:5.1f}%  {frame[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
