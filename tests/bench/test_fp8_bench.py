"""The FP8 bench runs its sections end to end at toy shapes on the CPU (``--smoke``), so
its first H200 run does not fail on a shape or an argument (the kernels themselves run
there on the interpreter only: ``TRITON_INTERPRET=1``, see bench/fp8_bench.py)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("bench.fp8_bench")
from bench import fp8_bench


@pytest.mark.slow
def test_smoke_run_writes_capacity_and_step_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert fp8_bench.main(["--smoke", "--sections", "capacity", "step"]) == 0
    payload = json.loads(Path(tempfile.gettempdir(), "h200_fp8_smoke.json").read_text())
    rows = payload["rows"]
    (capacity,) = [r for r in rows if r["op"] == "capacity"]
    assert capacity["speedup_vs_bf16"] >= 1.9  # the capacity target, HSTU-8L
    steps = [r for r in rows if r["op"] == "step"]
    assert {r["variant"] for r in steps} == {name for name, _ in fp8_bench.STEP_VARIANTS}
    assert {r["batch"] for r in steps} == set(fp8_bench.Setup.for_run(True).batches)
    for row in steps:
        assert row["speedup_vs_bf16"] > 0 and 0 < row["user_emb_rel_err_vs_bf16"] < 0.2
    assert "capacity" in capsys.readouterr().out.splitlines()[-len(rows) - 1]
