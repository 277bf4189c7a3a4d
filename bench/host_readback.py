"""How the engine thread waits for a step's results: wall and CPU time of three readbacks.

Issue 13: py-spy put 41 % of the engine thread's samples in ``Scorer.score``'s ``.cpu()``,
the CUDA wait, which spins a core under the driver's default schedule. The scorer now
reads back through ``kv_cache.to_host`` (pinned copies, one blocking-sync event). This
bench isolates that choice on one GPU: a step of about ``--gpu-ms`` of matmuls, then the
scorer's three results ([B, top_k] int64 and fp32, [B, top_k, tasks] fp32) read back by

- ``cpu3``: three ``.cpu()`` calls (the scorer before), each a spinning wait;
- ``spin1``: pinned copies and one default (spinning) event;
- ``to_host``: pinned copies and one blocking-sync event (the scorer now).

Modes take turns, ``--iters`` steps each per round; per mode the wall per step (launch to
numpy) p50/p99, its excess over the GPU's own time (the wake-up), and the engine thread's
CPU time per step (``time.thread_time``).

    python3 -m bench.host_readback --gpu-ms 1 5 20     # the H200 / H100, ~20 s
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench._report import RESULTS_DIR, print_table, write_results
from streamrec.cache.kv_cache import to_host

BATCH, TOP_K, TASKS = 64, 64, 3


def _spin1(*tensors: torch.Tensor) -> list[np.ndarray]:
    return to_host(*tensors, blocking=False)


def _cpu3(*tensors: torch.Tensor) -> list[np.ndarray]:
    return [t.cpu().numpy() for t in tensors]


MODES: dict[str, Callable[..., list[np.ndarray]]] = {
    "cpu3": _cpu3,
    "spin1": _spin1,
    "to_host": to_host,
}


class Step:
    """A chain of bf16 matmuls of about ``ms`` on the GPU, then the scorer's outputs."""

    def __init__(self, ms: float) -> None:
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
        self.links = 1
        self.gpu_ms = self._time()
        self.links = max(1, round(ms / self.gpu_ms))
        self.gpu_ms = self._time()

    def __call__(self) -> tuple[torch.Tensor, ...]:
        x = self.a
        for _ in range(self.links):
            x = x @ self.a
        scores = x[:BATCH, : TOP_K * TASKS].float().reshape(BATCH, TOP_K, TASKS)
        top, order = torch.topk(scores.sum(-1), TOP_K, dim=1)  # [B, top_k]
        return order, top, scores

    def _time(self) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self()
        torch.cuda.synchronize()
        start.record()
        for _ in range(10):
            self()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 10


def measure(step: Step, rounds: int, iters: int) -> list[dict[str, object]]:
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    cpus: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        names = list(MODES)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            read = MODES[name]
            for _ in range(iters):
                wall0, cpu0 = time.perf_counter(), time.thread_time()
                read(*step())
                cpus[name].append(time.thread_time() - cpu0)
                walls[name].append(time.perf_counter() - wall0)
    rows: list[dict[str, object]] = []
    for name in MODES:
        wall = np.asarray(walls[name]) * 1e3
        cpu = np.asarray(cpus[name]) * 1e3
        rows.append(
            {
                "mode": name,
                "gpu_ms": round(step.gpu_ms, 3),
                "wall_p50_ms": round(float(np.percentile(wall, 50)), 3),
                "wall_p99_ms": round(float(np.percentile(wall, 99)), 3),
                "excess_p50_ms": round(float(np.percentile(wall, 50)) - step.gpu_ms, 3),
                "cpu_ms_per_step": round(float(cpu.mean()), 3),
                "cpu_share": round(float(cpu.sum() / wall.sum()), 3),
                "steps": len(wall),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-ms", type=float, nargs="+", default=[1.0, 5.0, 20.0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--results-dir", default=None)
    parser.add_argument("--name", default="host_readback")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    rows: list[dict[str, object]] = []
    with torch.inference_mode():
        for ms in args.gpu_ms:
            rows += measure(Step(ms), args.rounds, args.iters)
    print_table(rows)
    meta: dict[str, object] = {"rounds": args.rounds, "iters": args.iters}
    path = write_results(args.name, rows, meta, Path(args.results_dir or RESULTS_DIR))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
