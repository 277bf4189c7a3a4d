"""Quality of FP8 serving on MovieLens-small: HR@10 / NDCG@10 with the FP8 KV cache and
with FP8 weights, each against bf16 of the same model (issue 18, target: within 2 %).

The protocol of BENCHMARKS.md (leave-last-out, full catalog) through
``streamrec.offline.evaluation.evaluate`` at each precision; a prefill at a precision is
exactly what incremental serving at that precision computes (tests/models/
test_quantization.py). CPU is enough: the quantization is the same arithmetic there.

    streamrec train --ratings ../shared/data/movielens-small/ratings.csv --out /tmp/ml-model
    .venv/bin/python -m bench.fp8_quality --model /tmp/ml-model \
        --ratings ../shared/data/movielens-small/ratings.csv
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from streamrec.models.serving_precision import ServingPrecision
from streamrec.offline.datasets import read_movielens
from streamrec.offline.evaluation import EvalResult, evaluate

RESULTS = Path(__file__).parent / "results" / "fp8_quality.json"
# (name, model dtype, precision); the first bf16 row is the baseline of the others.
CONFIGS = (
    ("fp32", "float32", ServingPrecision()),
    ("bf16", "bfloat16", ServingPrecision()),
    ("bf16 + fp8 kv", "bfloat16", ServingPrecision(kv_dtype="fp8_e4m3")),
    ("bf16 + fp8 weights", "bfloat16", ServingPrecision(weight_dtype="fp8")),
    ("bf16 + fp8 kv + weights", "bfloat16", ServingPrecision("fp8_e4m3", "fp8")),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="model directory")
    parser.add_argument("--ratings", type=Path, required=True, help="MovieLens ratings.csv")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = read_movielens(args.ratings)
    results: list[tuple[str, str, ServingPrecision, EvalResult, float]] = []
    for name, dtype, precision in CONFIGS:
        start = time.perf_counter()
        result = evaluate(args.model, data, k=args.k, dtype=dtype, precision=precision,
                          report=None)  # fmt: skip
        results.append((name, dtype, precision, result, time.perf_counter() - start))
        print(f"{name}: HR@{args.k} {result.model.hr:.4f} NDCG@{args.k} "
              f"{result.model.ndcg:.4f}", flush=True)  # fmt: skip
    base = next(r for name, _, _, r, _ in results if name == "bf16").model
    print(f"\n{'config':<26}{'HR@k':>9}{'NDCG@k':>9}{'HR vs bf16':>12}{'NDCG vs bf16':>14}")
    rows = []
    for name, dtype, precision, result, seconds in results:
        m = result.model
        hr_rel, ndcg_rel = m.hr / base.hr - 1.0, m.ndcg / base.ndcg - 1.0
        print(f"{name:<26}{m.hr:>9.4f}{m.ndcg:>9.4f}{hr_rel:>+11.2%} {ndcg_rel:>+13.2%}")
        rows.append({
            "config": name, "dtype": dtype, "kv_dtype": precision.kv_dtype,
            "weight_dtype": precision.weight_dtype, "k": args.k, "hr": m.hr, "ndcg": m.ndcg,
            "mrr": m.mrr, "hr_rel_vs_bf16": hr_rel, "ndcg_rel_vs_bf16": ndcg_rel,
            "users": result.num_users, "model_version": result.model_version,
            "seconds": round(seconds, 1),
        })  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], args.out.name).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
