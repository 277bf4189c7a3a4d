"""Dense prefill at three row widths, side by side in one run.

A cache miss rebuilds a user by a dense recompute of the whole history, padded to the
row width of its call. This compares, for the same users: every row at ``max_seq_len``
(how prefill ran before), rows as wide as the batch's longest history, and the engine's
way now: one call per power-of-two class of history length. Results are checked equal.

    .venv/bin/python -m bench.prefill_bench                          # CPU, cap 1,024
    python3 -m bench.prefill_bench --config hstu-8l --device cuda    # the H200 reference
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from bench._report import print_table, write_results
from bench.engine_bench import SMALL, WORKLOADS, _model
from bench.reference_config import ReferenceWorkload
from streamrec.models.hstu import HSTU

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="cpu-1k")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    workload = CONFIGS[args.config]
    model, _ = _model(workload, args.device)
    lengths = workload.history_lengths(args.users, seed=1)
    inputs = _jagged(lengths, model.config.num_items, args.device)
    n = model.config.max_seq_len
    rows: list[dict[str, object]] = []
    with torch.no_grad():
        full = model.prefill_states(*inputs, width=n)
        tight = model.prefill_states(*inputs)
        err = max(float((a - b).abs().max()) for a, b in zip(full, tight, strict=True))
        variants = {
            f"one call, width max_seq_len ({n})": lambda: model.prefill_states(*inputs, width=n),
            f"one call, width {model.dense_width(inputs[3])}": lambda: model.prefill(*inputs),
            "grouped by length class (engine)": lambda: _grouped(model, lengths, args.device),
        }
        base = None
        for name, fn in variants.items():
            ms = _time(fn, args.device, args.repeats)
            base = base or ms
            rows.append({
                "variant": name, "users": args.users, "ms": round(ms, 2),
                "ms_per_user": round(ms / args.users, 3), "speedup": round(base / ms, 2),
            })  # fmt: skip
    print_table(rows)
    print(
        f"{args.config} on {args.device}: histories median {int(np.median(lengths))}, "
        f"max {int(lengths.max())}; max |diff| full vs tight width {err:.2e}"
    )
    meta = {"config": args.config, "device": args.device, "lengths": lengths.tolist(),
            "max_abs_diff": err, "torch": torch.__version__}  # fmt: skip
    print(f"wrote {write_results(f'prefill_{args.config}_{args.device}', rows, meta)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
