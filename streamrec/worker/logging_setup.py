"""Process-wide logging: JSON lines for machines, plain text for people at a terminal.

Containers ship stdout to a log pipeline that indexes JSON fields, so JSON is the
default; ``auto`` switches to text only when the stream is a TTY. Fields passed with
``logger.info("...", extra={"partition": 3})`` become top-level JSON keys.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Final, TextIO

import orjson

from streamrec.worker.config import LogConfig

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD_ATTRS: Final = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None))
) | {"message", "asctime", "taskName"}

TEXT_FORMAT: Final = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (epoch seconds), level, logger, msg, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(out, default=repr).decode()


def resolve_format(config: LogConfig, stream: TextIO) -> str:
    """``json`` or ``text``: what ``auto`` means for this stream."""
    if config.format != "auto":
        return config.format
    isatty = getattr(stream, "isatty", None)
    return "text" if isatty is not None and isatty() else "json"


def configure_logging(config: LogConfig, stream: TextIO | None = None) -> logging.Handler:
    """Replace the root logger's handlers with one handler on ``stream`` (default stderr).

    Returns the handler so a caller (or a test) can remove it again.
    """
    target = stream if stream is not None else sys.stderr
    handler = logging.StreamHandler(target)
    if resolve_format(config, target) == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level.upper())
    # aiokafka logs every reconnect attempt at INFO/WARNING; keep it a notch quieter.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
    return handler
