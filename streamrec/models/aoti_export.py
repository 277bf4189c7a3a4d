"""``torch.export`` + AOTInductor compile of HSTU's serving entry points into the cache.

Each entry point is exported on its own (a thin ``nn.Module`` around the method) with
every batch-dependent size dynamic: new tokens ``T``, users ``B`` (offsets ``B + 1``),
block-table width ``MB``, candidates ``C``, pool blocks ``NB`` and block size ``BS`` (so
one package serves any pool), and the exclusion width ``E`` of ``retrieve``. Example
inputs use B = 3 because a size-1 example would be specialised (shared/notes/aoti.md,
pitfall 2); the compiled graphs still accept B = 1 (tested).

``retrieve`` takes ``k`` as a Python int, which cannot be a graph input, so it is
compiled with ``k = ExportConfig.retrieve_k`` baked in and the runtime returns the first
``k`` columns (``topk`` is sorted, so that prefix *is* the top-k).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.export import Dim

from streamrec.errors import ExportError, ModelError
from streamrec.models.checkpoint import load_checkpoint
from streamrec.models.config import DTYPES, HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.models.inductor_setup import configure_inductor
from streamrec.models.package_cache import (
    PackageCache,
    PackageFiles,
    PackageKey,
    device_kind,
)

ENTRY_POINTS = ("prefill", "extend", "rank", "retrieve")
Progress = Callable[[str], None]
# Modules whose code is traced into the graphs (a missing one is skipped).
MODEL_CODE = (
    "streamrec.models.hstu",
    "streamrec.models.attention",
    "streamrec.models.paged_attention",
    "streamrec.models.candidate_attention",
    "streamrec.models.fused_layer",
    "streamrec.models.config",
    "streamrec.schemas.events",
)
# Example sizes for tracing; distinct values >= 2 so no two dims are confused or pinned.
_EX_USERS, _EX_TOKENS, _EX_BLOCKS, _EX_BLOCK_SIZE, _EX_WIDTH = 3, 7, 11, 4, 2
_EX_CANDS, _EX_EXCLUDE = 13, 5


@dataclass(frozen=True)
class ExportConfig:
    """What gets compiled; part of the package key, so changing it recompiles."""

    entry_points: tuple[str, ...] = ENTRY_POINTS
    retrieve_k: int = 256  # largest k ``retrieve`` serves (clamped to the catalog size)

    def __post_init__(self) -> None:
        names = tuple(self.entry_points)
        unknown = sorted(set(names) - set(ENTRY_POINTS))
        if not names or unknown or len(set(names)) != len(names):
            raise ExportError(
                f"ExportConfig.entry_points={self.entry_points!r} must be distinct names "
                f"from {ENTRY_POINTS}"
            )
        object.__setattr__(self, "entry_points", names)
        if self.retrieve_k <= 0:
            raise ExportError(f"ExportConfig.retrieve_k={self.retrieve_k!r} must be > 0")


def source_hash() -> str:
    """Hash of the model code: same weights + changed code must not load an old graph."""
    digest = hashlib.sha256()
    for name in MODEL_CODE:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None:
            digest.update(name.encode() + b"\0" + Path(spec.origin).read_bytes())
    return digest.hexdigest()[:12]


def package_key(
    model_config: HSTUConfig,
    dtype: str,
    model_version: str,
    device: torch.device,
    config: ExportConfig,
) -> PackageKey:
    """The cache key, computable from a model directory without loading its weights."""
    settings = {
        **asdict(config),
        "retrieve_k": effective_k(model_config, config),
        "code": source_hash(),
    }
    export_hash = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return PackageKey(
        model_version=model_version,
        torch_version=torch.__version__,
        device_kind=device_kind(device),
        dtype=dtype,
        export_hash=export_hash,
    )


def effective_k(model_config: HSTUConfig, config: ExportConfig) -> int:
    """``retrieve_k`` clamped to the catalog: ``topk`` cannot return more rows than exist."""
    return min(config.retrieve_k, model_config.num_items)


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ExportError(f"dtype {dtype} is not one of {sorted(DTYPES)}")


# ------------------------------------------------------------------ wrappers


class _Prefill(nn.Module):
    def __init__(self, model: HSTU) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, items: torch.Tensor, actions: torch.Tensor, ts: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.model.prefill(items, actions, ts, offsets)


class _Extend(nn.Module):
    def __init__(self, model: HSTU) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        offsets: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.model.extend(
            items, actions, ts, offsets, kv_pool, ts_pool, block_tables, cached_lens
        )


class _Rank(nn.Module):
    def __init__(self, model: HSTU) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        cand_items: torch.Tensor,
        query_ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> torch.Tensor:
        return self.model.rank(cand_items, query_ts, kv_pool, ts_pool, block_tables, cached_lens)


class _Retrieve(nn.Module):
    def __init__(self, model: HSTU, k: int) -> None:
        super().__init__()
        self.model = model
        self.k = k

    def forward(
        self, user_emb: torch.Tensor, exclude: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.retrieve(user_emb, self.k, exclude)


# ------------------------------------------------------------ example inputs


def _example(model: HSTU, name: str, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Valid example inputs of entry point ``name`` (values matter: export runs them)."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(0)
    lens = [3, 1, 3]  # sums to _EX_TOKENS
    offsets = torch.tensor([0, 3, 4, 7], dtype=torch.int64)
    items = torch.randint(1, cfg.num_items, (_EX_TOKENS,), generator=gen)
    actions = torch.randint(1, cfg.num_actions, (_EX_TOKENS,), generator=gen)
    ts = 1_700_000_000_000 + torch.arange(_EX_TOKENS, dtype=torch.int64) * 1000
    pool_shape = (
        cfg.num_layers, 2, _EX_BLOCKS, _EX_BLOCK_SIZE, cfg.num_heads, cfg.head_dim,
    )  # fmt: skip
    kv_pool = torch.randn(pool_shape, generator=gen).to(dtype)
    ts_pool = torch.zeros(_EX_BLOCKS, _EX_BLOCK_SIZE, dtype=torch.int64)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)  # [B, MB]
    cached = torch.tensor([5, 0, 8], dtype=torch.int64)
    assert sum(lens) == _EX_TOKENS and tables.shape == (_EX_USERS, _EX_WIDTH)
    out: tuple[torch.Tensor, ...]
    if name == "prefill":
        out = (items, actions, ts, offsets)
    elif name == "extend":
        out = (items, actions, ts, offsets, kv_pool, ts_pool, tables, cached)
    elif name == "rank":
        cand = torch.randint(1, cfg.num_items, (_EX_USERS, _EX_CANDS), generator=gen)
        query_ts = torch.full((_EX_USERS,), 1_700_000_100_000, dtype=torch.int64)
        out = (cand, query_ts, kv_pool, ts_pool, tables, cached)
    else:
        user_emb = torch.randn(_EX_USERS, cfg.d_model, generator=gen).to(dtype)
        exclude = torch.full((_EX_USERS, _EX_EXCLUDE), -1, dtype=torch.int64)
        out = (user_emb, exclude)
    return tuple(t.to(device) for t in out)


def _dynamic_shapes(name: str) -> tuple[dict[int, Any], ...]:
    users = Dim("B", min=1)
    offsets = {0: users + 1}
    pool = {2: Dim("NB", min=1), 3: Dim("BS", min=1)}
    ts_pool = {0: pool[2], 1: pool[3]}
    tables = {0: users, 1: Dim("MB", min=1)}
    per_user = {0: users}
    if name == "prefill":
        tokens = {0: Dim("T", min=1)}
        return (tokens, tokens, tokens, offsets)
    if name == "extend":
        tokens = {0: Dim("T", min=1)}
        return (tokens, tokens, tokens, offsets, pool, ts_pool, tables, per_user)
    if name == "rank":
        cands = {0: users, 1: Dim("C", min=1)}
        return (cands, per_user, pool, ts_pool, tables, per_user)
    return (per_user, {0: users, 1: Dim("E", min=1)})


def _wrapper(model: HSTU, name: str, config: ExportConfig) -> nn.Module:
    if name == "prefill":
        return _Prefill(model)
    if name == "extend":
        return _Extend(model)
    if name == "rank":
        return _Rank(model)
    return _Retrieve(model, effective_k(model.config, config))


# ------------------------------------------------------------------ compile


def compile_entry_point(
    model: HSTU, name: str, config: ExportConfig, device: torch.device, path: Path,
    progress: Progress | None = None,
) -> dict[str, float]:  # fmt: skip
    """Export and compile one entry point into ``path``; returns export/compile seconds."""
    say = progress or (lambda _msg: None)
    start = time.perf_counter()
    say(f"aoti: exporting {name} ...")
    try:
        with torch.no_grad():
            program = torch.export.export(
                _wrapper(model, name, config).eval(),
                _example(model, name, device),
                dynamic_shapes=_dynamic_shapes(name),
                strict=False,
            )
    except Exception as exc:  # torch raises many unrelated types from export
        raise ExportError(f"torch.export of {name} failed: {type(exc).__name__}: {exc}") from exc
    exported = time.perf_counter()
    say(f"aoti: exported {name} in {exported - start:.1f} s; compiling (30-90 s) ...")
    try:
        with warnings.catch_warnings():
            # torch's own pytree deprecation, raised from copyreg while pickling the graph.
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            torch._inductor.aoti_compile_and_package(
                program,
                package_path=str(path),
                inductor_configs={"aot_inductor.check_lowerbound": False},
            )
    except Exception as exc:  # compiler and codegen errors come in many types
        raise ExportError(
            f"AOTInductor compile of {name} failed: {type(exc).__name__}: {exc}"
        ) from exc
    done = time.perf_counter()
    say(f"aoti: compiled {name} in {done - exported:.1f} s ({path.stat().st_size / 1e6:.1f} MB)")
    return {"export_s": exported - start, "compile_s": done - exported}


def build_package(
    model: HSTU,
    model_version: str,
    cache_dir: Path | str,
    config: ExportConfig = ExportConfig(),
    progress: Progress | None = None,
    force: bool = False,
) -> PackageFiles:
    """The cached package of ``model`` (on its own device and dtype), compiled if needed.

    The model must already be on the target device in the serving dtype. Compiling
    holds the key's lock; a process that waited for it finds the package built.
    """
    param = next(model.parameters())
    root = Path(cache_dir)
    compiler = configure_inductor(root)
    cache = PackageCache(root)
    key = package_key(model.config, dtype_name(param.dtype), model_version, param.device, config)
    with cache.lock(key):
        if not force:
            try:
                return cache.open(key)
            except ExportError as exc:
                if cache.directory(key).exists():
                    (progress or (lambda _m: None))(f"aoti: rebuilding: {exc}")
        staging = cache.staging(key)
        timings: dict[str, dict[str, float]] = {}
        start = time.perf_counter()
        try:
            for name in config.entry_points:
                timings[name] = compile_entry_point(
                    model, name, config, param.device, staging / f"{name}.pt2", progress
                )
        except BaseException:
            cache.discard(staging)
            raise
        extra = {
            "model_config": model.config.to_dict(),
            "retrieve_k": effective_k(model.config, config),
            "cxx": compiler,
            "timings": timings,
            "total_s": time.perf_counter() - start,
        }
        files = {name: f"{name}.pt2" for name in config.entry_points}
        published = cache.publish(key, staging, files, extra)
    if progress is not None:
        progress(f"aoti: package ready at {published.directory} ({extra['total_s']:.0f} s)")
    return published


def export_model(
    model_dir: Path | str,
    device: str | torch.device,
    cache_dir: Path | str,
    *,
    dtype: str | None = None,
    config: ExportConfig = ExportConfig(),
    progress: Progress | None = None,
    force: bool = False,
) -> Path:
    """``streamrec export``: compile a model directory's package; returns its directory."""
    try:
        checkpoint = load_checkpoint(model_dir, device=device, dtype=dtype)
    except ModelError as exc:
        raise ExportError(f"cannot export {model_dir}: {exc}") from exc
    package = build_package(
        checkpoint.model, checkpoint.version, cache_dir, config, progress=progress, force=force
    )
    return package.directory
