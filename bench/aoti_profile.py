"""Where the AOTI path's time goes on the H200 (issue 15): start-up and step, one run.

Two questions the speedup table and the start-up bench leave open:

- ``open``: ``open_packages`` took 33.9 s of a 49.6 s start (HSTU-8L, four entry
  points). Each entry point's load is timed on its own (the first of the process took
  41.8 s, the others 0.01 s), then all four again from four threads, and a cProfile of
  the first load names the frames it spends in.
- ``step``: ``incremental-aoti-graph`` is 21 % / 48 % slower than
  ``incremental-triton-graph`` at batch 8 / 64 (0.765 vs 0.915 ms faster at batch 1).
  GPU time per kernel name of one step at batch 1 and 64 on each backend (no graph: the
  profiler names every launch; a graph replays the same kernels).

    python3 -m bench.aoti_profile              # H200 (compiles the packages if missing)

Writes ``bench/results/h200_aoti_profile.json`` (and ``$OUT``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench._report import profile_text
from bench.aoti_packages import CACHE_DIR, reference_model_dir
from bench.h200_common import Batch, kernel_profile
from bench.reference_config import HSTU_8L, SPEEDUP_HISTORY_LEN
from streamrec.models.aoti_export import ExportConfig, export_model
from streamrec.models.aoti_runtime import AOTIModel, load_package
from streamrec.models.checkpoint import load_checkpoint
from streamrec.models.hstu import HSTU

RESULTS = Path(__file__).parent / "results" / "h200_aoti_profile.json"
ENTRY_POINTS = ("extend", "prefill", "retrieve", "rank")


def open_rows(model: HSTU, package: Any) -> dict[str, Any]:
    """Seconds per entry point: the loader, the weight binding; serial vs 4 threads."""
    device = torch.device("cuda")
    serial: dict[str, float] = {}
    prof = cProfile.Profile()  # the first load of the process (41.8 s on the H200, the
    prof.enable()  # next ones 0.01 s): which frames it spends in
    for name in ENTRY_POINTS:
        t0 = time.perf_counter()
        load_package(package, device, model, entry_points=(name,))
        torch.cuda.synchronize()
        serial[name] = round(time.perf_counter() - t0, 2)
        print(f"open {name}: {serial[name]} s", flush=True)
        if name == ENTRY_POINTS[0]:
            prof.disable()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(ENTRY_POINTS)) as pool:
        list(pool.map(lambda n: load_package(package, device, model, entry_points=(n,)),
                      ENTRY_POINTS))  # fmt: skip
    threaded = round(time.perf_counter() - t0, 2)
    print(f"open all four from four threads: {threaded} s (serial {sum(serial.values()):.2f})")
    text = profile_text(prof, 30)
    print(text[-6000:])
    return {"serial_s": serial, "threaded_s": threaded, "cprofile_first_load": text}


def step_rows(model: HSTU, aoti: AOTIModel, batches: list[int]) -> list[dict[str, Any]]:
    rows = []
    for batch in batches:
        data = Batch(model, batch, SPEEDUP_HISTORY_LEN, HSTU_8L.num_candidates, seed=1)
        for name, backend in (("triton", model), ("aoti", aoti.unchecked())):
            top = kernel_profile(partial(data.incremental, backend), top=14)
            total = sum(e["us"] for e in top)
            print(f"step kernels {name} batch {batch} (top 14: {total:.0f} us):")
            for e in top:
                print(f"  {e['us']:9.1f} {e['calls']:4d}  {e['kernel']}")
            rows.append({"backend": name, "batch": batch, "kernels": top})
        del data
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--sections", nargs="+", default=["open", "step"])
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    args = parser.parse_args(argv)
    model_dir = reference_model_dir(HSTU_8L)
    model = load_checkpoint(model_dir, "cuda").model
    package = export_model(
        model_dir, "cuda", args.cache_dir, config=ExportConfig(entry_points=ENTRY_POINTS),
        progress=print, jobs=len(ENTRY_POINTS),
    )  # fmt: skip
    payload: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "open" in args.sections:
        payload["open"] = open_rows(model, package)
    if "step" in args.sections:
        aoti = load_package(package, torch.device("cuda"), model)
        payload["step"] = step_rows(model, aoti, args.batches)
    text = json.dumps(payload, indent=2) + "\n"
    RESULTS.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], RESULTS.name).write_text(text)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
