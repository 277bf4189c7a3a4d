"""Model directory -> the model the engine serves, and which backend that is.

The seam for the AOTInductor backend is ``load_serving_model``: it gets the loaded
checkpoint (weights, vocabulary, version) and the device and returns something satisfying
``ServingModel`` plus the backend's name. Today it returns the eager module; the AOTI
loader (``streamrec.models.aoti*``) plugs in there: look for a package matching the model
version in ``model_cfg.aoti_cache_dir``, load it, else fall back to eager (or raise when
``require_aoti``). Everything else (engine, metrics, logs) already reports the name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from streamrec.errors import ModelError
from streamrec.models.checkpoint import Checkpoint, load_checkpoint
from streamrec.pipeline.serving_model import ServingModel
from streamrec.worker.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """What the worker needs from a model directory."""

    checkpoint: Checkpoint
    model: ServingModel
    backend: str  # "aoti" or "eager"
    device: torch.device


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelError("model.device = 'cuda' but no CUDA device is available")
    return torch.device(name)


def load_serving_model(
    model_cfg: ModelConfig, checkpoint: Checkpoint, device: torch.device
) -> tuple[ServingModel, str]:
    """The serving model for ``checkpoint`` on ``device`` and its backend name.

    The AOTI backend is not wired in yet: eager is returned, which ``require_aoti``
    turns into an error (the operator asked never to serve eager).
    """
    if model_cfg.require_aoti:
        raise ModelError(
            f"model.require_aoti is set but no AOTI package is available for model version "
            f"{checkpoint.version} in {str(model_cfg.aoti_cache_dir)!r}"
        )
    log.info(
        "serving the eager model",
        extra={"backend": "eager", "model_version": checkpoint.version, "device": str(device)},
    )
    return checkpoint.model, "eager"


def load_model(model_cfg: ModelConfig) -> LoadedModel:
    """Load ``model_cfg.model_dir`` onto the configured device (blocking: call it off-loop)."""
    device = resolve_device(model_cfg.device)
    checkpoint = load_checkpoint(model_cfg.model_dir, device=device)
    model, backend = load_serving_model(model_cfg, checkpoint, device)
    return LoadedModel(checkpoint=checkpoint, model=model, backend=backend, device=device)
