"""Reading a config section from YAML: every value checked against its field's annotation, every error naming
the field (`ConfigError`). The sections themselves are in config.py."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{field_name}: {message}")


def build_section(section_cls: type, raw: Any, prefix: str) -> Any:
    require(isinstance(raw, dict), prefix, f"must be a mapping, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(section_cls)}
    unknown = set(raw) - known
    require(not unknown, prefix, f"unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    hints = typing.get_type_hints(section_cls)
    values = {name: check_type(value, hints[name], f"{prefix}.{name}") for name, value in raw.items()}
    try:
        return section_cls(**values)
    except TypeError as error:  # e.g. a missing required field such as regions[].name
        raise ConfigError(f"{prefix}: {error}") from error


def check_type(value: Any, hint: Any, field_name: str) -> Any:
    """Check a YAML value against a field's annotation (int, float, str, bool, lists, optionals)."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str):
            return value
        if typing.get_origin(option) is list and isinstance(value, list):
            (element,) = typing.get_args(option)
            return [check_type(item, element, f"{field_name}[{i}]") for i, item in enumerate(value)]
    wanted = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise ConfigError(f"{field_name}: expected {wanted}, got {value!r} ({type(value).__name__})")
