"""Our fused attention side by side with Meta's open-source Triton cached HSTU attention.

The peer is ``triton_cached_hstu_mha`` of github.com/meta-recsys/generative-recommenders
(Apache-2.0). Its code is never part of this project: the lead carries the needed files
to the GPU machine under ``.carry/peer/`` (an ignored folder); without them this module
times ours alone and says so.

Same shapes on both sides (HSTU-8L layer: 4 heads x 128, N 4096, bf16, history 2,048,
batch 1 / 8 / 64), each in a CUDA graph (device time):

- ``decode``: one new token per user against its 2,048 cached keys and itself;
- ``extend16``: 16 new tokens per user, causal among themselves;
- ``rank``: 256 candidates per user against the history and each itself (the peer's
  ``num_targets``).

What differs, in the peer's favour: its K/V are contiguous per user (ours are read
through a block table from a paged pool) and it computes no relative bias (ours adds the
position and time bias). ``peer_rel_diff`` checks that both compute the same attention
when our biases are zero. The peer autotunes; by default over a shortlist of its own
configurations (``--full-autotune``: all 29), to fit the session's device budget.

    python3 -m bench.peer_attention [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench._report import print_table, write_results
from bench.attention_sweep import SweepLayer, extend_inputs, sweep_model
from bench.h200_common import graphed, pct, time_ms
from bench.reference_config import HSTU_8L
from streamrec.models.candidate_attention import fused_projection_candidates
from streamrec.models.paged_attention import fused_token_attention

PEER_DIR = Path(__file__).resolve().parent.parent / ".carry" / "peer"
PEER_MODULE = "generative_recommenders.ops.triton.triton_hstu_attention"
# (BLOCK_M, BLOCK_N, warps, stages) of the peer's own list kept by default.
PEER_SHORTLIST = {(16, 32, 2, 2), (32, 64, 4, 4), (64, 64, 4, 4), (128, 64, 8, 2), (128, 128, 8, 2)}
OPS = (("decode", 1), ("extend16", 16), ("rank", HSTU_8L.num_candidates))


def load_peer(full_autotune: bool) -> Any:
    """The peer's module from ``.carry/peer``, or None (with the reason printed)."""
    if not (PEER_DIR / "generative_recommenders").is_dir():
        print(f"peer: {PEER_DIR} not found, timing ours only")
        return None
    sys.path.insert(0, str(PEER_DIR))
    try:
        import importlib

        module = importlib.import_module(PEER_MODULE)
    except Exception as exc:  # an import chain the machine cannot satisfy
        print(f"peer: import failed: {type(exc).__name__}: {exc}"[:300])
        return None
    tuner = module._hstu_attn_fwd
    if not full_autotune and hasattr(tuner, "configs"):
        kept = [
            c for c in tuner.configs
            if (c.kwargs.get("BLOCK_M"), c.kwargs.get("BLOCK_N"), c.num_warps, c.num_stages)
            in PEER_SHORTLIST
        ]  # fmt: skip
        tuner.configs = kept or tuner.configs
    return module


def _contiguous_kv(
    lay: SweepLayer, new_k: torch.Tensor, new_v: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each user's 2,048 cached K/V rows (gathered from the pool) then its n new ones,
    jagged [B·(L+n), H, d], and the offsets [B+1]."""
    d = lay.data
    hist = int(d.ext_lens[0])
    nb = d.cache.ts.shape[0]
    blocks = d.tables.long().clamp(0, nb - 1)  # [B, MB]
    k = lay.k_cache[blocks].reshape(lay.batch, -1, lay.heads, lay.head_dim)[:, :hist]
    v = lay.v_cache[blocks].reshape(lay.batch, -1, lay.heads, lay.head_dim)[:, :hist]
    k = torch.cat([k, new_k.view(lay.batch, n, lay.heads, lay.head_dim)], 1)
    v = torch.cat([v, new_v.view(lay.batch, n, lay.heads, lay.head_dim)], 1)
    offsets = torch.arange(lay.batch + 1, device=lay.device, dtype=torch.int64) * (hist + n)
    return k.reshape(-1, lay.heads, lay.head_dim), v.reshape(-1, lay.heads, lay.head_dim), offsets


def _inputs(lay: SweepLayer, op: str, n: int) -> dict[str, torch.Tensor]:
    """The queries and new keys/values of ``op`` (n per user), shared by both sides."""
    if op != "rank":
        return extend_inputs(lay, n)
    shape = (lay.batch, n, lay.heads, lay.head_dim)
    return {"q": lay.randn(*shape), "k": lay.randn(*shape), "v": lay.randn(*shape)}


def _ours(
    lay: SweepLayer, op: str, x: dict[str, torch.Tensor], zero_bias: bool
) -> Callable[[], Any]:
    """Our op for ``op`` on this batch, as the model calls it."""
    d, layer = lay.data, lay.layer
    pos_bias = torch.zeros_like(layer.pos_bias) if zero_bias else layer.pos_bias
    time_bias = torch.zeros_like(layer.time_bias) if zero_bias else layer.time_bias
    kv = d.cache.kv[0]
    if op == "rank":
        # the candidates sit at position 2,048 and see the 2,048 history rows (the pool
        # also holds a slot for the step's new event, which the peer's K/V do not have)
        # q, k, v as rank hands them over: columns of one projection buffer
        lens, width = d.ext_lens, lay.heads * lay.head_dim
        qkv = torch.cat([x[t].flatten(-2) for t in "qkv"], dim=-1)  # [B, C, 3*H*d]
        return lambda: fused_projection_candidates(
            qkv, (0, width, 2 * width), False, lens, d.ts, kv, d.cache.ts, d.tables, lens,
            pos_bias, time_bias, lay.edges, lay.n,
        )  # fmt: skip
    return lambda: fused_token_attention(
        x["q"], x["k"], x["v"], x["pos"], x["ts"], x["users"], x["first"], kv, d.cache.ts,
        d.tables, x["lens"], pos_bias, time_bias, lay.edges, lay.n,
    )  # fmt: skip


def _peer(
    peer: Any, lay: SweepLayer, op: str, n: int, x: dict[str, torch.Tensor]
) -> Callable[[], Any]:
    k, v, offsets = _contiguous_kv(lay, x["k"], x["v"], n)
    delta_q = x["q"].reshape(-1, lay.heads, lay.head_dim)
    targets = None
    if op == "rank":
        targets = torch.full((lay.batch,), n, dtype=torch.int64, device=lay.device)
    alpha = 1.0 / math.sqrt(lay.head_dim)
    return lambda: peer.triton_cached_hstu_mha(
        lay.n, alpha, delta_q, k, v, offsets, num_targets=targets
    )


def _device_us(call: Callable[[], Any]) -> tuple[float, str]:
    """p50 device µs of ``call`` in a CUDA graph (eager if capture fails)."""
    call()
    torch.cuda.synchronize()
    try:
        return 1000 * pct(time_ms(graphed(call), 20), 50), "graph"
    except Exception as exc:  # e.g. a host-side step in the call that cannot be captured
        print(f"capture failed, timing eagerly: {type(exc).__name__}: {exc}"[:200])
        torch.cuda.synchronize()
        return 1000 * pct(time_ms(call, 20), 50), "eager"


def run(batches: list[int], peer: Any) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    model = sweep_model()
    for batch in batches:
        lay = SweepLayer(model, batch)
        for op, n in OPS:
            row: dict[str, object] = {"op": op, "batch": batch, "per_user": n}
            try:
                x = _inputs(lay, op, n)
                row["ours_us"], row["ours_timing"] = _device_us(_ours(lay, op, x, False))
                row["ours_us"] = round(float(str(row["ours_us"])), 1)
            except Exception as exc:  # report, keep the table going
                print(f"ours {op} batch {batch}: {type(exc).__name__}: {exc}"[:300])
                continue
            if peer is not None:
                try:
                    call = _peer(peer, lay, op, n, x)
                    start = time.perf_counter()
                    got = call()  # autotunes on the first call of each shape
                    row["peer_tune_s"] = round(time.perf_counter() - start, 1)
                    peer_us, row["peer_timing"] = _device_us(call)
                    row["peer_us"] = round(peer_us, 1)
                    row["speedup_vs_peer"] = round(peer_us / float(str(row["ours_us"])), 2)
                    best = getattr(peer._hstu_attn_fwd, "best_config", None)
                    row["peer_config"] = str(best)[:80] if best is not None else ""
                    want = _ours(lay, op, x, True)().float().reshape(got.shape)
                    diff = (got.float() - want).norm() / want.norm()
                    row["peer_rel_diff"] = round(float(diff), 5)
                except Exception as exc:  # the peer failing must not lose our figures
                    print(f"peer {op} batch {batch}: {type(exc).__name__}: {exc}"[:300])
                    torch.cuda.synchronize()
            rows.append(row)
        del lay
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--full-autotune", action="store_true", help="all 29 peer configs")
    parser.add_argument("--out", default=None, help="also copy the JSON here (e.g. $OUT)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    t0 = time.perf_counter()
    peer = load_peer(args.full_autotune)
    with torch.no_grad():
        rows = run(args.batches, peer)
    print_table(rows)
    meta: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "peer": "meta-recsys/generative-recommenders triton_cached_hstu_mha"
        if peer is not None
        else "absent",
        "history": 2048,
        "shape": "HSTU-8L layer: 4 heads x 128, N 4096, bf16",
        "peer_configs": "all" if args.full_autotune else sorted(PEER_SHORTLIST),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    path = write_results("peer_attention", rows, meta)
    if args.out:
        write_results("peer_attention", rows, meta, Path(args.out))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
