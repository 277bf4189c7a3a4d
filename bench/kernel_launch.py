"""Launch one fused attention kernel on the HSTU-8L reference batch, for a profiler.

``ncu`` (Nsight Compute) replays a kernel to read its counters; this module gives it
exactly the launches BENCHMARKS.md talks about and nothing else:

    ncu --set full -k regex:_candidate_kernel -c 1 python3 -m bench.kernel_launch --op rank
    ncu --set full -k regex:_decode -c 1 python3 -m bench.kernel_launch --op extend

Each launch uses the op's default launch shape (``streamrec.models.paged_attention``).
"""

from __future__ import annotations

import argparse

import torch

from bench.h200_bench import Batch, build_model
from bench.reference_config import HSTU_8L, SPEEDUP_HISTORY_LEN
from streamrec.models import paged_attention as pa
from streamrec.models.hstu import HSTULayer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=["rank", "extend"], required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    model = build_model(HSTU_8L)
    layer = model.layers[0]
    assert isinstance(layer, HSTULayer)
    cfg = model.config
    data = Batch(model, args.batch, SPEEDUP_HISTORY_LEN, HSTU_8L.num_candidates, seed=1)
    per_user = HSTU_8L.num_candidates if args.op == "rank" else 1
    q = torch.randn(
        args.batch, per_user, cfg.num_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16
    )  # [B, C, H, d]
    edges: torch.Tensor = model.time_edges  # type: ignore[assignment]
    tail = (data.cache.ts, data.tables, data.lens, layer.pos_bias, layer.time_bias, edges)
    k_cache, v_cache = data.cache.kv[0, 0], data.cache.kv[0, 1]
    with torch.no_grad():
        for _ in range(args.launches):
            if args.op == "rank":
                pa.launch_candidates(
                    q, data.lens, data.ts, k_cache, v_cache, *tail, cfg.max_seq_len
                )
            else:
                users = torch.arange(args.batch, device="cuda")
                pa.launch_decode(
                    q[:, 0], data.lens, data.ts, users, k_cache, v_cache, *tail, cfg.max_seq_len
                )
        torch.cuda.synchronize()
    print(f"launched {args.op} x{args.launches} at batch {args.batch}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
