"""Where a ``WorkerConfig`` comes from: the TOML file, the environment and the flags.

``load_config`` applies them in order (defaults < file < ``STREAMREC_*`` < flags, as
``config.py`` says), converting text to each field's declared type and naming the source
of a bad value. This is the only module of the project that reads the environment.
"""

from __future__ import annotations

import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from streamrec.errors import ConfigError, StreamrecError
from streamrec.worker.config import (
    ENV_CONFIG_FILE,
    ENV_PREFIX,
    SECTIONS,
    Section,
    WorkerConfig,
    config_fields,
    env_var_name,
    loadable_fields,
    matches_type,
    type_name,
    unwrap_optional,
)

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _parse_text(tp: Any, text: str, where: str, key: str) -> object:
    """Turn an env/flag string into the field's type; '' unsets an optional field."""
    base, optional = unwrap_optional(tp)
    if optional and text == "":
        return None
    try:
        if base is bool:
            low = text.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(text)
        if base is int:
            return int(text)
        if base is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{where}: {key} = {text!r}: expected {type_name(tp)}") from None
    if base is Path:
        return Path(text)
    return text


def _coerce_toml(tp: Any, value: object, where: str, key: str) -> object:
    base, _ = unwrap_optional(tp)
    if base is Path and isinstance(value, str):
        return Path(value)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not matches_type(tp, value):
        raise ConfigError(f"{where}: {key} = {value!r}: expected {type_name(tp)}")
    return value


def _section_hints() -> dict[str, dict[str, Any]]:
    """Per section, the type of every loadable field."""
    return {
        name: {f.name: typing.get_type_hints(cls)[f.name] for f in loadable_fields(cls)}
        for name, cls in SECTIONS.items()
    }


def _read_toml(path: Path, hints: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    try:
        with path.open("rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    where = f"config file {str(path)!r}"
    out: dict[str, dict[str, Any]] = {}
    for section, table in doc.items():
        if section not in hints:
            raise ConfigError(f"{where}: unknown section [{section}]; known: {sorted(hints)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: {section} = {table!r}: expected a [{section}] table")
        for name, value in table.items():
            key = f"{section}.{name}"
            if name not in hints[section]:
                raise ConfigError(f"{where}: unknown key {key!r}")
            out.setdefault(section, {})[name] = _coerce_toml(
                hints[section][name], value, where, key
            )
    return out


def _read_environ(
    environ: Mapping[str, str], hints: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for var, text in environ.items():
        if not var.startswith(ENV_PREFIX) or var == ENV_CONFIG_FILE:
            continue
        section, sep, name = var[len(ENV_PREFIX) :].lower().partition("__")
        if not sep or section not in hints or name not in hints[section]:
            raise ConfigError(
                f"unknown environment variable {var!r}: expected {ENV_PREFIX}<SECTION>__<FIELD>"
                f" for a known field, e.g. {env_var_name('kafka', 'bootstrap_servers')}"
            )
        key = f"{section}.{name}"
        value = _parse_text(hints[section][name], text, f"environment {var}", key)
        out.setdefault(section, {})[name] = value
    return out


def _read_overrides(
    overrides: Mapping[str, object], hints: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, raw in overrides.items():
        section, _, name = key.partition(".")
        if section not in hints or name not in hints[section]:
            known = ", ".join(f.key for f in config_fields())
            raise ConfigError(f"unknown config key {key!r}; known keys: {known}")
        tp = hints[section][name]
        where = f"flag for {key}"
        value = (
            _parse_text(tp, raw, where, key)
            if isinstance(raw, str)
            else _coerce_toml(tp, raw, where, key)
        )
        out.setdefault(section, {})[name] = value
    return out


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
    defaults: Mapping[str, object] | None = None,
) -> WorkerConfig:
    """Build the effective config: defaults < TOML ``path`` < ``environ`` < ``overrides``.

    ``environ`` defaults to ``os.environ``; tests pass their own mapping. ``overrides``
    are dotted keys (``"http.port"``) from CLI flags; string values are parsed like
    environment values. ``defaults`` (same form) replace built-in defaults below every
    layer: the demo's own settings, which a file, the environment or a flag still beat.
    ``path`` None falls back to ``$STREAMREC_CONFIG``, then to none.
    """
    env = os.environ if environ is None else environ
    hints = _section_hints()
    layers: list[dict[str, dict[str, Any]]] = [_read_overrides(defaults or {}, hints)]
    file = path if path is not None else env.get(ENV_CONFIG_FILE) or None
    if file is not None:
        layers.append(_read_toml(Path(file), hints))
    layers.append(_read_environ(env, hints))
    layers.append(_read_overrides(overrides or {}, hints))
    merged: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for section, values in layer.items():
            merged.setdefault(section, {}).update(values)
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        try:
            sections[name] = cls(**merged.get(name, {}))
        except StreamrecError as exc:
            if issubclass(cls, Section):  # its messages name the section already
                raise
            raise ConfigError(f"{name}.{exc}") from None  # a pipeline config's own check
    return WorkerConfig(**sections)
