"""``moeblaze train --config FILE.toml`` and ``--print-config``: a run's configuration as one flat TOML table.

The keys are the field names of :class:`moeblaze.training.train_config.TrainConfig` and
:class:`moeblaze.training.model.ModelConfig` (``steps = 100``, ``d_model = 256``, ``routing = "token-rounding:up"``);
flags given on the command line override the file. The file is read with the standard library's ``tomllib`` (``tomli``
before Python 3.11); ``tomllib`` cannot write, so :func:`dump_config` writes the table itself: it holds only ints,
floats, bools and strings, whose TOML forms are Python's ``repr`` (floats: the shortest text that reads back to the same
double), ``true`` / ``false``, and basic strings with ``\\``, ``"`` and control characters escaped (TOML 1.0 "Basic
strings").
"""

from __future__ import annotations

import os
import sys
from dataclasses import MISSING, Field, asdict, fields
from pathlib import Path

from .model import ModelConfig
from .train_config import ConfigError, TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library (pyproject.toml's dependency)
    import tomli as tomllib

__all__ = ["dump_config", "read_config"]

_KINDS = {"bool": bool, "int": int, "float": float, "str": str}


def _kind(f: Field) -> type:
    """The value type of a field: its default's, or for an optional field (default None) its annotation's first
    type (``str | None`` -> str)."""
    if f.default is not MISSING and f.default is not None:
        return type(f.default)
    return _KINDS[str(f.type).split("|")[0].strip()]


def _checked(path: str, key: str, value: object, kind: type) -> object:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # TOML's `lr = 1` is an integer
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"--config {path}: {key} must be a TOML {kind.__name__} (as the flag --{key.replace('_', '-')} "
                      f"takes), got {value!r}")


def read_config(path: str | os.PathLike) -> tuple[dict, dict]:
    """The ``TrainConfig`` and ``ModelConfig`` values of a TOML file, as two dicts of field name to value (ints
    given for float fields become floats).

    Raises:
        ConfigError: the file cannot be read or is not TOML (the parser's line and column), a key that is no field
            of either configuration (naming the key and the file), or a value of another type than its field's.
    """
    try:
        with open(Path(path).expanduser(), "rb") as fh:
            table = tomllib.load(fh)
    except OSError as err:
        raise ConfigError(f"--config {path}: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"--config {path}: not valid TOML ({err})") from None
    train_fields = {f.name: f for f in fields(TrainConfig)}
    model_fields = {f.name: f for f in fields(ModelConfig)}
    train, model = {}, {}
    for key, value in table.items():
        f = train_fields.get(key) or model_fields.get(key)
        if f is None:
            raise ConfigError(f"--config {path}: unknown key {key!r} (the keys are moeblaze train's flags with _ for "
                              "-, e.g. steps, d_model; see moeblaze train --print-config)")
        (train if key in train_fields else model)[key] = _checked(str(path), key, value, _kind(f))
    return train, model


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # TOML's inf and nan are Python's repr too
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c for c in escaped) + '"'
    raise TypeError(f"a configuration value must be a bool, int, float or str, got {value!r}")


def dump_config(cfg: TrainConfig, mcfg: ModelConfig, omit: dict[str, str] | None = None) -> str:
    """The two configurations as one flat TOML table that :func:`read_config` reads back equal. Fields that are
    None (no TOML form) and the keys of ``omit`` are left out, named in a comment (with ``omit``'s note): they take
    their defaults."""
    omit = omit or {}
    lines = ["# moeblaze train --config FILE.toml reads this; flags given as well override it"]
    for title, values in (("TrainConfig", asdict(cfg)), ("ModelConfig", asdict(mcfg))):
        lines.append(f"# {title}")
        for key, value in values.items():
            if value is None or key in omit:
                lines.append(f"# {key}: not set ({omit.get(key, 'its default')})")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
