"""Prefill (a cache miss rebuilds the whole history) of the same users, side by side.

Rows: the dense recompute with every row at ``max_seq_len`` (how prefill first ran) and
at the batch's longest history, then ``model.prefill`` in one call and in the engine's
way (``ModelStep._prefill``: one call per power-of-two class of history length). On the
CPU ``model.prefill`` is the dense recompute at the tight width; on CUDA with Triton it is
the fused jagged prefill (no padding), where the grouping, made for the dense recompute,
only adds calls: these two rows say whether the engine should still group. Dense results
are checked equal; ``users_per_s`` is the warm-up's rate for this model alone, to set
beside the worker bench's warm phase (issue 14: >= 2,000 users/s at HSTU-8L).

    .venv/bin/python -m bench.prefill_bench                          # CPU, cap 1,024
    python3 -m bench.prefill_bench --config hstu-8l --device cuda --users 256 --skip-dense
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from unittest import mock

import numpy as np
import torch

from bench._report import print_table, write_results
from bench.engine_bench import SMALL, WORKLOADS, _model
from bench.reference_config import ReferenceWorkload
from streamrec.models import prefill_attention
from streamrec.models.hstu import HSTU
from streamrec.models.prefill_attention import fused_prefill_enabled
from streamrec.pipeline.model_step import PREFILL_CALL_TOKENS

# The reference's shape of histories (median 1/4 of the cap, log-normal, sigma 1) at a
# size a CPU runs in seconds.
CPU_1K = ReferenceWorkload(
    name="cpu-1k", num_layers=2, d_model=64, num_heads=2, head_dim=32, max_seq_len=1024,
    num_items=5_000, num_candidates=64, dtype="float32", history_median=250,
)  # fmt: skip
CONFIGS = {**WORKLOADS, "cpu-1k": CPU_1K, "small": SMALL}

Jagged = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _jagged(lengths: np.ndarray, num_items: int, device: str) -> Jagged:
    gen = torch.Generator().manual_seed(0)
    total = int(lengths.sum())
    items = torch.randint(1, num_items, (total,), generator=gen)
    actions = torch.randint(1, 4, (total,), generator=gen)
    ts = 1_700_000_000_000 + torch.cumsum(torch.randint(0, 10**6, (total,), generator=gen), 0)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.from_numpy(lengths).cumsum(0)
    return items.to(device), actions.to(device), ts.to(device), offsets.to(device)


def _time(fn: Callable[[], object], device: str, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples)) * 1000.0


def _grouped(model: HSTU, lengths: np.ndarray, device: str) -> list[torch.Tensor]:
    """The engine's grouping (ModelStep._prefill): power-of-two classes, min 64."""
    classes = np.maximum(64, lengths - 1)
    keys = np.array([int(c).bit_length() for c in classes])
    outs = []
    for key in sorted(set(keys.tolist())):
        idx = np.flatnonzero(keys == key)
        outs.append(model.prefill(*_jagged(lengths[idx], model.config.num_items, device))[2])
    return outs


def _cut(lengths: np.ndarray, cap: int, num_items: int, device: str) -> list[Jagged]:
    """The engine's calls (ModelStep._prefill, jagged): consecutive users, at most ``cap``
    tokens a call (a user longer than ``cap`` alone), inputs built before timing."""
    calls, start, tokens = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        if tokens and tokens + n > cap:
            calls.append(lengths[start:i])
            start, tokens = i, 0
        tokens += n
    calls.append(lengths[start:])
    return [_jagged(part, num_items, device) for part in calls]


def _calls(model: HSTU, parts: list[Jagged]) -> list[torch.Tensor]:
    return [model.prefill(*x)[2] for x in parts]


def _per_element(model: HSTU, inputs: Jagged) -> object:
    """The fused prefill with every tile's time bias taken per element (the op's launch
    before it took the bias of sorted users from key positions), for the before/after."""
    with mock.patch.object(prefill_attention, "PREFILL_THRESHOLDS", False):
        return model.prefill(*inputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="cpu-1k")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-dense", action="store_true", help="model.prefill rows only")
    args = parser.parse_args(argv)
    workload = CONFIGS[args.config]
    model, _ = _model(workload, args.device)
    lengths = workload.history_lengths(args.users, seed=1)
    inputs = _jagged(lengths, model.config.num_items, args.device)
    n = model.config.max_seq_len
    cfg = model.config
    fused = fused_prefill_enabled(
        model.attention_backend, inputs[0], cfg.head_dim, cfg.num_time_buckets,
        cfg.time_bucket_width,
    )  # fmt: skip
    rows: list[dict[str, object]] = []
    with torch.no_grad():
        err = float("nan")
        variants: dict[str, Callable[[], object]] = {}
        if not args.skip_dense:  # [B, N, N] temporaries: ~0.8 GB per HSTU-8L user at N 4,096
            width = model.dense_width(inputs[3])
            full = model.prefill_states(*inputs, width=n)
            tight = model.prefill_states(*inputs, width=width)
            err = max(float((a - b).abs().max()) for a, b in zip(full, tight, strict=True))
            variants[f"dense, width max_seq_len ({n})"] = lambda: model.prefill_states(
                *inputs, width=n
            )
            variants[f"dense, width {width}"] = lambda: model.prefill_states(*inputs, width=width)
        kind = "fused jagged" if fused else "dense"
        variants[f"model.prefill ({kind}), one call"] = lambda: model.prefill(*inputs)
        variants[f"model.prefill ({kind}), grouped by length class (engine)"] = lambda: _grouped(
            model, lengths, args.device
        )
        if fused:  # the engine's calls, and twice its cut (activation memory against tails)
            for cap in (PREFILL_CALL_TOKENS, 2 * PREFILL_CALL_TOKENS):
                parts = _cut(lengths, cap, cfg.num_items, args.device)
                name = f"model.prefill ({kind}), calls of <= {cap:,} tokens"
                variants[name] = functools.partial(_calls, model, parts)
        if fused and prefill_attention.PREFILL_THRESHOLDS:  # the default before 2026-12-06
            variants[f"model.prefill ({kind}), one call, time bias per element"] = lambda: (
                _per_element(model, inputs)
            )
        base = None
        for name, fn in variants.items():
            ms = _time(fn, args.device, args.repeats)
            base = base or ms
            rows.append({
                "variant": name, "users": args.users, "ms": round(ms, 2),
                "ms_per_user": round(ms / args.users, 3),
                "users_per_s": round(1000.0 * args.users / ms, 1), "speedup": round(base / ms, 2),
            })  # fmt: skip
    print_table(rows)
    print(
        f"{args.config} on {args.device}: histories median {int(np.median(lengths))}, "
        f"max {int(lengths.max())}; max |diff| full vs tight width "
        f"{'not computed (--skip-dense)' if args.skip_dense else f'{err:.2e}'}"
    )
    meta = {"config": args.config, "device": args.device, "lengths": lengths.tolist(),
            "max_abs_diff": err, "fused_prefill": fused, "torch": torch.__version__}  # fmt: skip
    print(f"wrote {write_results(f'prefill_{args.config}_{args.device}', rows, meta)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
