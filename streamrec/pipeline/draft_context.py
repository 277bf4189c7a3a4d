"""Each user's last few tokens, for a draft model that keeps no KV cache of its own.

The draft of speculative generation (pipeline/generator.py) is a separate, smaller HSTU:
its keys and values of a user's history differ from the target's, and a second paged
pool (with its own host tier and evictions) would double the cache machinery for a model
that only has to guess well. It re-encodes the user's last ``window`` tokens at every
step instead, which costs one window-long call whatever the history length. This class
keeps those tokens: the step's tokens are appended, a rebuilt user's history replaces
them, and a user dropped from the KV tiers is dropped here too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from streamrec.errors import ConfigError


class DraftContext:
    """``user -> [<= window, 3]`` int64 rows of ``(item, action, ts_ms)``, oldest first."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ConfigError(f"draft window={window} must be >= 1")
        self.window = window
        self._tokens: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, user: object) -> bool:
        return user in self._tokens

    def update(self, user: str, tokens: np.ndarray, replace: bool) -> None:
        """Append a step's tokens [n, 3] (or, with ``replace``, start from them)."""
        old = self._tokens.get(user)
        rows = tokens if replace or old is None else np.concatenate([old, tokens])
        self._tokens[user] = np.ascontiguousarray(rows[-self.window :], dtype=np.int64)

    def drop(self, users: Iterable[str]) -> None:
        for user in users:
            self._tokens.pop(user, None)

    def batch(
        self, users: Sequence[str], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [B, W, 3] right-padded with zeros, lengths [B])`` on ``device``.

        A user never seen has no window (length 0); the generator then starts its draft
        from the first generated item alone.
        """
        rows = [self._tokens.get(u, np.zeros((0, 3), np.int64)) for u in users]
        width = max(1, max((len(r) for r in rows), default=0))
        out = np.zeros((len(users), width, 3), dtype=np.int64)  # [B, W, 3]
        for b, r in enumerate(rows):
            out[b, : len(r)] = r
        lens = np.fromiter((len(r) for r in rows), np.int64, len(rows))  # [B]
        return torch.from_numpy(out).to(device), torch.from_numpy(lens).to(device)
