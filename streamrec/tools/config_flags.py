"""The command line's configuration flags, shared by every subcommand that reads the config.

A shortcut flag (``--bootstrap-servers``, ``--model``, ...) is nothing but a named
``--set section.field=VALUE``: each maps to exactly one config key, so the flag layer of
``load_config`` stays the only place a flag value enters the configuration. Their help
shows the config key and its built-in default (the flag's own default is "not given").
This module imports no torch: ``streamrec --help`` must stay fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from streamrec.errors import ConfigError
from streamrec.worker.config import (
    DEVICES,
    ENV_CONFIG_FILE,
    MODEL_BACKENDS,
    WorkerConfig,
    config_fields,
)
from streamrec.worker.config_sources import load_config


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` wherever there is a real default (not None, not a bare
    switch's False) and keeps the description's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS:
            return text
        if default == [] or "%(default)" in text:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)".lstrip()
        return text

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(indent + line for line in text.splitlines())


@dataclass(frozen=True)
class Shortcut:
    """``flag`` sets config ``key``; ``choices`` are checked by the config, not argparse,
    so a wrong value is a one-line config error (exit 1) like the same mistake in a file."""

    flag: str
    key: str
    metavar: str
    help: str

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


SHORTCUTS: Final = {
    s.flag: s
    for s in (
        Shortcut("--bootstrap-servers", "kafka.bootstrap_servers", "HOST:PORT[,...]", "Kafka"),
        Shortcut("--group-id", "group.group_id", "ID", "consumer group"),
        Shortcut("--output-topic", "topics.output", "TOPIC", "recommendations topic"),
        Shortcut("--dlq-topic", "topics.dead_letter", "TOPIC", "dead-letter topic"),
        Shortcut("--model", "model.model_dir", "DIR", "model directory (`streamrec train`)"),
        Shortcut("--cache-dir", "model.aoti_cache_dir", "DIR", "AOTInductor package cache"),
        Shortcut("--device", "model.device", "{" + ",".join(DEVICES) + "}", "auto = CUDA if any"),
        Shortcut(
            "--backend",
            "model.backend",
            "{" + ",".join(MODEL_BACKENDS) + "}",
            "auto = the AOTI package if one matches; aoti = fail without one",
        ),
        Shortcut("--store", "store.url", "URL", "history store: memory:// or redis://"),
        Shortcut("--http-port", "http.port", "PORT", "/metrics, /healthz, /readyz; 0 = any"),
        Shortcut("--log-format", "log.format", "{auto,json,text}", "auto = text on a terminal"),
        Shortcut("--log-level", "log.level", "LEVEL", "DEBUG, INFO, WARNING, ERROR"),
    )
}
WORKER_FLAGS: Final = (
    "--bootstrap-servers",
    "--group-id",
    "--input-topics",
    "--output-topic",
    "--dlq-topic",
    "--model",
    "--device",
    "--store",
    "--http-port",
    "--backend",
    "--log-format",
    "--log-level",
)
CLIENT_FLAGS: Final = ("--bootstrap-servers", "--log-format", "--log-level")


def _config_default(key: str) -> str:
    for info in config_fields():
        if info.key == key:
            value = info.default
            return "unset" if value is None else str(value)
    raise KeyError(key)


class DeprecatedAlias(argparse.Action):
    """An old flag name that still works and says which one replaces it (on stderr)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.replacement: str = kwargs.pop("replacement")
        kwargs.setdefault("default", argparse.SUPPRESS)
        kwargs.setdefault("help", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: warning: {option_string} is deprecated; use {self.replacement}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_config_flags(
    parser: argparse.ArgumentParser,
    flags: Sequence[str],
    shown_defaults: Mapping[str, str] | None = None,
) -> None:
    """``--config``, ``--set`` and the named shortcuts in ``flags``; ``shown_defaults``
    (config key -> text) describe a command's own defaults in place of the config's."""
    shown = dict(shown_defaults or {})
    group = parser.add_argument_group("configuration (flags beat STREAMREC_* env beat file)")
    group.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"TOML config file (default: ${ENV_CONFIG_FILE}, else none)",
    )
    for flag in flags:
        if flag == "--input-topics":
            group.add_argument(
                flag,
                metavar="PLAYBACK,INTERACTION",
                help="topics.playback,topics.interaction "
                f"(config default: {_config_default('topics.playback')},"
                f"{_config_default('topics.interaction')})",
            )
        else:
            s = SHORTCUTS[flag]
            default = shown.get(s.key) or f"config default: {_config_default(s.key)}"
            group.add_argument(
                s.flag, dest=s.dest, metavar=s.metavar, help=f"{s.key}: {s.help} ({default})"
            )
    group.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="set any config field (repeatable); see `streamrec config show`",
    )


def config_overrides(args: argparse.Namespace) -> dict[str, str]:
    """The config overrides that the parsed flags ask for (dotted key -> text)."""
    overrides: dict[str, str] = {}
    for setting in getattr(args, "settings", []):
        key, sep, value = setting.partition("=")
        if not sep:
            raise ConfigError(f"--set {setting!r}: expected SECTION.FIELD=VALUE")
        overrides[key.strip()] = value
    for s in SHORTCUTS.values():
        value = getattr(args, s.dest, None)
        if value is not None:
            overrides[s.key] = str(value)
    topics = getattr(args, "input_topics", None)
    if topics is not None:
        names = [name.strip() for name in topics.split(",")]
        if len(names) != 2:
            raise ConfigError(
                f"--input-topics {topics!r}: expected two names, PLAYBACK,INTERACTION"
            )
        overrides["topics.playback"], overrides["topics.interaction"] = names
    return overrides


def effective_config(
    args: argparse.Namespace, defaults: Mapping[str, object] | None = None
) -> WorkerConfig:
    """defaults < ``--config`` (or $STREAMREC_CONFIG) < STREAMREC_* env < flags."""
    return load_config(
        getattr(args, "config", None), overrides=config_overrides(args), defaults=defaults
    )


def check_device(value: str, what: str = "--device") -> str:
    """A ``--device`` value as the config would accept it (one-line error otherwise)."""
    if value not in DEVICES:
        raise ConfigError(f"{what} {value!r}: expected one of {', '.join(DEVICES)}")
    return value
