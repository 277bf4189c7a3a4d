"""Model directory -> the model the engine serves, and which backend that is.

``load_serving_model`` picks the backend: the AOTInductor package matching the model
version in ``model_cfg.aoti_cache_dir`` when there is one, else the eager module (or an
error under ``model.backend = "aoti"``; ``"eager"`` skips the package cache). Both satisfy
``ServingModel``; the engine, the metrics and the logs only ever see the backend's name.
``graphed_serving_model`` then wraps either backend in CUDA graphs on a GPU (the README,
"Backends", says which is faster where).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from streamrec.cache.kv_cache import KVCache
from streamrec.errors import ExportError, ModelError
from streamrec.models.aoti_export import ExportConfig
from streamrec.models.aoti_runtime import open_aoti_model
from streamrec.models.checkpoint import Checkpoint, load_checkpoint, load_item_table
from streamrec.models.config import HSTUConfig
from streamrec.models.prefill_attention import fused_prefill_enabled
from streamrec.models.quantization import apply_precision
from streamrec.models.serving_precision import MODEL_PRECISION, ServingPrecision
from streamrec.pipeline.graphed_model import GraphedModel, capture_serving_graphs
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.pipeline.serving_model import ServingModel
from streamrec.worker.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """What the worker needs from a model directory."""

    checkpoint: Checkpoint
    model: ServingModel
    backend: str  # "aoti", "eager", or "eager_fallback" (auto found no package)
    device: torch.device
    # Set when the item table stays on the host (``cache.embedding_cache_rows`` smaller
    # than the table): the model reads its item rows from the embedding cache, bound by
    # ``serving_stack.build_catalog``, and serves eagerly.
    item_table: torch.Tensor | None = None

    @property
    def jagged_prefill(self) -> bool:
        """The engine's prefill batching: one call where the prefill is jagged."""
        return prefill_is_jagged(self.checkpoint.config, self.device)


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelError("model.device = 'cuda' but no CUDA device is available")
    return torch.device(name)


def export_config_for(
    scoring: ScoringConfig, precision: ServingPrecision = MODEL_PRECISION
) -> ExportConfig:
    """The export settings the worker loads with; ``streamrec export`` uses the same."""
    return ExportConfig(
        retrieve_k=max(ExportConfig().retrieve_k, scoring.num_candidates), precision=precision
    )


def load_serving_model(
    model_cfg: ModelConfig,
    checkpoint: Checkpoint,
    device: torch.device,
    scoring: ScoringConfig | None = None,
    precision: ServingPrecision = MODEL_PRECISION,
) -> tuple[ServingModel, str]:
    """The AOTI package of ``checkpoint`` from the package cache, else the eager module.

    The package's runners read the checkpoint module's own tensors (one copy of the
    weights on the device, shared with the eager fallback). Compiling takes minutes, so
    the worker never compiles at start: ``streamrec export`` (an init container, an image
    build step) fills the cache ahead of time. Without a matching package the worker
    serves eager and says so in the log and in ``streamrec_model_backend``, unless
    ``model.backend = "aoti"`` makes that a start-up error, and ``"eager"`` skips the
    package cache.
    """
    if model_cfg.backend == "eager":
        log.info(
            "serving the eager model (model.backend = eager)",
            extra={"backend": "eager", "model_version": checkpoint.version, "device": str(device)},
        )
        return checkpoint.model, "eager"
    try:
        model = open_aoti_model(
            checkpoint.path,
            device,
            model_cfg.aoti_cache_dir,
            compile_if_missing=False,
            checkpoint=checkpoint,
            config=export_config_for(scoring or ScoringConfig(), precision),
            optional=("extend_scratch",),  # generation, when exported with it
            # Shapes, dtypes and devices are still checked on every call (metadata, free).
            # The value check (offsets, cached lengths) copies them to the host: one
            # synchronisation before each graph replay, which stalled the CPU until the
            # GPU drained (the worker's AOTI path ran 0.2-0.6 ms per step behind the
            # single-graph one on the H200, BENCHMARKS.md issue 15). The worker's values
            # come from ModelStep and the block pool, whose invariants are tested, and are
            # trusted as the eager kernels trust them.
            check_values=False,
        )
    except ExportError as exc:
        if model_cfg.backend == "aoti":
            raise ModelError(
                f"model.backend is 'aoti' but there is no usable AOTI package for model version "
                f"{checkpoint.version} in {str(model_cfg.aoti_cache_dir)!r}: {exc}"
            ) from exc
        log.warning(
            "no AOTI package, serving the eager model (run `streamrec export` to compile)",
            extra={
                "backend": "eager_fallback", "model_version": checkpoint.version,
                "reason": str(exc),
            },
        )  # fmt: skip
        return checkpoint.model, "eager_fallback"
    log.info(
        "serving the AOTI package",
        extra={"backend": "aoti", "model_version": checkpoint.version, "device": str(device)},
    )
    return model, "aoti"


def prefill_is_jagged(hstu: HSTUConfig, device: torch.device) -> bool:
    """Whether the served prefill runs the fused jagged op on ``device``: the eager model
    decides it per call with the same test, and an AOTI package exported on this device
    holds the op it chose (the engine then prefills every rebuilt user in one call)."""
    probe = torch.empty(0, dtype=torch.int64, device=device)
    return fused_prefill_enabled(
        "auto", probe, hstu.head_dim, hstu.num_time_buckets, hstu.time_bucket_width
    )


def set_host_threads(model_cfg: ModelConfig, device: torch.device) -> int:
    """Set torch's intra-op threads for a worker serving on ``device`` and return them:
    the configured number, else 1 on CUDA and torch's default on the CPU.

    Why 1 on CUDA: the host side of a step is small tensors (block tables, token rows,
    the results' copy back), yet torch splits a copy of more than 32k elements over every
    core, and the OpenMP workers then spin between steps. On the H200 host (16 cores) the
    AOTI worker used 3.5-5.9 cores at 5,000 events/s with 16 threads and 1.1 with one, and
    only the one-thread run sustained 5,000/s (BENCHMARKS.md, issue 13).
    """
    if model_cfg.host_threads:
        torch.set_num_threads(model_cfg.host_threads)
    elif device.type == "cuda":
        torch.set_num_threads(1)
    log.info("torch threads", extra={"threads": torch.get_num_threads(), "device": str(device)})
    return torch.get_num_threads()


def load_model(
    model_cfg: ModelConfig,
    scoring: ScoringConfig | None = None,
    embedding_cache_rows: int = 0,
    kv_dtype: str = "model",
) -> LoadedModel:
    """Load ``model_cfg.model_dir`` onto the configured device (blocking: call it off-loop),
    at ``model_cfg.weight_dtype`` and ``kv_dtype`` (``cache.kv_dtype``).

    With ``embedding_cache_rows`` smaller than the item table the table never reaches the
    device: the weights load on the host, the table is memory-mapped, and the rest of the
    model moves to the device. An AOTI package carries the whole table, so that model is
    served eagerly (an error under ``model.backend = "aoti"``).
    """
    device = resolve_device(model_cfg.device)
    precision = ServingPrecision(kv_dtype, model_cfg.weight_dtype)
    if embedding_cache_rows <= 0:
        checkpoint = load_checkpoint(model_cfg.model_dir, device=device)
        apply_precision(checkpoint.model, precision)
        model, backend = load_serving_model(model_cfg, checkpoint, device, scoring, precision)
        return LoadedModel(checkpoint=checkpoint, model=model, backend=backend, device=device)
    checkpoint = load_checkpoint(model_cfg.model_dir, device="cpu")
    apply_precision(checkpoint.model, precision)
    hstu = checkpoint.config
    if embedding_cache_rows >= hstu.num_items:  # the table fits the budget: as usual
        checkpoint.model.to(device)
        model, backend = load_serving_model(model_cfg, checkpoint, device, scoring, precision)
        return LoadedModel(checkpoint=checkpoint, model=model, backend=backend, device=device)
    if model_cfg.backend == "aoti":
        raise ModelError(
            f"cache.embedding_cache_rows={embedding_cache_rows} keeps the item table of "
            f"{hstu.num_items} rows on the host, which an AOTI package cannot: set "
            "model.backend to 'auto' or 'eager'"
        )
    table = load_item_table(checkpoint.path, hstu.torch_dtype)  # [V, D] host
    placeholder = torch.empty((0, hstu.d_model), dtype=hstu.torch_dtype, device=device)
    checkpoint.model.use_item_rows(placeholder)  # frees the host copy; the cache binds later
    checkpoint.model.to(device)
    log.info(
        "item table stays on the host: embedding cache, eager backend",
        extra={"items": hstu.num_items, "gpu_rows": embedding_cache_rows},
    )
    return LoadedModel(checkpoint, checkpoint.model, "eager", device, item_table=table)


def graphed_serving_model(
    loaded: LoadedModel,
    cache: KVCache,
    model_cfg: ModelConfig,
    max_batch_users: int,
    num_candidates: int,
) -> GraphedModel | None:
    """``loaded.model`` with extend and rank captured in CUDA graphs (either backend),
    or None where graphs do not apply: not on CUDA, or ``model.cuda_graphs`` is off.

    Blocking (captures take seconds): call it off the event loop, before serving.
    """
    if loaded.device.type != "cuda" or not model_cfg.cuda_graphs:
        return None
    hstu = loaded.checkpoint.config
    return capture_serving_graphs(
        loaded.model,
        cache,
        max_seq_len=hstu.max_seq_len,
        max_tokens=model_cfg.graph_max_tokens,
        max_users=max_batch_users,
        num_candidates=num_candidates,
        # retrieve's k is the candidate pool (the scorer's), its users the model's dtype
        retrieve=(num_candidates, hstu.d_model, hstu.torch_dtype) if num_candidates else None,
        per_octave=model_cfg.graph_buckets_per_octave,
    )
