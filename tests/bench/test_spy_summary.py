"""py-spy raw profiles summed per worker thread, set-up left out."""

from __future__ import annotations

import json
from pathlib import Path

from bench.spy_summary import main, parse_line, summarize

BENCH = 'process 10:"python -m bench.worker_bench"'
WORKER = 'process 10:"";process 11:"python -c from multiprocessing.spawn import spawn_main; x"'
LOOP = (
    f"{WORKER};thread (11): MainThread;child_main (bench/worker_side.py:9);"
    "run (asyncio/runners.py:1)"
)
RAW = [
    # the worker's loop: 6 samples of publishing, 3 of preload (set-up), 2 in uvloop's C code
    f"{LOOP};ServingPipeline._publish (streamrec/worker/serving_pipeline.py:5);pack (x.py:1) 4",
    f"{LOOP};ServingPipeline._publish (streamrec/worker/serving_pipeline.py:6) 2",
    f"{LOOP};_preload (bench/engine_bench.py:93) 3",
    f"{LOOP};Runner.run (asyncio/runners.py:118) 2",
    f"{LOOP};Intake.take (streamrec/worker/intake.py:3) 4",
    f"{WORKER};thread (12): streamrec-engine_0;Scorer.score (streamrec/pipeline/scorer.py:103) 5",
    # the bench process itself, and a line that is not a stack
    f"{BENCH};thread (10): MainThread;main (bench/worker_bench.py:1) 50",
    "garbage",
]


def test_parse_line_takes_the_last_process_and_the_thread_name() -> None:
    parsed = parse_line(RAW[5])
    assert parsed == (
        "11",
        "streamrec-engine_0",
        ["Scorer.score (streamrec/pipeline/scorer.py:103)"],
        5,
    )
    assert parse_line("garbage") is None


def test_summary_keeps_worker_serving_samples_only() -> None:
    threads = summarize(RAW)
    assert set(threads) == {"MainThread", "streamrec-engine_0"}  # the bench's own thread: out
    loop = threads["MainThread"]
    assert loop.samples == 10 and loop.native == 2  # preload dropped, uvloop C apart
    summary = loop.summary(top=5)
    inclusive = summary["inclusive_pct"]
    assert isinstance(inclusive, dict)
    # line numbers merged; roots under every sample left out
    assert inclusive == {
        "ServingPipeline._publish (streamrec/worker/serving_pipeline.py)": 60.0,
        "Intake.take (streamrec/worker/intake.py)": 40.0,
        "pack (x.py)": 40.0,
    }
    assert threads["streamrec-engine_0"].samples == 5


def test_main_writes_the_json(tmp_path: Path) -> None:
    raw = tmp_path / "spy.txt"
    raw.write_text("\n".join(RAW) + "\n")
    out = tmp_path / "profile.json"
    assert main([str(raw), "--out", str(out), "--source", "test"]) == 0
    data = json.loads(out.read_text())
    assert data["source"] == "test" and data["MainThread"]["samples"] == 10
    assert main([str(raw), "--pids", "99"]) == 1  # no samples of that process
