"""bench/multi_gpu_bench.py end to end on this CPU machine: CPU children at tiny scale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.multi_gpu_bench import main, owned_partitions, scaling


def test_owned_partitions_come_from_the_lag_gauge_of_one_topic() -> None:
    metrics = (
        "# TYPE streamrec_consumer_lag gauge\n"
        'streamrec_consumer_lag{partition="3",topic="pb"} 0.0\n'
        'streamrec_consumer_lag{partition="1",topic="pb"} 12.0\n'
        'streamrec_consumer_lag{partition="1",topic="ia"} 0.0\n'
        'streamrec_kv_blocks{state="used"} 4.0\n'
    )
    assert owned_partitions(metrics, "pb") == {1, 3}


def test_scaling_compares_throughput_and_the_rate_sustained_within_the_bound() -> None:
    rows = [
        {"gpus": 1, "phase": "throughput", "events_per_s": 1000.0},
        {"gpus": 1, "phase": "latency", "rate": 500.0, "sustained": True, "e2p_p99_ms": 40.0},
        {"gpus": 1, "phase": "latency", "rate": 900.0, "sustained": True, "e2p_p99_ms": 80.0},
        {"gpus": 2, "phase": "throughput", "events_per_s": 1950.0},
        {"gpus": 2, "phase": "latency", "rate": 1000.0, "sustained": True, "e2p_p99_ms": 45.0},
        {"gpus": 2, "phase": "latency", "rate": 1800.0, "sustained": False, "e2p_p99_ms": 30.0},
    ]
    row = scaling(rows, [1, 2], bound_ms=50.0)
    assert row["throughput_ratio_2"] == 1.95 and row["met"] is True
    assert row["sustained_rate_at_bound_1"] == 500.0
    assert row["sustained_rate_at_bound_2"] == 1000.0 and row["rate_ratio_at_bound_2"] == 2.0


@pytest.mark.broker
@pytest.mark.slow
def test_multi_gpu_bench_runs_end_to_end_with_two_cpu_children(tmp_path: Path) -> None:
    argv = ["--config", "small", "--cpu", "--users", "24", "--events", "240"]
    argv += ["--rates-per-gpu", "60", "--seconds", "1.5", "--drain-s", "30"]
    argv += ["--kill-rate-per-gpu", "30", "--kill-after-s", "1", "--kill-tail-s", "12"]
    argv += ["--session-timeout-ms", "6000", "--partitions", "4", "--max-batch-users", "16"]
    argv += ["--results-dir", str(tmp_path), "--log-dir", str(tmp_path / "logs")]
    assert main([*argv, "--models-dir", str(tmp_path / "models")]) == 0
    rows = json.loads((tmp_path / "worker_bench_multi_gpu.json").read_text())["rows"]
    for n in (1, 2):
        mine = {r["phase"]: r for r in rows if r.get("gpus") == n}
        assert mine["warm"]["completed"] == mine["warm"]["events"] == 24
        assert mine["warm"]["backends"] == ["eager"] * n
        assert mine["throughput"]["completed"] == mine["throughput"]["events"] == 240
        paced = mine[f"latency @ {60 * n:g}/s"]
        assert paced["complete"] is True and paced["completed"] == paced["events"]
        assert 0 < paced["e2p_p50_ms"] <= paced["e2p_p99_ms"]
    kill = next(r for r in rows if r["phase"].startswith("kill"))
    assert kill["killed_child"] == "cpu1" and kill["killed_partitions"]
    assert kill["served_again_s"] is not None and kill["served_again_s"] > 0
    assert kill["restart_ready_s"] is not None and kill["target_s"] == 11.0
    assert kill["supervisor_exit_status"] == 0  # the restarted child drained too
    assert rows[-1]["phase"] == "scaling_vs_one_gpu" and rows[-1]["throughput_ratio_2"] > 0


@pytest.mark.gpu
@pytest.mark.broker
def test_multi_gpu_bench_on_the_gpus_of_this_host(tmp_path: Path) -> None:
    """The `--gpus` path (CUDA_VISIBLE_DEVICES, model.device = cuda) at small scale: both
    counts on a two-GPU host, one GPU elsewhere."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    counts = ["1", "2"] if torch.cuda.device_count() >= 2 else ["1"]
    argv = ["--config", "small", "--counts", *counts, "--users", "64", "--events", "2000"]
    argv += ["--rates-per-gpu", "500", "--seconds", "2", "--session-timeout-ms", "6000"]
    argv += ["--kill-after-s", "1", "--kill-tail-s", "12", "--partitions", "4"]
    argv += ["--results-dir", str(tmp_path), "--log-dir", str(tmp_path / "logs")]
    assert main([*argv, "--models-dir", str(tmp_path / "models")]) == 0
    rows = json.loads((tmp_path / "worker_bench_multi_gpu.json").read_text())["rows"]
    warm = [r for r in rows if r["phase"] == "warm"]
    assert [r["completed"] for r in warm] == [64] * len(counts)
    throughput = [r for r in rows if r["phase"] == "throughput"]
    assert all(r["completed"] == 2000 for r in throughput)
