"""Offline check of next-k generation: hit rates beside the ranked list, and the draft.

Leave-last-out, like ``evaluation``: each user's history but its last event is prefilled
into a KV cache exactly as the worker would hold it after a step, the serving scorer
(retrieval top-C, then the task heads) makes the ranked list, and the generator makes the
continuation. The held-out event is the user's true next item, so the first generated
item is a next-item prediction (HR@1), and the generated list's HR@10 says whether the
item is among the 10 predicted to come next. With a draft the continuation is generated
twice, target alone and speculative: the acceptance rate is the draft's, and the two
greedy outputs must be identical.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from streamrec.cache.block_pool import NoRoom
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.errors import ModelError
from streamrec.models.checkpoint import Checkpoint, load_checkpoint
from streamrec.models.draft import load_draft
from streamrec.models.hstu import HSTU
from streamrec.offline.datasets import InteractionLog
from streamrec.pipeline.draft_catalog import DraftCatalog, load_draft_items
from streamrec.pipeline.draft_context import DraftContext
from streamrec.pipeline.generation_workspace import ModelGeometry
from streamrec.pipeline.generator import (
    GenerationConfig,
    GenerationInputs,
    GenerationStats,
    Generator,
    GenModel,
    consumed_rows,
)
from streamrec.pipeline.scorer import Scorer
from streamrec.pipeline.scoring_config import ScoringConfig


@dataclass(frozen=True)
class GenerationEvalResult:
    k: int
    gamma: int
    users: int
    ranked_hr1: float
    ranked_hr10: float
    retrieval_hr1: float
    retrieval_hr10: float
    first_generated_hr1: float
    generated_hr10: float
    acceptance_rate: float | None  # None without a draft
    greedy_identical: float | None  # share of users whose k items agree exactly
    target_calls_per_batch: dict[str, float]
    # rows the calls after the first ran over, per batch (``GenerationStats.row_rounds``)
    row_rounds_per_batch: dict[str, float]
    seconds: dict[str, float]
    model_version: str
    draft_version: str | None

    def table(self) -> str:
        rows = [
            f"{'list':<28}{'HR@1':>8}{'HR@10':>8}",
            f"{'ranked (retrieval + heads)':<28}{self.ranked_hr1:>8.4f}{self.ranked_hr10:>8.4f}",
            f"{'retrieval only':<28}{self.retrieval_hr1:>8.4f}{self.retrieval_hr10:>8.4f}",
            f"{f'generated (k={self.k})':<28}{self.first_generated_hr1:>8.4f}"
            f"{self.generated_hr10:>8.4f}",
            f"users={self.users} model_version={self.model_version}",
        ]
        if self.acceptance_rate is not None:
            rows.append(
                f"draft {self.draft_version}: gamma={self.gamma} acceptance="
                f"{self.acceptance_rate:.3f} greedy identical={self.greedy_identical:.3f} "
                f"target calls per batch {self.target_calls_per_batch} "
                f"rows per batch {self.row_rounds_per_batch}"
            )
        return "\n".join(rows)


def gen_model(ckpt: Checkpoint) -> GenModel:
    return GenModel(ckpt.model, ModelGeometry(ckpt.config, next(ckpt.model.parameters()).dtype))


def cached_users(
    model: HSTU, histories: list[np.ndarray], block_size: int = 16, chunk: int = 16
) -> tuple[KVCache, torch.Tensor]:
    """A KV cache holding a prefill of each history ([n, 3] rows), and the user embeddings.

    Users are keyed ``"0"``, ``"1"``, ... in the cache; the prefill runs ``chunk`` users at
    a time (a dense prefill's memory grows with users x the longest history squared).
    """
    cfg = model.config
    param = next(model.parameters())
    blocks = sum(-(-len(h) // block_size) for h in histories) + 1
    kv_cfg = KVCacheConfig(cfg.num_layers, cfg.num_heads, cfg.head_dim, block_size, param.dtype)
    cache = KVCache(kv_cfg, blocks, param.device)
    embs = []
    for lo in range(0, len(histories), chunk):
        part = histories[lo : lo + chunk]
        lengths = [len(h) for h in part]
        tokens = torch.from_numpy(np.concatenate(part).T.copy()).to(param.device)  # [3, T]
        offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=param.device)
        with torch.no_grad():
            k, v, user_emb = model.prefill(tokens[0], tokens[1], tokens[2], offsets)
        slots = []
        for user, n in enumerate(lengths, start=lo):
            got = cache.pool.append(str(user), n)
            if isinstance(got, NoRoom):  # sized for exactly these users: a bug if it happens
                raise ModelError(f"cache of {blocks} blocks has no room for user {user}")
            slots.append(np.asarray(got, np.int64))
        cache.write(np.concatenate(slots), k, v, tokens[2])
        embs.append(user_emb)
    return cache, torch.cat(embs)


@torch.no_grad()
def evaluate_generation(
    model_dir: Path | str,
    data: InteractionLog,
    *,
    draft_dir: Path | str | None = None,
    k: int = 10,
    gamma: int = 4,
    num_candidates: int = 100,
    action: str = "like",
    batch_size: int = 64,
    compact: bool = True,
    draft_catalog: int = 0,
    report: TextIO | None = sys.stdout,
) -> GenerationEvalResult:
    """HR@1/HR@10 of the ranked list and of the generated list; the draft's acceptance."""
    target = load_checkpoint(model_dir, dtype="float32")
    draft = None if draft_dir is None else load_draft(draft_dir, target, dtype="float32")
    catalog = None
    if draft is not None and draft_dir is not None and draft_catalog:
        catalog = DraftCatalog(draft.model, load_draft_items(draft_dir, draft_catalog))
    cfg = target.config
    history, held_out = data.leave_last_out()
    rows = target.vocab.lookup(history.items.tolist())
    truth = target.vocab.lookup(held_out.items.tolist())
    gen_cfg = GenerationConfig(k=k, gamma=gamma, action=action)
    pool = min(max(10, num_candidates), cfg.num_items - cfg.first_item_row)
    scoring = ScoringConfig(top_k=10, num_candidates=pool, exclude_recent=0)
    by_retrieval = ScoringConfig(top_k=10, num_candidates=0, exclude_recent=0)
    hits = dict.fromkeys(("ranked1", "ranked10", "retrieval1", "retrieval10", "gen1", "gen10"), 0)
    identical = 0
    seconds = {"target": 0.0, "speculative": 0.0}
    calls = {"target": GenerationStats(), "speculative": GenerationStats()}
    for lo in range(0, history.num_users, batch_size):
        users = range(lo, min(lo + batch_size, history.num_users))
        hists = []
        for u in users:
            span = history.user_slice(u)
            start = max(span.start, span.stop - cfg.max_seq_len)
            hists.append(np.stack([rows[start : span.stop], history.actions[start : span.stop],
                                   history.ts_ms[start : span.stop]], axis=1))  # fmt: skip
        cache, user_emb = cached_users(target.model, hists)
        ids = [str(b) for b in range(len(hists))]  # the cache's user keys
        tables, lens = cache.batch_tables(ids)
        seen = [h[:, 0] for h in hists]  # MovieLens never rates a movie twice: exclude all
        consumed = consumed_rows(seen)  # [B, E]
        scorer = Scorer(target.model, cache, scoring, cfg.task_names)
        last_ts = [int(h[-1, 2]) for h in hists]
        ranked = scorer.score(user_emb, seen, last_ts, ids).items  # [B, 10]
        retrieved = (
            Scorer(target.model, cache, by_retrieval, cfg.task_names)
            .score(user_emb, seen, last_ts, ids)
            .items
        )
        inputs = GenerationInputs(
            user_emb, tables, lens, torch.tensor(last_ts), torch.from_numpy(consumed)
        )
        plain = Generator(gen_model(target), cache.kv, cache.ts, gen_cfg)
        start = time.perf_counter()
        generated = plain.generate(inputs).items  # [B, k]
        seconds["target"] += time.perf_counter() - start
        _add(calls["target"], plain.stats)
        if draft is not None:
            spec = Generator(
                gen_model(target), cache.kv, cache.ts, gen_cfg, gen_model(draft),
                compact=compact, draft_catalog=catalog,
            )  # fmt: skip
            context = DraftContext(spec.window)
            for b, h in enumerate(hists):
                context.update(str(b), h, replace=True)
            window, window_lens = context.batch(ids, torch.device("cpu"))
            start = time.perf_counter()
            fast = spec.generate(replace(inputs, window=window, window_lens=window_lens)).items
            seconds["speculative"] += time.perf_counter() - start
            identical += int((fast == generated).all(axis=1).sum())
            _add(calls["speculative"], spec.stats)
        want = truth[lo : lo + len(hists)][:, None]
        for name, items in (("ranked", ranked), ("retrieval", retrieved), ("gen", generated)):
            hits[f"{name}1"] += int((items[:, :1] == want).any(axis=1).sum())
            hits[f"{name}10"] += int((items[:, :10] == want).any(axis=1).sum())
    n = history.num_users
    spec_stats = calls["speculative"]
    result = GenerationEvalResult(
        k=k,
        gamma=gamma,
        users=n,
        ranked_hr1=hits["ranked1"] / n,
        ranked_hr10=hits["ranked10"] / n,
        retrieval_hr1=hits["retrieval1"] / n,
        retrieval_hr10=hits["retrieval10"] / n,
        first_generated_hr1=hits["gen1"] / n,
        generated_hr10=hits["gen10"] / n,
        acceptance_rate=None if draft is None else spec_stats.acceptance_rate,
        greedy_identical=None if draft is None else identical / n,
        target_calls_per_batch={
            name: round(stats.target_calls / max(1, -(-n // batch_size)), 2)
            for name, stats in calls.items()
            if stats.users
        },
        row_rounds_per_batch={
            name: round(stats.row_rounds / max(1, -(-n // batch_size)), 1)
            for name, stats in calls.items()
            if stats.users
        },
        seconds={name: round(s, 3) for name, s in seconds.items() if s},
        model_version=target.version,
        draft_version=None if draft is None else draft.version,
    )
    if report is not None:
        report.write(result.table() + "\n")
        report.flush()
    return result


def _add(total: GenerationStats, part: GenerationStats) -> None:
    for f in fields(GenerationStats):
        setattr(total, f.name, getattr(total, f.name) + getattr(part, f.name))
