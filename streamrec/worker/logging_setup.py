"""Process-wide logging: JSON lines for machines, plain text for people at a terminal.

Containers ship stdout to a log pipeline that indexes JSON fields, so JSON is the
default; ``auto`` switches to text only when the stream is a TTY. Fields passed with
``logger.info("...", extra={"partition": 3})`` become top-level JSON keys, and
``key=value`` pairs after the message in text.

aiokafka logs every failed connection attempt, tens of lines a second while a broker is
down; :class:`RepeatFilter` lets one line per message template through per interval and
says on the next one how many it held back.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TextIO

import orjson

from streamrec.worker.config import LogConfig

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD_ATTRS: Final = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None))
) | {"message", "asctime", "taskName"}

TEXT_FORMAT: Final = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
REPEAT_INTERVAL_S: Final = 10.0  # one aiokafka line per template per this many seconds
_LIMITED_LOGGERS: Final = ("aiokafka",)


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a caller attached with ``extra=`` (and the filter's ``suppressed``)."""
    return {
        key: value
        for key, value in vars(record).items()
        if key not in _STANDARD_ATTRS and not key.startswith("_")
    }


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (epoch seconds), level, logger, msg, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **extra_fields(record),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(out, default=repr).decode()


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT`` followed by the extras as ``key=value`` (tracebacks stay below)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        extras = extra_fields(record)
        if not extras:
            return line
        return line + " " + " ".join(f"{k}={_text_value(v)}" for k, v in extras.items())


def _text_value(value: object) -> str:
    """Bare words stay bare; anything with spaces, quotes or structure becomes JSON."""
    if isinstance(value, str) and value and not any(c in value for c in " \"'=\n\t"):
        return value
    return orjson.dumps(value, default=repr).decode()


@dataclass
class _Window:
    started: float
    suppressed: int = 0


class RepeatFilter(logging.Filter):
    """Rate-limits WARNING+ records of the ``loggers`` prefixes, per message template.

    The first record of a template in an interval passes; the rest are counted and
    dropped, and the first one after the interval carries ``suppressed`` (the count) and
    ``interval_s``. Other loggers and lower levels pass untouched.
    """

    def __init__(
        self,
        interval_s: float = REPEAT_INTERVAL_S,
        loggers: tuple[str, ...] = _LIMITED_LOGGERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s!r} must be > 0")
        self.interval_s = interval_s
        self._prefixes = tuple(p + "." for p in loggers)
        self._names = frozenset(loggers)
        self._clock = clock
        self._windows: dict[tuple[str, int, str], _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not self._limited(record.name):
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        window = self._windows.get(key)
        if window is not None and now - window.started < self.interval_s:
            window.suppressed += 1
            return False
        self._windows[key] = _Window(now)
        if window is not None and window.suppressed:
            record.suppressed = window.suppressed
            record.interval_s = self.interval_s
        return True

    def _limited(self, name: str) -> bool:
        return name in self._names or name.startswith(self._prefixes)


def resolve_format(config: LogConfig, stream: TextIO) -> str:
    """``json`` or ``text``: what ``auto`` means for this stream."""
    if config.format != "auto":
        return config.format
    isatty = getattr(stream, "isatty", None)
    return "text" if isatty is not None and isatty() else "json"


def configure_logging(
    config: LogConfig, stream: TextIO | None = None, *, repeat_interval_s: float = REPEAT_INTERVAL_S
) -> logging.Handler:
    """Replace the root logger's handlers with one handler on ``stream`` (default stderr).

    Returns the handler so a caller (or a test) can remove it again.
    """
    target = stream if stream is not None else sys.stderr
    handler = logging.StreamHandler(target)
    if resolve_format(config, target) == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    handler.addFilter(RepeatFilter(repeat_interval_s))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level.upper())
    # aiokafka logs every reconnect attempt at INFO/WARNING; keep it a notch quieter.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
    return handler
