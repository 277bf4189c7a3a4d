"""Users per cache tier for the reference models: how far 100 GiB of GPU KV pool goes.

Pure arithmetic (no device needed); ``streamrec bench cache-capacity`` prints the same.
Each model appears with its bf16 pool and with an FP8 one (``cache.kv_dtype =
"fp8_e4m3"``, 1 byte per K/V element: ``HSTU-8L/fp8``).

    .venv/bin/python -m bench.cache_capacity [--gpu-gib 100] [--host-gib 64] [--disk-gib 1800]
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict
from pathlib import Path

import torch

from bench.reference_config import REFERENCE_WORKLOADS
from streamrec.cache.capacity import CapacityRow, capacity_report, capacity_table
from streamrec.cache.kv_cache import KVCacheConfig

RESULTS = Path(__file__).parent / "results" / "cache_capacity.json"
GIB = 2**30


def reference_rows(
    gpu_gib: float,
    host_gib: float,
    store_gib: float | None,
    disk_gib: float | None = None,
    block_sizes: tuple[int, ...] = (16, 32),
    history_lens: tuple[int, ...] = (1000, 2048, 4096),
) -> list[tuple[str, int, CapacityRow]]:
    rows: list[tuple[str, int, CapacityRow]] = []
    kv_dtypes = (("", None), ("/fp8", torch.float8_e4m3fn))
    for workload, (suffix, kv_dtype), block_size in itertools.product(
        REFERENCE_WORKLOADS, kv_dtypes, block_sizes
    ):
        kv = KVCacheConfig(
            num_layers=workload.num_layers,
            num_heads=workload.num_heads,
            head_dim=workload.head_dim,
            block_size=block_size,
            dtype=kv_dtype or getattr(torch, workload.dtype),
        )
        for history_len in history_lens:
            report = capacity_report(
                kv,
                history_len,
                int(gpu_gib * GIB),
                int(host_gib * GIB),
                None if store_gib is None else int(store_gib * GIB),
                None if disk_gib is None else int(disk_gib * GIB),
            )
            rows.extend((workload.name + suffix, block_size, row) for row in report)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-gib", type=float, default=100.0)
    parser.add_argument("--host-gib", type=float, default=64.0)
    parser.add_argument("--store-gib", type=float, default=64.0, help="history store memory")
    parser.add_argument("--disk-gib", type=float, default=1800.0, help="local NVMe for KV")
    args = parser.parse_args(argv)
    rows = reference_rows(args.gpu_gib, args.host_gib, args.store_gib, args.disk_gib)
    print(capacity_table(rows))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    records = [{"model": m, "block_size": b, **asdict(r)} for m, b, r in rows]
    RESULTS.write_text(json.dumps(records, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
