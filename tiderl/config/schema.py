"""Typed, frozen, validated configuration dataclasses built from plain dicts.

Every config field is declared with :func:`option`, which carries its help
text (the field's documentation, rendered into ``docs/config.md``) and its
bounds. :func:`build` turns a YAML mapping into a dataclass instance and
raises :class:`ConfigError` naming the source, the dotted key and what was
expected: unknown key, wrong type, out of range, missing required.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from tiderl.config.yamlio import YAML_1_1_BOOLEANS

_MISSING = dataclasses.MISSING


def _bool_hint(value: Any, tp: Any) -> str:
    """For a bool option given `yes`, `no`, `on` or `off`: why that is no boolean here, and what to write."""
    takes_bool = tp is bool or bool in get_args(tp)
    if takes_bool and isinstance(value, str) and value.lower() in YAML_1_1_BOOLEANS:
        return (f" (config values read as YAML 1.2, where {value!r} is a string, not a boolean: "
                "write true or false)")
    return ""


class ConfigError(ValueError):
    """A job config (file or --set override) is invalid. The message names where."""

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source = source
        self.key = key
        self.message = message
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {message}")


def option(
    default: Any = _MISSING,
    *,
    help: str,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    default_factory: Any = _MISSING,
) -> Any:
    """A documented config field. Omit ``default`` to make the key required."""
    metadata = {"help": help, "ge": ge, "gt": gt, "le": le}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type) -> type:
    """Decorator: a frozen, keyword-only, slotted config dataclass."""
    return dataclasses.dataclass(frozen=True, kw_only=True, slots=True)(cls)


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _coerce(value: Any, tp: Any, source: str, key: str) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, source, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(source, key, f"expected {_type_name(tp)}, got {value!r}{_bool_hint(value, tp)}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(source, key, f"expected {_type_name(tp)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(source, key, f"expected {_type_name(tp)}, got {value!r}")
        (item_tp, *_rest) = get_args(tp)
        return tuple(_coerce(v, item_tp, source, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(source, key, f"expected a mapping, got {value!r}")
        return types.MappingProxyType(dict(value))
    if dataclasses.is_dataclass(tp):
        return build(tp, value, source, key)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(source, key, f"expected true or false, got {value!r}{_bool_hint(value, tp)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(source, key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(source, key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(source, key, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp!r} at {key}")


def _check_bounds(value: Any, meta: typing.Mapping[str, Any], source: str, key: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if meta.get("ge") is not None and value < meta["ge"]:
        raise ConfigError(source, key, f"must be >= {meta['ge']}, got {value!r}")
    if meta.get("gt") is not None and value <= meta["gt"]:
        raise ConfigError(source, key, f"must be > {meta['gt']}, got {value!r}")
    if meta.get("le") is not None and value > meta["le"]:
        raise ConfigError(source, key, f"must be <= {meta['le']}, got {value!r}")


def build(cls: type, data: Any, source: str, prefix: str = "") -> Any:
    """Build config dataclass ``cls`` from mapping ``data``; errors name ``source`` and the key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, prefix, f"expected a mapping (section), got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in data:
        if name not in fields:
            known = ", ".join(sorted(fields))
            close = difflib.get_close_matches(str(name), list(fields), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(source, _join(prefix, str(name)), f"unknown key ({hint}known keys: {known})")
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name in data:
            value = _coerce(data[name], hints[name], source, key)
            _check_bounds(value, f.metadata, source, key)
            kwargs[name] = value
        elif f.default is _MISSING and f.default_factory is _MISSING:
            raise ConfigError(source, key, f"missing required key ({f.metadata.get('help', '')})")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        # __post_init__ cross-field checks raise ValueError("field: message").
        field, _, message = str(e).partition(": ")
        if field in fields and message:
            raise ConfigError(source, _join(prefix, field), message) from e
        raise ConfigError(source, prefix, str(e)) from e


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def to_dict(obj: Any) -> Any:
    """A config dataclass as plain YAML-able data (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, types.MappingProxyType | dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def iter_fields(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, Any, dataclasses.Field]]:
    """Every leaf field of a config class, depth first: (dotted key, type, field)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = _join(prefix, f.name)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield key, tp, f
            yield from iter_fields(tp, key)
        else:
            yield key, tp, f


def type_name(tp: Any) -> str:
    return _type_name(tp)
