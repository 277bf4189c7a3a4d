"""The target/draft pairing of speculative generation, checked when the pair is loaded.

A draft's output never reaches a user unverified, so a mismatched draft cannot make the
output wrong; it makes it slow (every guess rejected) or, with another vocabulary, makes
its item rows mean other items. Both are configuration mistakes that should stop the
worker at start rather than show up as a low acceptance rate: a draft directory records
the target it was distilled from (``meta.json``, key ``draft_of``) and ``load_draft``
compares that record, and the vocabularies themselves, with the target being served.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from streamrec.errors import ModelError
from streamrec.models.checkpoint import Checkpoint, load_checkpoint
from streamrec.models.vocabulary import ItemVocabulary

DRAFT_OF = "draft_of"


def vocabulary_hash(vocab: ItemVocabulary) -> str:
    """Content hash of a vocabulary (OOV buckets and the ordered item ids)."""
    data = json.dumps(vocab.to_dict(), separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def draft_meta(target: Checkpoint) -> dict[str, Any]:
    """What a draft directory records about its target."""
    return {
        "model_version": target.version,
        "model_name": target.model_name,
        "vocabulary": vocabulary_hash(target.vocab),
        "num_layers": target.config.num_layers,
    }


def check_pair(draft: Checkpoint, target: Checkpoint) -> None:
    """Raise ModelError unless ``draft`` was distilled from ``target`` (same vocabulary)."""
    record = draft.meta.get(DRAFT_OF)
    if not isinstance(record, dict):
        raise ModelError(
            f"{draft.path} is not a draft model (its meta.json has no {DRAFT_OF!r}; "
            "make one with `streamrec train --draft-of MODEL_DIR`)"
        )
    if record.get("model_version") != target.version:
        raise ModelError(
            f"draft {draft.path} was distilled from model_version "
            f"{record.get('model_version')!r}, but the served model {target.path} is "
            f"{target.version!r}: retrain the draft"
        )
    if vocabulary_hash(draft.vocab) != vocabulary_hash(target.vocab) or (
        record.get("vocabulary") != vocabulary_hash(target.vocab)
    ):
        raise ModelError(
            f"draft {draft.path} has another vocabulary ({draft.vocab.size} rows) than "
            f"{target.path} ({target.vocab.size} rows)"
        )
    if draft.config.num_items != target.config.num_items:
        raise ModelError(
            f"draft {draft.path} has {draft.config.num_items} item rows, the target "
            f"{target.config.num_items}"
        )


def load_draft(
    path: Path | str,
    target: Checkpoint,
    device: str | torch.device = "cpu",
    dtype: str | None = None,
) -> Checkpoint:
    """Load a draft directory and check it against the served ``target``."""
    draft = load_checkpoint(path, device=device, dtype=dtype)
    check_pair(draft, target)
    return draft
