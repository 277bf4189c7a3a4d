"""streamrec.cache: paged GPU KV pool, host tier, history store, embedding cache.

The Redis backend is imported only when a ``redis://`` URL is opened.
"""

from streamrec.cache.block_pool import BlockPool, NoRoom, Slots
from streamrec.cache.embedding_cache import EmbeddingCache
from streamrec.cache.history_backends import open_history_store
from streamrec.cache.history_store import (
    AppendResult,
    History,
    HistoryEvent,
    HistoryStore,
    Token,
)
from streamrec.cache.host_tier import HostTier
from streamrec.cache.kv_cache import KVCache, KVCacheConfig
from streamrec.cache.kv_tiers import Admission, CacheOutcome, KVTiers

__all__ = [
    "Admission",
    "AppendResult",
    "BlockPool",
    "CacheOutcome",
    "EmbeddingCache",
    "History",
    "HistoryEvent",
    "HistoryStore",
    "HostTier",
    "KVCache",
    "KVCacheConfig",
    "KVTiers",
    "NoRoom",
    "Slots",
    "Token",
    "open_history_store",
]
