import gc
import json

import numpy as np
import pytest

from bench.gc_pauses import GcPauses
from bench.worker_bench import main
from streamrec.worker.interpreter import freeze_heap


@pytest.mark.broker
@pytest.mark.slow
def test_worker_bench_runs_end_to_end_on_the_dev_broker(tmp_path) -> None:
    argv = ["--config", "small", "--device", "cpu", "--users", "24", "--events", "300"]
    argv += ["--rates", "100", "--seconds", "1.5", "--max-batch-users", "16", "--threads", "1"]
    argv += ["--event-loop", "asyncio", "--profile-loop", "100", "--profile-loop-s", "0.5"]
    assert main([*argv, "--results-dir", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "worker_bench_small_cpu.json").read_text())
    warm, throughput, latency = document["rows"]
    assert document["meta"]["event_loop"] == "asyncio"
    profile = latency["loop_profile"]  # the worker loop's callbacks, 0.5 s of the phase
    assert 0 < profile["busy_share"] <= 1 and 0.4 < profile["wall_s"] < 1.0
    names = {c["name"] for c in profile["callbacks"]}
    assert names & {"App._fetch_loop", "ServingPipeline._prepare_loop", "App._serve"}, names
    assert warm["completed"] == warm["events"] == 24
    assert warm["gpu_hit_rate"] == 0.0  # every first event is a prefill
    assert throughput["completed"] == throughput["events"] == 300
    assert throughput["gpu_hit_rate"] == 1.0  # the pool holds every user
    assert throughput["events_per_s"] > 0 and throughput["producer_events_per_s"] > 0
    assert latency["completed"] == latency["events"] == 150 == latency["e2p_events"]
    assert 0 < latency["e2p_p50_ms"] <= latency["e2p_p99_ms"] <= latency["e2p_max_ms"]
    assert 0 < latency["worker_p50_ms"] <= latency["worker_p99_ms"]
    assert latency["complete"] is True and isinstance(latency["sustained"], bool)
    assert latency["lag_at_end"] >= 0
    # the split reaches back to the producer: its lag, and record timestamp -> fetched
    assert 0 <= latency["producer_ms"]["append_lag_p50_ms"] <= latency["e2p_p50_ms"]
    assert 0 < latency["split_ms"]["transit_p50_ms"] < latency["e2p_max_ms"]
    assert latency["gc_full"]["count"] >= 0
    # the producer's heap is frozen at start: no full collection walks torch's objects
    assert latency["producer_gc_full"]["max_ms"] < 50.0
    assert document["meta"]["kv_blocks"] > 0 and document["meta"]["device"] == "cpu"


@pytest.mark.broker
@pytest.mark.slow
def test_worker_bench_runs_two_worker_processes_in_one_group(tmp_path) -> None:
    argv = ["--config", "small", "--device", "cpu", "--users", "24", "--events", "300"]
    argv += ["--rates", "100", "--seconds", "1.5", "--max-batch-users", "16", "--threads", "1"]
    argv += ["--event-loop", "asyncio", "--profile-loop", "100", "--profile-loop-s", "0.5"]
    assert main([*argv, "--processes", "2", "--results-dir", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "worker_bench_small_cpu.json").read_text())
    warm, throughput, latency = document["rows"]
    shares = latency["loop_profile"]["busy_share_per_process"]  # each child's own loop
    assert len(shares) == 2 and all(0 < s <= 1 for s in shares)
    assert document["meta"]["processes"] == 2
    assert all(row["processes"] == 2 for row in (warm, throughput, latency))
    # every event is covered once whichever process owned its user
    assert warm["completed"] == warm["events"] == 24
    assert throughput["completed"] == throughput["events"] == 300
    assert latency["completed"] == latency["events"] == 150 == latency["e2p_events"]
    assert latency["split_ms"]["step_p50_ms"] > 0  # the children's stage timings came back
    assert latency["split_ms"]["transit_p50_ms"] > 0 and "gc_full" in latency


def test_loop_profile_needs_the_asyncio_loop(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--event-loop", "uvloop", "--profile-loop", "100"])
    assert "--profile-loop times asyncio's handles" in capsys.readouterr().err


def test_process_kv_budget_covers_the_largest_partition_range() -> None:
    from aiokafka.partitioner import murmur2

    from bench.bench_plan import BLOCK_SIZE, Plan, process_kv_budget, user_blocks
    from bench.reference_config import HSTU_3L

    empty = np.zeros(0, dtype=np.int64)
    lengths = np.array([100, 2_000, 30, 4_000, 5, 700], dtype=np.int64)
    plan = Plan(lengths=lengths, prime=[], throughput=empty, rates=[])
    per_user = user_blocks(HSTU_3L, plan)
    assert per_user.tolist() == [-(-(n + 1) // BLOCK_SIZE) + 1 for n in lengths.tolist()]

    class Geometry:
        bytes_per_block = 10

    part = [(murmur2(f"u{u}".encode()) & 0x7FFFFFFF) % 3 for u in range(len(lengths))]
    by_part = [sum(b for b, p in zip(per_user, part, strict=True) if p == q) for q in range(3)]
    # three partitions, two members: one gets partitions {0, 1}, the other {2}
    _, blocks = process_kv_budget(HSTU_3L, plan, Geometry(), 3, 2)  # type: ignore[arg-type]
    assert blocks == max(by_part[0] + by_part[1], by_part[2]) + 64
    total, one = process_kv_budget(HSTU_3L, plan, Geometry(), 3, 1)  # type: ignore[arg-type]
    assert one == int(per_user.sum()) + 64 and total == one * 10


def test_a_frozen_heap_is_out_of_the_full_collections_reach() -> None:
    pauses = GcPauses()
    held = [[i] for i in range(200_000)]  # a start-up heap: tracked containers
    freeze_heap()
    try:
        before = len(pauses.pauses)
        gc.collect()
        assert gc.get_freeze_count() >= len(held)  # no later collection walks them
        assert len(pauses.pauses) == before + 1  # each full collection is timed
        assert pauses.pauses[-1][1] >= 0.0
    finally:
        gc.unfreeze()
        gc.callbacks.remove(pauses._callback)
