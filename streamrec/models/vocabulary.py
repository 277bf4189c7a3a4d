"""External item ids ↔ dense embedding rows, with stable out-of-vocabulary buckets.

Unknown ids (new catalog items, typos on the wire) must not stop the worker: they hash
into a small set of OOV rows. The hash is blake2b of the UTF-8 id, never Python's salted
``hash``, so every process and every restart maps an id to the same bucket.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from streamrec.errors import ModelError

PADDING = "<pad>"


def oov_bucket(item_id: str, num_buckets: int) -> int:
    """Stable bucket in [0, num_buckets) of an unknown id."""
    digest = hashlib.blake2b(item_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_buckets


class ItemVocabulary:
    """Row 0 is padding, rows 1 … num_oov_buckets are OOV buckets, known items follow."""

    def __init__(self, items: Sequence[str], num_oov_buckets: int = 16) -> None:
        if num_oov_buckets < 1:
            raise ModelError(f"num_oov_buckets={num_oov_buckets} must be >= 1")
        self.num_oov_buckets = num_oov_buckets
        self._items = [str(i) for i in items]
        first = 1 + num_oov_buckets
        self._index = {item: first + n for n, item in enumerate(self._items)}
        if len(self._index) != len(self._items):
            dups = [item for item, n in Counter(self._items).items() if n > 1]
            raise ModelError(f"duplicate item id(s) {dups[:5]!r} in vocabulary")

    @classmethod
    def build(cls, ids: Iterable[str], num_oov_buckets: int = 16) -> ItemVocabulary:
        """Vocabulary of the distinct ids in first-seen order (deterministic for a log)."""
        return cls(list(dict.fromkeys(str(i) for i in ids)), num_oov_buckets)

    @property
    def first_item_row(self) -> int:
        return 1 + self.num_oov_buckets

    @property
    def size(self) -> int:
        """Embedding rows needed: padding + OOV buckets + known items."""
        return self.first_item_row + len(self._items)

    @property
    def items(self) -> list[str]:
        return list(self._items)

    def __len__(self) -> int:
        return self.size

    def index(self, item_id: str) -> int:
        row = self._index.get(item_id)
        if row is not None:
            return row
        return 1 + oov_bucket(item_id, self.num_oov_buckets)

    def lookup(self, ids: Iterable[str]) -> np.ndarray:
        """Rows of external ids; unknown ids land in their OOV bucket. Returns int64."""
        return np.fromiter((self.index(str(i)) for i in ids), dtype=np.int64)

    def external(self, idx: int) -> str:
        idx = int(idx)
        if idx == 0:
            return PADDING
        if 1 <= idx < self.first_item_row:
            return f"<oov:{idx - 1}>"
        if self.first_item_row <= idx < self.size:
            return self._items[idx - self.first_item_row]
        raise ModelError(f"row {idx} outside vocabulary of {self.size} rows")

    def external_ids(self) -> np.ndarray:
        """``[size]`` object array: the external id of every row (``external`` for all),
        so a batch's output rows turn into ids with one fancy index."""
        ids = np.empty(self.size, dtype=object)
        ids[: self.first_item_row] = [self.external(i) for i in range(self.first_item_row)]
        ids[self.first_item_row :] = self._items
        return ids

    def is_retrievable(self, idx: int) -> bool:
        return self.first_item_row <= int(idx) < self.size

    def to_dict(self) -> dict[str, Any]:
        return {"num_oov_buckets": self.num_oov_buckets, "items": list(self._items)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ItemVocabulary:
        try:
            buckets = data["num_oov_buckets"]
            items = data["items"]
        except KeyError as exc:
            raise ModelError(f"vocabulary: missing field {exc.args[0]!r}") from exc
        if not isinstance(buckets, int) or not isinstance(items, list):
            raise ModelError(
                f"vocabulary: num_oov_buckets={buckets!r} must be int and items a list"
            )
        return cls(items, buckets)

    def save(self, path: Path | str) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: Path | str) -> ItemVocabulary:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"vocabulary {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ModelError(f"vocabulary {path}: expected a JSON object")
        return cls.from_dict(data)
