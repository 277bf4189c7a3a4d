"""The metric names are a contract with deploy/ (alerts, dashboard)."""

from __future__ import annotations

import re
from pathlib import Path

from streamrec.cache.stats import BlockPoolStats, DiskTierStats, HostTierStats, KVTiersStats
from streamrec.pipeline.delta import Delta, UserDelta
from streamrec.pipeline.generator import GenerationStats
from streamrec.pipeline.micro_batcher import Batch, ReleaseReason
from streamrec.worker.metrics import WorkerMetrics

README = Path(__file__).resolve().parents[2] / "deploy" / "README.md"


def test_exports_exactly_the_documented_names() -> None:
    documented = set(re.findall(r"^\| `(streamrec_[a-z_]+)` \|", README.read_text(), re.M))
    metrics = WorkerMetrics()
    metrics.set_backend("eager")
    text = metrics.render()[0].decode()
    exposed = set(re.findall(r"^# HELP (streamrec_\w+) ", text, re.M))
    assert {name for name in exposed if not name.endswith("_created")} == documented


def test_cumulative_stats_become_counter_increments() -> None:
    metrics = WorkerMetrics()
    metrics.set_backend("aoti")
    assert metrics.sample("streamrec_model_backend", {"backend": "aoti"}) == 1.0
    assert metrics.sample("streamrec_model_backend", {"backend": "eager"}) == 0.0
    metrics.set_lag({("pb", 0): 5, ("pb", 1): 2})
    metrics.set_lag({("pb", 1): 3})
    assert metrics.sample("streamrec_consumer_lag", {"topic": "pb", "partition": "0"}) is None
    assert metrics.sample("streamrec_consumer_lag", {"topic": "pb", "partition": "1"}) == 3.0


def test_generation_stats_become_counters_and_a_ratio() -> None:
    metrics = WorkerMetrics()
    metrics.sync_generation(GenerationStats(tokens=20, proposed=12, accepted=9, target_calls=4))
    metrics.sync_generation(
        GenerationStats(tokens=50, proposed=20, accepted=15, target_calls=9, compactions=2)
    )
    assert metrics.sample("streamrec_generated_items_total") == 50.0
    assert metrics.sample("streamrec_speculative_proposed_total") == 20.0
    assert metrics.sample("streamrec_speculative_accepted_total") == 15.0
    assert metrics.sample("streamrec_speculative_acceptance_ratio") == 0.75
    assert metrics.sample("streamrec_generation_target_calls_total") == 9.0
    assert metrics.sample("streamrec_generation_compactions_total") == 2.0


def pool_stats(evictions: int = 0) -> BlockPoolStats:
    return BlockPoolStats(
        num_blocks=8, block_size=16, blocks_used=3, blocks_free=5, users=2, pinned_users=0,
        tokens=40, allocs=3, frees=0, evictions=evictions, evicted_blocks=0, trimmed_blocks=0,
        no_room=0,
    )  # fmt: skip


def host_stats() -> HostTierStats:
    return HostTierStats(
        num_blocks=4, blocks_used=1, users=1, offloads=2, onloads=1, drops=1,
        bytes_offloaded=0, bytes_onloaded=0,
    )  # fmt: skip


def tier_labels(metrics: WorkerMetrics) -> set[str]:
    text = metrics.render()[0].decode()
    return set(re.findall(r'^streamrec_cache_\w+_total\{tier="(\w+)"\}', text, re.M))


def test_model_info_names_the_served_model_version_and_backend() -> None:
    metrics = WorkerMetrics()
    metrics.set_model("hstu", "8ae5384748df", "aoti", "cuda")
    labels = {"name": "hstu", "version": "8ae5384748df", "backend": "aoti"}
    assert metrics.sample("streamrec_model_info", labels) == 1.0
    assert metrics.sample("streamrec_model_backend", {"backend": "aoti"}) == 1.0
    metrics.set_model("hstu", "0123456789ab", "eager", "cuda")  # a reload replaces the series
    text = metrics.render()[0].decode()
    assert text.count("streamrec_model_info{") == 1 and 'version="0123456789ab"' in text


def test_tier_series_exist_only_for_tiers_the_worker_has() -> None:
    cpu = WorkerMetrics()
    cpu.set_model("hstu", "v1", "eager", "cpu")
    assert tier_labels(cpu) == {"cpu"}  # the KV pool of a CPU worker, at 0 from the start
    cpu.sync_caches(KVTiersStats(4, 0, 2, 0, pool_stats(1), None), None)
    assert tier_labels(cpu) == {"cpu"}  # no gpu, no host tier
    assert cpu.sample("streamrec_cache_hits_total", {"tier": "cpu"}) == 4.0
    assert cpu.sample("streamrec_cache_misses_total", {"tier": "cpu"}) == 2.0

    gpu = WorkerMetrics()
    gpu.set_model("hstu", "v1", "eager", "cuda")
    assert tier_labels(gpu) == {"gpu"}
    gpu.sync_caches(KVTiersStats(4, 1, 2, 0, pool_stats(), host_stats()), None)
    assert tier_labels(gpu) == {"gpu", "host"}
    assert gpu.sample("streamrec_cache_misses_total", {"tier": "gpu"}) == 3.0


def disk_stats(verify_failures: int, staged: int) -> DiskTierStats:
    return DiskTierStats(
        budget_bytes=1 << 30, bytes_used=1 << 20, users=2, writes=3, bytes_written=1 << 20,
        write_failures=0, sync_writes=0, evictions=0, rejects=0, prefetches=3, late_reads=0,
        waited_reads=0, loads=3, bytes_read=1 << 20, read_seconds=0.1,
        verify_failures=verify_failures, staging_full=0, device_slots=4,
        device_staging_bytes=1 << 26, device_staged_loads=staged,
    )  # fmt: skip


def test_disk_tier_failures_and_device_staged_loads_are_counted_once() -> None:
    metrics = WorkerMetrics()
    metrics.set_model("hstu", "v1", "eager", "cuda")
    for staged in (2, 5, 5):  # cumulative snapshots: the counter follows, never double counts
        tiers = KVTiersStats(4, 1, 2, 0, pool_stats(), host_stats(), 1, disk_stats(1, staged))
        metrics.sync_caches(tiers, None)
    assert metrics.sample("streamrec_disk_tier_device_staged_loads_total") == 5.0
    assert metrics.sample("streamrec_disk_tier_verify_failures_total") == 1.0
    assert metrics.sample("streamrec_disk_tier_bytes") == float(1 << 20)


def test_invalid_counts_sum_the_topics_by_kind() -> None:
    metrics = WorkerMetrics()
    metrics.invalid("pb", {"key_mismatch": 2, "undecodable": 1})
    metrics.invalid("ia", {"key_mismatch": 1, "missing_key": 4})
    assert metrics.invalid_counts() == {"key_mismatch": 3, "undecodable": 1, "missing_key": 4}


def test_batches_are_counted_by_release_reason() -> None:
    metrics = WorkerMetrics()
    user = UserDelta("u1", (Delta("u1", "i1", 1, 0, "pb", 0, 0, 0.0),))
    for reason in (ReleaseReason.IDLE, ReleaseReason.IDLE, ReleaseReason.SIZE):
        metrics.observe_batch(Batch(0, (user,), reason, 0.0, 1), {})
    assert metrics.sample("streamrec_batches_released_total", {"reason": "idle"}) == 2.0
    assert metrics.sample("streamrec_batches_released_total", {"reason": "size"}) == 1.0
