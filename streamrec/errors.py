"""The one exception hierarchy of streamrec.

Every error names the offending value, so a log line is enough to act on. Running out
of cache capacity is *not* an error: it is a return value (see ``cache.block_pool``).
"""

from __future__ import annotations


class StreamrecError(Exception):
    """Base of every error raised by streamrec."""


class ConfigError(StreamrecError):
    """A configuration value is missing, malformed or out of range."""


class SchemaError(StreamrecError):
    """A record does not match its wire schema (the message names field and value)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # machine-readable error kind, e.g. "missing_field"


class ModelError(StreamrecError):
    """A model directory, checkpoint or tensor input is unusable."""


class ExportError(ModelError):
    """An AOTInductor package could not be built or loaded."""


class CacheError(StreamrecError):
    """A cache operation was asked something inconsistent (a bug, not a full pool)."""


class StoreError(StreamrecError):
    """The history store backend failed (e.g. Redis unreachable); the batch is not durable."""


class BrokerError(StreamrecError):
    """The Kafka broker is unreachable or the topics are not as required."""


class PipelineError(StreamrecError):
    """The batcher or engine was used wrongly or has been closed."""


class SupervisorError(StreamrecError):
    """``streamrec run --gpus``: a child cannot be started, or keeps dying at start."""
