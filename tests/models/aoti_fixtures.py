"""Shared AOTI test material: one tiny model directory and its packages, compiled once.

The packages land in the repo's ``.streamrec-cache/test-aoti`` (gitignored) under a key
that depends only on the deterministic tiny model, so a second run loads instead of
compiling (3-6 min cold on the shared 2-core CI machine for the CPU package, ~2 s warm;
the CUDA package compiles its four entry points in parallel on the GPU machine).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from streamrec.models.aoti_export import GENERATION_ENTRY_POINTS, ExportConfig, export_model
from streamrec.models.aoti_runtime import AOTIModel, open_aoti_model
from streamrec.models.checkpoint import Checkpoint, save_checkpoint
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.models.serving_precision import ServingPrecision
from streamrec.models.vocabulary import ItemVocabulary
from streamrec.schemas.events import NUM_ACTIONS
from tests.models.paged import FakePagedCache

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO / ".streamrec-cache" / "test-aoti"
# The worker's own export settings (k=256, clamped to this catalog), so the worker's
# model-loader tests find this same package.
EXPORT = ExportConfig(retrieve_k=256)
# test_quantization's package: FP8 weights and pool, the entry point that reads and writes both.
FP8_BOTH = ServingPrecision(kv_dtype="fp8_e4m3", weight_dtype="fp8")
FP8_EXPORT = ExportConfig(entry_points=("extend",), precision=FP8_BOTH)
# test_aoti_extend_scratch's package: the entry points a draft model's package holds.
GENERATION = ExportConfig(entry_points=GENERATION_ENTRY_POINTS, retrieve_k=8)
REL_TOL = 1e-5


def tiny_model_dir(path: Path) -> Path:
    """A deterministic 2-layer model (same bytes -> same model_version every run)."""
    vocab = ItemVocabulary([f"item{n}" for n in range(37)], num_oov_buckets=3)
    cfg = HSTUConfig(
        num_items=vocab.size,
        num_oov_buckets=3,
        d_model=16,
        num_layers=2,
        num_heads=2,
        head_dim=4,
        max_seq_len=24,
        num_time_buckets=8,
        task_hidden=8,
    )
    torch.manual_seed(1234)
    model = HSTU(cfg).eval()
    with torch.no_grad():  # non-zero biases so rab matters in every comparison
        for layer in model.layers:
            layer.pos_bias.normal_(0, 0.5)
            layer.time_bias.normal_(0, 0.5)
    save_checkpoint(path, model, vocab, {"model_name": "aoti-tiny"})
    return path


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-12))


@dataclass
class Batch:
    """One engine step: tokens, pool state and candidates for B users."""

    items: torch.Tensor
    actions: torch.Tensor
    ts: torch.Tensor
    offsets: torch.Tensor
    kv: torch.Tensor
    ts_pool: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    cand: torch.Tensor  # [B, 3]
    query_ts: torch.Tensor

    def extend_args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.items, self.actions, self.ts, self.offsets,
            self.kv, self.ts_pool, self.tables, self.lens,
        )  # fmt: skip

    def rank_args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.cand, self.query_ts,
            self.kv, self.ts_pool, self.tables, self.lens,
        )  # fmt: skip

    def to(self, device: str | torch.device) -> Batch:
        return Batch(**{name: t.to(device) for name, t in vars(self).items()})


def _jagged(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)


def make_batch(model: HSTU, cached: list[int], new: list[int], seed: int) -> Batch:
    """Users with ``cached[b]`` tokens already in a paged pool (written by eager prefill
    of those histories) and ``new[b]`` tokens to extend with, 3 candidates each."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    pool = FakePagedCache(model, num_blocks=4 * len(cached) + 8, block_size=4, seed=seed)
    pool.add_users(len(cached))
    hist = sum(cached)
    h_items = torch.randint(1, cfg.num_items, (hist,), generator=gen)
    h_actions = torch.randint(1, NUM_ACTIONS, (hist,), generator=gen)
    h_ts = 1_700_000_000_000 + torch.randint(0, 10**6, (hist,), generator=gen).cumsum(0)
    if hist:
        with torch.no_grad():
            k, v, _ = model.prefill(h_items, h_actions, h_ts, _jagged(cached))
        slots = [s for b, n in enumerate(cached) for s in pool.slots(b, n)]
        pool.write(slots, k, v, h_ts)
    tables, lens = pool.batch_tables()
    total = sum(new)
    return Batch(
        items=torch.randint(1, cfg.num_items, (total,), generator=gen),
        actions=torch.randint(1, NUM_ACTIONS, (total,), generator=gen),
        ts=1_800_000_000_000 + torch.randint(0, 10**6, (total,), generator=gen).cumsum(0),
        offsets=_jagged(new),
        kv=pool.kv,
        ts_pool=pool.ts,
        tables=tables,
        lens=lens,
        cand=torch.randint(1, cfg.num_items, (len(cached), 3), generator=gen),
        query_ts=torch.full((len(cached),), 1_900_000_000_000, dtype=torch.int64),
    )


def tiny_aoti_model(checkpoint: Checkpoint) -> AOTIModel:
    """The tiny model's CPU package bound to ``checkpoint.model`` (compiled on first use)."""
    return open_aoti_model(
        checkpoint.path, "cpu", CACHE_DIR, compile_if_missing=True, checkpoint=checkpoint,
        config=EXPORT, progress=print,
    )  # fmt: skip


def cuda_aoti_model(checkpoint: Checkpoint) -> AOTIModel:
    """The tiny model's CUDA package bound to ``checkpoint.model`` (loaded on CUDA),
    compiled on first use with its four entry points in parallel processes."""
    export_model(
        checkpoint.path, "cuda", CACHE_DIR, config=EXPORT, progress=print,
        jobs=len(EXPORT.entry_points),
    )  # fmt: skip
    return open_aoti_model(
        checkpoint.path, "cuda", CACHE_DIR, compile_if_missing=False, checkpoint=checkpoint,
        config=EXPORT,
    )  # fmt: skip
