"""History-store URL -> backend: the one place that knows every backend.

Kept apart from ``history_store`` (the interface) so the backends can import the
interface without a cycle; the Redis client is imported only when a ``redis://`` URL is
opened.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from streamrec.cache.history_store import HistoryStore
from streamrec.cache.memory_history_store import MemoryHistoryStore
from streamrec.errors import ConfigError


def open_history_store(url: str, max_seq_len: int) -> HistoryStore:
    """``memory://`` or ``redis://host:port/db[?prefix=...]`` (also ``rediss://``)."""
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        return MemoryHistoryStore(max_seq_len)
    if scheme in ("redis", "rediss"):
        from streamrec.cache.redis_history_store import RedisHistoryStore

        return RedisHistoryStore(url, max_seq_len)
    raise ConfigError(f"history store URL {url!r}: scheme must be memory:// or redis://")
