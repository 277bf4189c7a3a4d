"""``torch.export`` + AOTInductor compile of HSTU's serving entry points into the cache.

Each entry point is exported on its own (a thin ``nn.Module`` around the method) with
every batch-dependent size dynamic: new tokens ``T``, users ``B`` (offsets ``B + 1``),
block-table width ``MB``, candidates ``C``, pool blocks ``NB`` and block size ``BS`` (so
one package serves any pool), and the exclusion width ``E`` of ``retrieve``. Example
inputs use B = 3 because a size-1 example would be specialised (shared/notes/aoti.md,
pitfall 2); the compiled graphs still accept B = 1 (tested).

The weights are **not** compiled into the packages (``package_constants_in_so=False``):
every ``.pt2`` holds code only, and the runtime binds the tensors of the model it loaded
from the model directory (aoti_runtime.py). Before, each of the four packages carried its
own ~1 GB copy of an 8-layer model with 1M items, on disk and again on the GPU; now the
model directory's ``weights.safetensors`` is the one copy on disk and the served
module's parameters the one copy in device memory. The manifest records the name, shape
and dtype of every tensor the packages may ask for, and the runtime checks them.

``retrieve`` takes ``k`` as a Python int, which cannot be a graph input, so it is
compiled with ``k = ExportConfig.retrieve_k`` baked in and the runtime returns the first
``k`` columns (``topk`` is sorted, so that prefix *is* the top-k).

Entry points compile independently (``jobs > 1`` compiles them in parallel processes,
each loading the model directory itself): the 8-layer ``extend`` alone took 128 s on the
H200, and the four of a package run side by side in about that time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import multiprocessing
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.export import Dim

from streamrec.errors import ConfigError, ExportError, ModelError
from streamrec.models.checkpoint import CONFIG, load_checkpoint, model_version
from streamrec.models.config import DTYPES, HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.models.inductor_setup import configure_inductor
from streamrec.models.package_cache import (
    LAYOUT_VERSION,
    PackageCache,
    PackageFiles,
    PackageKey,
    device_kind,
)
from streamrec.models.quantization import apply_precision, kv_storage_dtype, model_precision
from streamrec.models.serving_precision import MODEL_PRECISION, ServingPrecision

ENTRY_POINTS = ("prefill", "extend", "rank", "retrieve")
# Compiled only when asked for (the worker asks when generation is on; a draft model's
# package holds just these two).
GENERATION_ENTRY_POINTS = ("extend_scratch", "retrieve")
KNOWN_ENTRY_POINTS = (*ENTRY_POINTS, "extend_scratch")
Progress = Callable[[str], None]
# The wrappers hold the model as ``self.model``: constant names are "model.<parameter>".
CONSTANT_PREFIX = "model."
# A constant derived from the weights, not a weight: ``retrieve``'s normalised item table.
# Traced inside the graph, the normalisation of 1M x 512 rows ran on every call (a 2 GB
# read + write and a 1 GB temporary per call and per captured bucket, H200 2026-12-04);
# bound at load to the model's cached copy (``HSTU.retrieval_table``) it runs once.
RETRIEVAL_TABLE = "retrieval_table"
# Weights stay out of the .so; check_lowerbound off so that size-1 dims are accepted.
INDUCTOR_CONFIGS: dict[str, Any] = {
    "aot_inductor.check_lowerbound": False,
    "aot_inductor.package_constants_in_so": False,
}
# Modules whose code is traced into the graphs (a missing one is skipped).
MODEL_CODE = (
    "streamrec.models.hstu",
    "streamrec.models.hstu_layer",
    "streamrec.models.attention",
    "streamrec.models.paged_attention",
    "streamrec.models.paged_tiles",
    "streamrec.models.multi_query_attention",
    "streamrec.models.candidate_attention",
    "streamrec.models.fused_layer",
    "streamrec.models.prefill_attention",
    "streamrec.models.prefill_kernels",
    "streamrec.models.time_bias_kernels",
    "streamrec.models.retrieval",
    "streamrec.models.region_append",
    "streamrec.models.resident_select",
    "streamrec.models.topk_merge",
    "streamrec.models.triton_lang",
    "streamrec.models.scratch_extend",
    "streamrec.models.config",
    "streamrec.models.fp8",
    "streamrec.models.fp8_linear",
    "streamrec.models.row_quantizer",  # (fp8_linear's row scales: traced, its PyTorch form)
    "streamrec.schemas.events",
)
# Example sizes for tracing; distinct values >= 2 so no two dims are confused or pinned.
_EX_USERS, _EX_TOKENS, _EX_BLOCKS, _EX_BLOCK_SIZE, _EX_WIDTH = 3, 7, 11, 4, 2
_EX_CANDS, _EX_EXCLUDE = 13, 5
_EX_NEW, _EX_SCRATCH = 6, 9  # extend_scratch: tokens per user, scratch slots per user


@dataclass(frozen=True)
class ExportConfig:
    """What gets compiled. ``retrieve_k`` and ``precision`` are part of the package key;
    ``entry_points`` only says which graphs a build adds (a package directory accumulates
    them). The model compiled must be at ``precision`` (``apply_precision``)."""

    entry_points: tuple[str, ...] = ENTRY_POINTS
    retrieve_k: int = 256  # largest k ``retrieve`` serves (clamped to the catalog size)
    precision: ServingPrecision = MODEL_PRECISION

    def __post_init__(self) -> None:
        names = tuple(self.entry_points)
        unknown = sorted(set(names) - set(KNOWN_ENTRY_POINTS))
        if not names or unknown or len(set(names)) != len(names):
            raise ExportError(
                f"ExportConfig.entry_points={self.entry_points!r} must be distinct names "
                f"from {KNOWN_ENTRY_POINTS}"
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
        "retrieve_k": effective_k(model_config, config),
        "code": source_hash(),
        "layout": LAYOUT_VERSION,
        "inductor": INDUCTOR_CONFIGS,
        **config.precision.key_settings(),
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


def read_model_config(model_dir: Path | str) -> HSTUConfig:
    path = Path(model_dir) / CONFIG
    try:
        return HSTUConfig.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, ConfigError) as exc:
        raise ExportError(f"cannot read model config {path}: {exc}") from exc


def tensor_dtype_label(dtype: torch.dtype) -> str:
    """ "bfloat16", "int64", ...: how the manifest spells a constant's dtype."""
    return str(dtype).removeprefix("torch.")


def constant_specs(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Name -> shape and dtype of every tensor a package of ``model`` may bind."""
    specs = {
        CONSTANT_PREFIX + name: {"shape": list(t.shape), "dtype": tensor_dtype_label(t.dtype)}
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    }
    weight = model.get_parameter("item_emb.weight")  # the normalised table's shape
    label = tensor_dtype_label(weight.dtype)
    specs[RETRIEVAL_TABLE] = {"shape": list(weight.shape), "dtype": label}
    return specs


def derived_constant(model: nn.Module, fqn: str) -> torch.Tensor | None:
    """The tensor bound to a package constant that is not a weight (None: a weight)."""
    if fqn != RETRIEVAL_TABLE:
        return None
    assert isinstance(model, HSTU), f"{fqn} needs an HSTU, got {type(model).__name__}"
    return model.retrieval_table.get(model.item_emb.weight)  # [V, D], cached


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


class _ExtendScratch(nn.Module):
    def __init__(self, model: HSTU) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
        scratch_kv: torch.Tensor,
        scratch_ts: torch.Tensor,
        scratch_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.model.extend_scratch(
            items, actions, ts, kv_pool, ts_pool, block_tables, cached_lens, scratch_kv,
            scratch_ts, scratch_lens,
        )  # fmt: skip


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
        table = derived_constant(model, RETRIEVAL_TABLE)  # values matter only for export
        self.register_buffer(RETRIEVAL_TABLE, table, persistent=False)

    def forward(
        self, user_emb: torch.Tensor, exclude: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.get_buffer(RETRIEVAL_TABLE)  # [V, D], a package constant
        return self.model.retrieve(user_emb, self.k, exclude, table)


# ------------------------------------------------------------ example inputs


def _example(model: HSTU, name: str, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Valid example inputs of entry point ``name`` (values matter: export runs them)."""
    cfg = model.config
    dtype = model.item_emb.weight.dtype
    gen = torch.Generator().manual_seed(0)
    lens = [3, 1, 3]  # sums to _EX_TOKENS
    offsets = torch.tensor([0, 3, 4, 7], dtype=torch.int64)
    items = torch.randint(1, cfg.num_items, (_EX_TOKENS,), generator=gen)
    actions = torch.randint(1, cfg.num_actions, (_EX_TOKENS,), generator=gen)
    ts = 1_700_000_000_000 + torch.arange(_EX_TOKENS, dtype=torch.int64) * 1000
    pool_shape = (
        cfg.num_layers, 2, _EX_BLOCKS, _EX_BLOCK_SIZE, cfg.num_heads, cfg.head_dim,
    )  # fmt: skip
    kv_dtype = kv_storage_dtype(model_precision(model), dtype)
    kv_pool = torch.randn(pool_shape, generator=gen).to(kv_dtype)
    ts_pool = torch.zeros(_EX_BLOCKS, _EX_BLOCK_SIZE, dtype=torch.int64)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)  # [B, MB]
    cached = torch.tensor([5, 0, 8], dtype=torch.int64)
    assert sum(lens) == _EX_TOKENS and tables.shape == (_EX_USERS, _EX_WIDTH)
    out: tuple[torch.Tensor, ...]
    if name == "prefill":
        out = (items, actions, ts, offsets)
    elif name == "extend":
        out = (items, actions, ts, offsets, kv_pool, ts_pool, tables, cached)
    elif name == "extend_scratch":
        shape = (_EX_USERS, _EX_NEW)
        new_items = torch.randint(1, cfg.num_items, shape, generator=gen)
        new_actions = torch.randint(1, cfg.num_actions, shape, generator=gen)
        new_ts = 1_700_000_200_000 + torch.arange(_EX_USERS * _EX_NEW).view(shape) * 1000
        scratch_shape = (cfg.num_layers, 2, _EX_USERS, _EX_SCRATCH, cfg.num_heads, cfg.head_dim)
        scratch = torch.randn(scratch_shape, generator=gen).to(dtype)
        scratch_ts = torch.full((_EX_USERS, _EX_SCRATCH), 1_700_000_150_000, dtype=torch.int64)
        scratch_lens = torch.tensor([2, 0, 3], dtype=torch.int64)
        out = (new_items, new_actions, new_ts, kv_pool, ts_pool, tables, cached, scratch,
               scratch_ts, scratch_lens)  # fmt: skip
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
    if name == "extend_scratch":
        new = {0: users, 1: Dim("Q", min=1)}
        span = Dim("S", min=1)
        scratch = {2: users, 3: span}
        return (new, new, new, pool, ts_pool, tables, per_user, scratch, {0: users, 1: span},
                per_user)  # fmt: skip
    if name == "rank":
        cands = {0: users, 1: Dim("C", min=1)}
        return (cands, per_user, pool, ts_pool, tables, per_user)
    return (per_user, {0: users, 1: Dim("E", min=1)})


def _wrapper(model: HSTU, name: str, config: ExportConfig) -> nn.Module:
    if name == "prefill":
        return _Prefill(model)
    if name == "extend":
        return _Extend(model)
    if name == "extend_scratch":
        return _ExtendScratch(model)
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
    if model_precision(model) != config.precision:
        raise ExportError(
            f"the model is at {model_precision(model)}, the export config says "
            f"{config.precision}: apply_precision first"
        )
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
    say(f"aoti: exported {name} in {exported - start:.1f} s; compiling (30-130 s) ...")
    try:
        with warnings.catch_warnings():
            # torch's own pytree deprecation, raised from copyreg while pickling the graph.
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(path), inductor_configs=dict(INDUCTOR_CONFIGS)
            )
    except Exception as exc:  # compiler and codegen errors come in many types
        raise ExportError(
            f"AOTInductor compile of {name} failed: {type(exc).__name__}: {exc}"
        ) from exc
    done = time.perf_counter()
    say(f"aoti: compiled {name} in {done - exported:.1f} s ({path.stat().st_size / 1e6:.1f} MB)")
    return {"export_s": exported - start, "compile_s": done - exported}


# Compiles the named entry points into a staging directory: name -> timings.
CompileMissing = Callable[[list[str], Path], dict[str, dict[str, float]]]


def _build(
    cache: PackageCache,
    key: PackageKey,
    config: ExportConfig,
    model_config: HSTUConfig,
    specs: dict[str, dict[str, Any]],
    compile_missing: CompileMissing,
    progress: Progress | None,
    force: bool,
) -> PackageFiles:
    """The key's package with at least ``config.entry_points``; compiles what is missing.

    Holds the key's lock: a process that waited for it finds the entry points built.
    Entry points already in the package are carried over (hard links), not recompiled.
    """
    say = progress or (lambda _m: None)
    with cache.lock(key):
        current: PackageFiles | None = None
        if not force:
            try:
                current = cache.open(key)
            except ExportError as exc:
                if cache.directory(key).exists():
                    say(f"aoti: rebuilding: {exc}")
        missing = [n for n in config.entry_points if current is None or n not in current.files]
        if current is not None and not missing:
            return current
        staging = cache.staging(key)
        start = time.perf_counter()
        try:
            files = cache.carry_over(current, staging) if current is not None else {}
            timings = compile_missing(missing, staging)
        except BaseException:
            cache.discard(staging)
            raise
        files.update({name: f"{name}.pt2" for name in missing})
        old_timings = dict(current.manifest.get("timings", {})) if current is not None else {}
        extra = {
            "model_config": model_config.to_dict(),
            "retrieve_k": effective_k(model_config, config),
            "cxx": configure_inductor(cache.root),
            "constants": specs,
            "kv_dtype": config.precision.kv_dtype,
            "timings": {**old_timings, **timings},
            "total_s": time.perf_counter() - start,
        }
        published = cache.publish(key, staging, files, extra)
    say(f"aoti: package ready at {published.directory} ({extra['total_s']:.0f} s)")
    return published


def build_package(
    model: HSTU,
    model_version: str,
    cache_dir: Path | str,
    config: ExportConfig = ExportConfig(),
    progress: Progress | None = None,
    force: bool = False,
) -> PackageFiles:
    """The cached package of ``model`` (on its own device and dtype), compiled if needed.

    The model must already be on the target device in the serving dtype; its entry
    points compile one after the other in this process.
    """
    param = model.item_emb.weight
    root = Path(cache_dir)
    configure_inductor(root)
    key = package_key(model.config, dtype_name(param.dtype), model_version, param.device, config)

    def compile_here(missing: list[str], staging: Path) -> dict[str, dict[str, float]]:
        return {
            name: compile_entry_point(
                model, name, config, param.device, staging / f"{name}.pt2", progress
            )
            for name in missing
        }

    specs = constant_specs(model)
    return _build(
        PackageCache(root), key, config, model.config, specs, compile_here, progress, force
    )


def _compile_in_child(
    model_dir: str, device: str, dtype: str, name: str, config: ExportConfig, path: str,
    cache_root: str,
) -> dict[str, float]:  # fmt: skip
    """One entry point in a fresh (spawned) process: it loads the model directory itself."""
    configure_inductor(Path(cache_root))
    try:
        checkpoint = load_checkpoint(model_dir, device=device, dtype=dtype)
    except ModelError as exc:
        raise ExportError(f"cannot export {model_dir}: {exc}") from exc
    apply_precision(checkpoint.model, config.precision)

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    return compile_entry_point(
        checkpoint.model, name, config, torch.device(device), Path(path), say
    )


def export_model(
    model_dir: Path | str,
    device: str | torch.device,
    cache_dir: Path | str,
    *,
    dtype: str | None = None,
    config: ExportConfig = ExportConfig(),
    progress: Progress | None = None,
    force: bool = False,
    jobs: int = 1,
) -> PackageFiles:
    """``streamrec export``: compile a model directory's package (``jobs`` entry points at
    a time, each in its own process when > 1); returns the package."""
    if jobs < 1:
        raise ExportError(f"jobs={jobs} must be >= 1")
    if jobs == 1:
        try:
            checkpoint = load_checkpoint(model_dir, device=device, dtype=dtype)
        except ModelError as exc:
            raise ExportError(f"cannot export {model_dir}: {exc}") from exc
        apply_precision(checkpoint.model, config.precision)
        return build_package(
            checkpoint.model, checkpoint.version, cache_dir, config, progress=progress,
            force=force,
        )  # fmt: skip
    model_config = read_model_config(model_dir)
    dtype = dtype or model_config.dtype
    if dtype not in DTYPES:
        raise ExportError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
    try:
        version = model_version(model_dir)
    except ModelError as exc:
        raise ExportError(str(exc)) from exc
    target = torch.device(device)
    root = Path(cache_dir)
    configure_inductor(root)
    key = package_key(model_config, dtype, version, target, config)
    with torch.device("meta"):  # shapes and dtypes only: no memory, no init
        shapes = apply_precision(HSTU(model_config).to(DTYPES[dtype]), config.precision)

    def compile_apart(missing: list[str], staging: Path) -> dict[str, dict[str, float]]:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        workers = min(jobs, len(missing))
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            futures = {}
            for name in missing:
                out = str(staging / f"{name}.pt2")
                futures[name] = pool.submit(
                    _compile_in_child, str(model_dir), str(target), dtype, name, config, out,
                    str(root),
                )  # fmt: skip
            return {name: future.result() for name, future in futures.items()}

    specs = constant_specs(shapes)
    return _build(
        PackageCache(root), key, config, model_config, specs, compile_apart, progress, force
    )
