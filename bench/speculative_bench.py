"""Next-k generation on the H200: speculative (draft + target) against the target alone.

The target is HSTU-8L at the reference shapes (bench/reference_config.py: D=512, 4 heads x
128, 1M items, bf16, random weights), its users' histories log-normal (median 1,000,
cap 4,096) and prefilled into a paged KV cache; the draft is a 1-layer HSTU (D=64) over
the same 1M-item vocabulary that re-encodes each user's last tokens. For each k and batch
both generators run greedily from the same cache, CUDA graphs on, and must agree exactly.

Random weights make the draft's guesses useless (acceptance ~0: row "raw"), and the speed
of speculative generation is all about acceptance. So each configuration also runs with
the draft's acceptance *forced* (rows "forced"): the draft does all of its work, then its
proposal at output position p is replaced by the target's own greedy item there when a
seeded Bernoulli(a) draw for (user, p) says so, a chosen so that the expected acceptance
rate (kept / proposed) is the wanted one. The costs are real, the
acceptance is an input: by default the rate measured on MovieLens with trained models
(bench/results/movielens_speculative.json, from bench/movielens_generation.py on the CPU).
Rows "forced-uncompacted" run the same forced draws with the generator's compaction off
(``Generator(compact=False)``: rows that finished early stay in the batch to the end), so
one run shows what compaction saves; rows "forced-catalog" the same with the draft
proposing among ``--draft-catalog`` rows (``generation.draft_catalog``) instead of all.

The forced items are first the target-only run's. In bf16 over 1M random items a user's
speculative output can leave that sequence at a near-tie (the verify computes γ + 1
positions in one call, target-only one; the H200's eleventh-session run: 23 of 64 users at
k = 20), and from there on it is offered another sequence's items and rejects nearly all,
so the acceptance reached fell to 0.30 against 0.50 forced. Before timing, the forced
items are therefore re-seated on the speculative run's own output (the same draws) until
it reproduces them, at most ``REFERENCE_PASSES`` untimed runs; ``identical`` still
compares with the target-only run, and ``reference_passes`` says how many it took.

H200 (~1-2 min): ``python3 -m bench.speculative_bench --out $OUT``; CPU smoke test:
``.venv/bin/python -m bench.speculative_bench --small``. Writes
bench/results/h200_speculative.json (``--small``: speculative_small_cpu.json) with rows
``{k, batch, mode, acceptance, speedup_vs_autoregressive, ...}``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import numpy as np
import torch

from bench._report import RESULTS_DIR, print_table, write_results
from bench.h200_common import kernel_profile
from bench.reference_config import BATCH_SIZES, HSTU_8L, ReferenceWorkload
from streamrec.cache.kv_cache import KVCache
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU, HSTULayer
from streamrec.offline.generation_evaluation import cached_users
from streamrec.pipeline.draft_catalog import DraftCatalog
from streamrec.pipeline.draft_context import DraftContext
from streamrec.pipeline.generation_config import GenerationConfig
from streamrec.pipeline.generation_workspace import ModelGeometry, Workspace
from streamrec.pipeline.generator import Generated, GenerationInputs, Generator, GenModel

MOVIELENS_RESULTS = RESULTS_DIR / "movielens_speculative.json"
DEFAULT_RATE = 0.5  # acceptance forced when the MovieLens figure is absent
REFERENCE_PASSES = 4  # untimed runs that re-seat the forced items (module docstring)
SMALL = ReferenceWorkload(
    name="small", num_layers=3, d_model=32, num_heads=2, head_dim=16, max_seq_len=256,
    num_items=5_000, dtype="float32", history_median=60,
)  # fmt: skip
BASE_TS = 1_700_000_000_000


class ForcedAcceptance(Generator):
    """Speculative generation whose draft is right at position p with probability alpha.

    The draft runs in full (its cost is measured); only its chosen item is replaced by the
    target's greedy item at that position, taken from a target-only run of the same batch.
    The reference rows follow the batch's rows into a smaller workspace (``_compact``)
    through one fixed buffer per row count, which a captured round reads in place.
    """

    def set_reference(self, items: torch.Tensor, alpha: float, seed: int) -> None:
        """items [B, k]: the target-only output; draws one Bernoulli(alpha) per (row, p)."""
        rows, k = items.shape
        cap = k + 2 * self.config.gamma + 1
        self._ref = torch.full((rows, cap), -1, dtype=torch.int64, device=self.device)
        self._ref[:, :k] = items
        self._k = k
        gen = torch.Generator().manual_seed(seed)
        self._use = (torch.rand(rows, cap, generator=gen) < alpha).to(self.device)
        self._by_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forced_items(self) -> np.ndarray:
        """[B, k] the items forced now."""
        return self._ref[:, : self._k].cpu().numpy()

    def reseat(self, items: torch.Tensor) -> None:
        """Force ``items`` [B, k] instead, with the same draws. In place: each generation
        refills the captured rounds' buffers from this one."""
        self._ref[:, : items.shape[1]] = items

    def _rows_of(self, rows: int, home: torch.Tensor) -> None:
        """Point the buffers of ``rows``-row workspaces at the reference rows ``home``."""
        if rows not in self._by_rows:
            self._by_rows[rows] = (torch.full((rows, self._ref.shape[1]), -1, dtype=torch.int64,
                                              device=self.device),
                                   torch.zeros(rows, self._ref.shape[1], dtype=torch.bool,
                                               device=self.device))  # fmt: skip
        ref, use = self._by_rows[rows]
        ref.fill_(-1)
        use.zero_()
        ref[: home.numel()] = self._ref[home]
        use[: home.numel()] = self._use[home]

    def _load(self, ws: Workspace, inputs: GenerationInputs, users: int) -> None:
        super()._load(ws, inputs, users)
        self._rows_of(ws.rows, torch.arange(min(users, self._ref.shape[0]), device=self.device))

    def _compact(
        self, home: Workspace, ws: Workspace, index: torch.Tensor | None
    ) -> tuple[Workspace, torch.Tensor]:
        small, index = super()._compact(home, ws, index)
        self._rows_of(small.rows, index)
        return small, index

    def _propose(
        self, ws: Workspace, j: int, query: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        item, ids, probs = super()._propose(ws, j, query)
        ref_rows, use_rows = self._by_rows[ws.rows]
        at = (ws.m + j).clamp(max=ref_rows.shape[1] - 1).unsqueeze(1)  # [R, 1]
        ref = ref_rows.gather(1, at).squeeze(1)
        use = use_rows.gather(1, at).squeeze(1) & (ref >= 0)
        return torch.where(use, ref, item), ids, probs


def first_divergence_gap(reference: Generated, got: Generated) -> float | None:
    """Where a user's speculative items first differ from target-only, the largest gap
    between the two chosen items' scores over those users (None: all identical). A gap at
    the scores' rounding (bf16: ~1e-2 of a cosine score near 0.5) says the two runs met a
    near-tie and broke it apart; a large one would be a wrong verify."""
    differ = reference.items != got.items  # [B, k]
    rows = np.flatnonzero(differ.any(axis=1))
    if len(rows) == 0:
        return None
    at = differ[rows].argmax(axis=1)
    gaps = np.abs(reference.scores[rows, at] - got.scores[rows, at])
    return round(float(gaps.max()), 6)


def _model(cfg: HSTUConfig, device: str, seed: int) -> HSTU:
    torch.manual_seed(seed)
    model = HSTU(cfg).eval()
    with torch.no_grad():
        for layer in model.layers:
            assert isinstance(layer, HSTULayer)
            layer.pos_bias.normal_(0, 0.3)
            layer.time_bias.normal_(0, 0.3)
    return model.to(device, cfg.torch_dtype)


def _configs(w: ReferenceWorkload, draft_layers: int, draft_len: int) -> tuple[HSTUConfig, ...]:
    target = HSTUConfig(
        num_items=w.num_items, d_model=w.d_model, num_layers=w.num_layers,
        num_heads=w.num_heads, head_dim=w.head_dim, max_seq_len=w.max_seq_len, dtype=w.dtype,
    )  # fmt: skip
    draft = HSTUConfig(
        num_items=w.num_items, d_model=64, num_layers=draft_layers, num_heads=2, head_dim=32,
        max_seq_len=draft_len, dtype=w.dtype,
    )  # fmt: skip
    return target, draft


def _histories(w: ReferenceWorkload, users: int, num_items: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for n in w.history_lengths(users, seed).tolist():
        items = rng.integers(17, num_items, n)
        actions = rng.integers(1, 5, n)
        ts = BASE_TS + np.cumsum(rng.integers(1_000, 10**7, n))
        out.append(np.stack([items, actions, ts], axis=1).astype(np.int64))
    return out


def per_position(rate: float, gamma: int) -> float:
    """The i.i.d. per-position hit probability a whose acceptance rate (kept / proposed,
    as ``GenerationStats`` counts it: a + a^2 + ... + a^gamma kept of gamma) is ``rate``."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        got = sum(a**i for i in range(1, gamma + 1)) / gamma
        lo, hi = (a, hi) if got < rate else (lo, a)
    return (lo + hi) / 2


def _acceptance_from_movielens(k: int, gamma: int) -> float:
    """The best draft's acceptance rate at ``k`` (or the nearest k) and ``gamma`` on
    MovieLens, whole catalog, over the users held out of its on-policy training where the
    file has them (the rate falls with gamma: a row of another gamma is another input)."""
    try:
        rows = [r for r in json.loads(MOVIELENS_RESULTS.read_text())["rows"]
                if r.get("acceptance") is not None and r.get("gamma", gamma) == gamma
                and not r.get("draft_catalog")]  # fmt: skip
        if any(r.get("population") == "held_out" for r in rows):
            rows = [r for r in rows if r.get("population") == "held_out"]
        nearest = min(abs(int(r["k"]) - k) for r in rows)
        return max(float(r["acceptance"]) for r in rows if abs(int(r["k"]) - k) == nearest)
    except (OSError, ValueError, KeyError) as exc:
        print(f"no MovieLens acceptance ({exc!r}); forcing {DEFAULT_RATE}")
        return DEFAULT_RATE


def _time(gen: Generator, inputs: GenerationInputs, iters: int, sync: bool) -> tuple[float, ...]:
    """(p50 ms of ``generate``, rounds per call, acceptance, compactions per call, rows the
    rounds ran over per call) after one warm-up call."""
    gen.generate(inputs)  # captures the graphs
    before = (gen.stats.rounds, gen.stats.proposed, gen.stats.accepted, gen.stats.compactions,
              gen.stats.row_rounds)  # fmt: skip
    times = []
    for _ in range(iters):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        gen.generate(inputs)  # ends with a device -> host copy of the items
        times.append((time.perf_counter() - start) * 1000.0)
    rounds = (gen.stats.rounds - before[0]) / iters
    proposed = gen.stats.proposed - before[1]
    accepted = gen.stats.accepted - before[2]
    compactions = (gen.stats.compactions - before[3]) / iters
    row_rounds = (gen.stats.row_rounds - before[4]) / iters
    acceptance = accepted / proposed if proposed else 0.0
    return statistics.median(times), rounds, acceptance, compactions, row_rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 20])
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument(
        "--acceptance", type=float, default=None,
        help="acceptance rate to force (kept / proposed; default: the MovieLens figure)",
    )  # fmt: skip
    parser.add_argument(
        "--draft-catalog", type=int, default=65_536,
        help="rows forced-catalog's draft proposes from (generation.draft_catalog; 0: no rows)",
    )  # fmt: skip
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="small model on the CPU")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument(
        "--profile", action="store_true",
        help="GPU time per kernel of both generators at the largest k and batch (CUDA)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="also copy the JSON here")
    args = parser.parse_args(argv)
    small = args.small or not torch.cuda.is_available()
    w, device = (SMALL, "cpu") if small else (HSTU_8L, "cuda")
    rates = {k: args.acceptance if args.acceptance is not None
             else _acceptance_from_movielens(k, args.gamma) for k in args.ks}  # fmt: skip
    draft_len = max(args.ks) + args.gamma + 1 + 40  # a 40-token window at the largest k
    t_cfg, d_cfg = _configs(w, args.draft_layers, draft_len)
    started = time.perf_counter()
    target, draft = _model(t_cfg, device, 0), _model(d_cfg, device, 1)
    histories = _histories(w, max(args.batches), t_cfg.num_items, seed=0)
    cache, user_emb = cached_users(target, histories, chunk=8)
    lengths = [len(h) for h in histories[:8]]
    print(f"set-up {time.perf_counter() - started:.1f} s: {w.name} on {device}, histories "
          f"{lengths}..., forced acceptance per k {rates}")  # fmt: skip
    catalog = None
    if args.draft_catalog:  # random rows: acceptance is forced, the catalog sets the cost
        rows_all = np.random.default_rng(2).permutation(
            np.arange(d_cfg.first_item_row, d_cfg.num_items)
        )
        catalog = DraftCatalog(draft, rows_all[: args.draft_catalog].astype(np.int64))
    geo_t = ModelGeometry(t_cfg, t_cfg.torch_dtype)
    geo_d = ModelGeometry(d_cfg, d_cfg.torch_dtype)
    graphs = device == "cuda" and not args.no_graphs
    rows: list[dict[str, object]] = []
    for k in args.ks:
        cfg = GenerationConfig(k=k, gamma=args.gamma)
        alpha = per_position(rates[k], args.gamma)
        for batch in args.batches:
            try:
                profile = (args.profile and device == "cuda" and k == max(args.ks)
                           and batch == max(args.batches))  # fmt: skip
                rows.extend(_one(target, draft, geo_t, geo_d, cache, user_emb, histories, cfg,
                                 batch, alpha, graphs, args.iters, device, profile,
                                 catalog))  # fmt: skip
            except Exception:  # one failing configuration must not lose the others
                traceback.print_exc()
                rows.append({"k": k, "batch": batch, "mode": "error"})
            if device == "cuda":
                torch.cuda.empty_cache()  # the finished generators' graph pools
            print_table(rows[-5:])
    meta = {
        "workload": w.name, "target": t_cfg.to_dict(), "draft": d_cfg.to_dict(),
        "gamma": args.gamma, "acceptance_forced": rates,
        "cuda_graphs": graphs,
        "seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    name = "speculative_small_cpu" if small else "h200_speculative"
    path = write_results(name, rows, meta)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, args.out / path.name)
    print(f"\n{name}: {path} ({meta['seconds']} s)")
    summary = ("k", "batch", "mode", "acceptance", "speedup_vs_autoregressive", "ar_ms",
               "spec_ms", "identical")  # fmt: skip
    print_table([{key: r.get(key) for key in summary} for r in rows])
    return 0


def _one(
    target: HSTU, draft: HSTU, geo_t: ModelGeometry, geo_d: ModelGeometry, cache: KVCache,
    user_emb: torch.Tensor,
    histories: list[np.ndarray], cfg: GenerationConfig, batch: int, alpha: float, graphs: bool,
    iters: int, device: str, profile: bool = False, catalog: DraftCatalog | None = None,
) -> list[dict[str, object]]:  # fmt: skip
    users = [str(b) for b in range(batch)]
    tables, lens = cache.batch_tables(users)
    consumed = torch.tensor(np.stack([h[-16:, 0] if len(h) >= 16 else
                                      np.pad(h[:, 0], (0, 16 - len(h)), constant_values=-1)
                                      for h in histories[:batch]]), device=device)  # fmt: skip
    last_ts = torch.tensor([int(h[-1, 2]) for h in histories[:batch]], device=device)
    inputs = GenerationInputs(user_emb[:batch], tables, lens, last_ts, consumed)
    ar = Generator(GenModel(target, geo_t), cache.kv, cache.ts, cfg, capture=graphs,
                   max_rows=batch)  # fmt: skip
    reference = ar.generate(inputs)
    ar_ms = _time(ar, inputs, iters, device == "cuda")[0]
    out: list[dict[str, object]] = []
    modes = ("raw", "forced", "forced-uncompacted") + (("forced-catalog",) if catalog else ())
    for mode in modes:
        cls = ForcedAcceptance if mode.startswith("forced") else Generator
        spec = cls(GenModel(target, geo_t), cache.kv, cache.ts, cfg, GenModel(draft, geo_d),
                   capture=graphs, max_rows=batch, compact=mode != "forced-uncompacted",
                   draft_catalog=catalog if mode == "forced-catalog" else None)  # fmt: skip
        if isinstance(spec, ForcedAcceptance):
            spec.set_reference(torch.from_numpy(reference.items).to(device), alpha, seed=batch)
        context = DraftContext(spec.window)
        for user, h in zip(users, histories, strict=False):
            context.update(user, h, replace=True)
        window, window_lens = context.batch(users, torch.device(device))
        spec_inputs = GenerationInputs(
            user_emb[:batch], tables, lens, last_ts, consumed, window, window_lens
        )
        got, passes = spec.generate(spec_inputs), 1
        while isinstance(spec, ForcedAcceptance) and passes < REFERENCE_PASSES:
            if np.array_equal(got.items, spec.forced_items()):
                break
            spec.reseat(torch.from_numpy(got.items).to(device))
            got, passes = spec.generate(spec_inputs), passes + 1
        identical = float((got.items == reference.items).all(axis=1).mean())
        gap = first_divergence_gap(reference, got)
        if profile and mode == "forced":  # GPU time per kernel of the whole generation
            kernels = {
                "autoregressive": kernel_profile(partial(ar.generate, inputs), steps=2),
                "speculative": kernel_profile(partial(spec.generate, spec_inputs), steps=2),
            }
            for name, top in kernels.items():
                print(f"kernels {name} k={cfg.k} batch {batch} (us per generation, calls):")
                for e in top:
                    print(f"  {e['us']:9.1f} {e['calls']:4d}  {e['kernel']}")
        spec_ms, rounds, accepted, compactions, row_rounds = _time(
            spec, spec_inputs, iters, device == "cuda"
        )
        tokens = batch * cfg.k
        out.append({
            "k": cfg.k, "batch": batch, "mode": mode, "acceptance": round(accepted, 3),
            "speedup_vs_autoregressive": round(ar_ms / spec_ms, 3),
            "ar_ms": round(ar_ms, 3), "spec_ms": round(spec_ms, 3),
            "ar_tokens_s": round(tokens / ar_ms * 1000.0, 1),
            "spec_tokens_s": round(tokens / spec_ms * 1000.0, 1),
            "ar_target_calls": cfg.k, "spec_rounds": rounds, "identical": identical,
            "divergence_score_gap": gap,
            "reference_passes": passes if isinstance(spec, ForcedAcceptance) else 0,
            "compactions": compactions, "row_rounds": row_rounds,
            "ar_ms_per_step": round(ar_ms / cfg.k, 3),
            "spec_ms_per_round": round(spec_ms / max(rounds + 1.0, 1.0), 3),
        })  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
