"""A model directory: the one artefact that train, eval, export and the worker share.

Layout: ``weights.safetensors`` + ``config.json`` + ``vocab.json`` + ``meta.json``.
``model_version`` is a short sha256 of the first three files' bytes, so any change to
weights, shape or vocabulary gives a new version and invalidates every cached K/V
(DESIGN §3, rule 5); ``meta.json`` (name, training figures) does not affect it.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from streamrec.errors import ConfigError, ModelError
from streamrec.models.config import DTYPES, HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.models.vocabulary import ItemVocabulary

WEIGHTS = "weights.safetensors"
CONFIG = "config.json"
VOCAB = "vocab.json"
META = "meta.json"
VERSION_CHARS = 12


@dataclass(frozen=True)
class Checkpoint:
    """A loaded model directory."""

    model: HSTU
    vocab: ItemVocabulary
    version: str
    path: Path
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> HSTUConfig:
        return self.model.config

    @property
    def model_name(self) -> str:
        return str(self.meta.get("model_name", self.path.name))


def model_version(path: Path | str) -> str:
    """Content hash of weights + config + vocabulary of a model directory.

    Streamed in chunks (a 1 GB weights file is never one ``bytes``; hashlib releases the
    GIL on each chunk, so ``load_checkpoint`` hashes beside its own work).
    """
    digest = hashlib.sha256()
    for name in (WEIGHTS, CONFIG, VOCAB):
        file = Path(path) / name
        try:
            with file.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                digest.update(name.encode() + b"\0" + size.to_bytes(8, "little"))
                while chunk := f.read(_HASH_CHUNK):
                    digest.update(chunk)
        except OSError as exc:
            raise ModelError(f"model directory {path}: cannot read {file}: {exc}") from exc
    return digest.hexdigest()[:VERSION_CHARS]


_HASH_CHUNK = 16 << 20


def save_checkpoint(
    path: Path | str,
    model: HSTU,
    vocab: ItemVocabulary,
    meta: dict[str, Any] | None = None,
) -> str:
    """Write a model directory (created if needed) and return its ``model_version``."""
    out = Path(path)
    cfg = model.config
    if vocab.size != cfg.num_items or vocab.num_oov_buckets != cfg.num_oov_buckets:
        raise ModelError(
            f"vocabulary ({vocab.size} rows, {vocab.num_oov_buckets} OOV) does not match "
            f"config num_items={cfg.num_items} num_oov_buckets={cfg.num_oov_buckets}"
        )
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS))
    (out / CONFIG).write_text(json.dumps(cfg.to_dict(), indent=1, sort_keys=True))
    vocab.save(out / VOCAB)
    version = model_version(out)
    info = {"model_name": out.name, **(meta or {}), "model_version": version}
    (out / META).write_text(json.dumps(info, indent=1, sort_keys=True))
    return version


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def load_checkpoint(
    path: Path | str, device: str | torch.device = "cpu", dtype: str | None = None
) -> Checkpoint:
    """Load and validate a model directory; errors name the file and the field."""
    src = Path(path)
    if not src.is_dir():
        raise ModelError(f"model directory {src} does not exist")
    try:
        config = HSTUConfig.from_dict(_read_json(src / CONFIG))
    except ConfigError as exc:
        raise ModelError(f"{src / CONFIG}: {exc}") from exc
    vocab = ItemVocabulary.load(src / VOCAB)
    if vocab.size != config.num_items or vocab.num_oov_buckets != config.num_oov_buckets:
        raise ModelError(
            f"{src / VOCAB}: {vocab.size} rows / {vocab.num_oov_buckets} OOV buckets but "
            f"{src / CONFIG} says num_items={config.num_items} "
            f"num_oov_buckets={config.num_oov_buckets}"
        )
    with ThreadPoolExecutor(1, thread_name_prefix="model-version") as hasher:
        hashing = hasher.submit(model_version, src)  # beside the load (~1 s per GB)
        model = _load_module(src, config)
        version = hashing.result()
    meta = _read_json(src / META) if (src / META).exists() else {}
    recorded = meta.get("model_version")
    if recorded is not None and recorded != version:
        raise ModelError(
            f"{src / META}: model_version={recorded!r} but the files hash to {version!r} "
            "(weights, config or vocabulary changed after saving)"
        )
    if dtype is not None and dtype not in DTYPES:
        raise ModelError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
    target = DTYPES[dtype or config.dtype]
    model = model.to(device=device, dtype=target).eval()
    return Checkpoint(model=model, vocab=vocab, version=version, path=src, meta=meta)


def _load_module(src: Path, config: HSTUConfig) -> HSTU:
    """The module with the file's tensors as its parameters, built on the meta device:
    no random initialisation of a table that is overwritten next (9 s of 17 s for the
    1M-item HSTU-8L on the CPU machine)."""
    try:
        weights = load_file(str(src / WEIGHTS))
    except (OSError, SafetensorError) as exc:
        raise ModelError(f"cannot read {src / WEIGHTS}: {exc}") from exc
    with torch.device("meta"):
        model = HSTU(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ModelError(f"{src / WEIGHTS}: missing {missing[:5]} unexpected {unexpected[:5]}")
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise ModelError(
                f"{src / WEIGHTS}: {name} has shape {tuple(tensor.shape)}, "
                f"config expects {tuple(expected[name].shape)}"
            )
    model.load_state_dict(weights, assign=True)
    return model


ITEM_TABLE = "item_emb.weight"


def load_item_table(path: Path | str, dtype: torch.dtype) -> torch.Tensor:
    """The item rows ``[V, D]`` of a model directory on the host, as the serving dtype.

    Memory-mapped from ``weights.safetensors`` when stored in ``dtype`` (a 20 GB table
    then costs page cache, not process memory); converted in memory otherwise. The
    embedding cache gathers its cold rows from it.
    """
    file = Path(path) / WEIGHTS
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            table = handle.get_tensor(ITEM_TABLE)
    except (OSError, SafetensorError) as exc:
        raise ModelError(f"cannot read {ITEM_TABLE} from {file}: {exc}") from exc
    return table if table.dtype == dtype else table.to(dtype)
