"""streamrec.cache: paged GPU KV pool, host and disk tiers, history store, embedding cache
and the retrievable set.

The Redis backend is imported only when a ``redis://`` URL is opened.
"""

from streamrec.cache.block_pool import BlockPool, NoRoom, Slots
from streamrec.cache.disk_tier import DiskTier
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
from streamrec.cache.retrieval_set import RetrievalSet

__all__ = [
    "Admission",
    "AppendResult",
    "BlockPool",
    "CacheOutcome",
    "DiskTier",
    "EmbeddingCache",
    "History",
    "HistoryEvent",
    "HistoryStore",
    "HostTier",
    "KVCache",
    "KVCacheConfig",
    "KVTiers",
    "NoRoom",
    "RetrievalSet",
    "Slots",
    "Token",
    "open_history_store",
]
