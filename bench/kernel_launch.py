"""Launch one fused attention kernel on the HSTU-8L reference batch, for a profiler.

``ncu`` (Nsight Compute) replays a kernel to read its counters; this module gives it
exactly the launches BENCHMARKS.md talks about and nothing else:

    ncu --set full -k regex:_candidate_kernel -c 1 python3 -m bench.kernel_launch --op rank
    ncu --set full -k regex:_candidate_kernel -c 1 python3 -m bench.kernel_launch --op rank-packed
    ncu --set full -k regex:_decode -c 1 python3 -m bench.kernel_launch --op extend
    ncu --set full -k regex:_prefill_kernel -c 1 python3 -m bench.kernel_launch --op prefill

``rank-packed`` is the call ``HSTU.rank`` makes: q, k, v read from the columns of the
layer's projection [B, C, 4·H·d] (u, v, q, k) with its SiLU applied on load; ``rank``
passes three separate tensors, as the kernel rows of the benches do (the step's kernel
ran 366 µs a call against the row's 296 at batch 64 on the H100, 2026-12-06).

``prefill`` is the jagged causal prefill of ``--batch`` users of the warm-up's skewed
lengths (``HSTU_8L.history_lengths``, median 1,000), as the kernel sweep's
``prefill-skewed`` rows (``bench/h200_prefill``): 43-67 TFLOP/s against issue 14's 300
(its counters: BENCHMARKS.md, issue 14, seventeenth session).

Each launch uses the op's default launch shape (``streamrec.models.paged_attention``,
``candidate_attention`` and ``prefill_kernels``) on the kernel sweep's one-layer model
(``bench/attention_sweep``).
"""

from __future__ import annotations

import argparse

import torch

from bench.attention_sweep import SweepLayer, extend_inputs, sweep_model
from bench.h200_prefill import Layer, skewed_batch
from bench.reference_config import HSTU_8L
from streamrec.models import candidate_attention as ca
from streamrec.models import paged_attention as pa
from streamrec.models import prefill_attention as pfa


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=["rank", "rank-packed", "extend", "prefill"], required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=1, help="per user (extend)")
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    if args.op == "prefill":
        _prefill(args.batch, args.launches)
        print(f"launched prefill x{args.launches} at batch {args.batch}")
        return 0
    lay = SweepLayer(sweep_model(), args.batch)
    d = lay.data
    with torch.no_grad():
        if args.op == "rank":
            shape = (args.batch, HSTU_8L.num_candidates, lay.heads, lay.head_dim)
            q, k, v = lay.randn(*shape), lay.randn(*shape), lay.randn(*shape)
            for _ in range(args.launches):
                ca.launch_candidates(
                    q, k, v, d.lens, d.ts, lay.k_cache, lay.v_cache, *lay.tail, lay.n
                )
        elif args.op == "rank-packed":
            width = lay.heads * lay.head_dim
            uvqk = lay.randn(args.batch, HSTU_8L.num_candidates, 4 * width)  # [B, C, 4*H*d]
            for _ in range(args.launches):
                ca.launch_candidates(
                    uvqk, uvqk, uvqk, d.lens, d.ts, lay.k_cache, lay.v_cache, *lay.tail,
                    lay.n, columns=(2 * width, 3 * width, width), activate=True,
                )  # fmt: skip
        else:
            x = extend_inputs(lay, args.new_tokens)
            for _ in range(args.launches):
                pa.launch_decode(
                    x["q"], x["pos"], x["ts"], x["users"], x["first"], x["k"], x["v"],
                    lay.k_cache, lay.v_cache, *lay.tail_with(x["lens"]), lay.n,
                )  # fmt: skip
        torch.cuda.synchronize()
    print(f"launched {args.op} x{args.launches} at batch {args.batch}")
    return 0


def _prefill(batch: int, launches: int) -> None:
    layer = Layer(0)
    _, (q, k, v, ts, offsets) = skewed_batch(layer, batch)  # [T, H, d] x3, [T], [B+1]
    with torch.no_grad():
        for _ in range(launches):  # the op itself: its launch, sorted users' mode first
            pfa.fused_prefill_attention(q, k, v, ts, offsets, layer.pos_bias, layer.time_bias,
                                        layer.edges, layer.n)  # fmt: skip
        torch.cuda.synchronize()


if __name__ == "__main__":
    raise SystemExit(main())
