"""Settings from plain data: a YAML file's mappings, or the flags a command was given.

One reading for both sources, so a value is held to its field's type and declared bounds
whichever way it came, and a mistake names where it came from (a file), the key and what
the key takes, in one line.

A settings dataclass holds setting fields (``core.settings.setting``) and sections: fields
whose type is itself a settings dataclass, read from a nested mapping (``router:``).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from smetric.core.errors import ConfigError
from smetric.core.settings import Meta

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

_LISTS = (tuple, list, frozenset)


def hints_of(cls: type) -> dict[str, Any]:
    """The resolved type of each field of ``cls``."""
    return get_type_hints(cls)


def is_section(hint: Any, f: dataclasses.Field[Any]) -> bool:
    """A field holding a nested settings dataclass rather than one setting."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint) and "setting" not in f.metadata


def read_yaml(path: Path) -> Any:
    """The data of the YAML file at ``path``; a file that cannot be read or parsed is a
    ValueError naming it (and, for a syntax error, the line)."""
    try:
        with path.open(encoding="utf-8") as stream:  # so a syntax error names the file
            return yaml.safe_load(stream)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the file: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None


def load(cls: type[T], data: Any, where: str, key: str = "") -> T:
    """``cls`` with the values of mapping ``data`` (None: every default); a key ``cls``
    lacks, a value of the wrong type or outside its bounds is a ValueError naming
    ``where``, the key and what it takes."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        place = key or "the top level"
        raise ConfigError(f"{where}: {place} must map keys to values, got {_shown(data)}")
    hints = hints_of(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for name in data:
        if name not in known:
            owner = key or "the top level"
            raise ConfigError(
                f"{where}: unknown key {_join(key, str(name))!r}; {owner} takes {', '.join(known)}"
            )
    values = {
        f.name: _convert(hints[f.name], data[f.name], where, _join(key, f.name), _meta(f))
        for f in dataclasses.fields(cls)
        if f.name in data
    }
    for f in dataclasses.fields(cls):
        if f.name not in values and _required(f):
            raise ConfigError(f"{where}: {_join(key, f.name)} is required")
    return _build(cls, values, where, key)


def with_values(obj: T, values: Mapping[str, Any], where: str) -> T:
    """``obj`` with the settings named in ``values`` (by leaf name, at any depth of its
    sections) replaced, each checked as ``load`` checks it."""
    hints = hints_of(type(obj))
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if is_section(hints[f.name], f):
            changes[f.name] = with_values(getattr(obj, f.name), values, where)
        elif f.name in values:
            changes[f.name] = _convert(hints[f.name], values[f.name], where, f.name, _meta(f))
    return _build(type(obj), {**_fields(obj), **changes}, where, "")


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}


def _build(cls: type[T], values: dict[str, Any], where: str, key: str) -> T:
    try:
        return cls(**values)
    except ValueError as exc:  # the dataclass's own checks across fields
        raise ConfigError(f"{where}: {key + ': ' if key else ''}{exc}") from None


def _meta(f: dataclasses.Field[Any]) -> Meta | None:
    return f.metadata.get("setting")


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _shown(value: Any) -> str:
    return "a mapping" if isinstance(value, Mapping) else repr(value)


def _convert(hint: Any, value: Any, where: str, key: str, meta: Meta | None) -> Any:
    """``value`` as type ``hint``, within ``meta``'s bounds, or a ValueError."""
    out = _typed(hint, value, where, key)
    if meta is not None:
        try:
            meta.check(key, out)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return out


def _typed(hint: Any, value: Any, where: str, key: str) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None) and _fits(arg, value):
                return _typed(arg, value, where, key)
    elif origin in _LISTS and isinstance(value, list | tuple):
        (item, *_) = args
        items = [_typed(item, v, where, f"{key}[{i}]") for i, v in enumerate(value)]
        return frozenset(items) if origin is frozenset else origin(items)
    elif dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):  # read already
            return value
        if isinstance(value, Mapping):
            return load(hint, value, where, key)
    elif _fits(hint, value):
        return Path(value) if hint is Path else float(value) if hint is float else value
    raise ConfigError(f"{where}: {key} must be {describe(hint)}, got {_shown(value)}")


def _fits(hint: Any, value: Any) -> bool:
    """Whether ``value`` is of the kind ``hint`` reads (before its items are checked)."""
    origin = get_origin(hint) or hint
    if origin in _LISTS:
        return isinstance(value, list | tuple)
    if dataclasses.is_dataclass(origin):
        return isinstance(value, Mapping | origin)
    if origin is bool:
        return isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is Path:
        return isinstance(value, str | Path)
    return isinstance(origin, type) and isinstance(value, origin)


def describe(hint: Any) -> str:
    """What a value of type ``hint`` is, for people: ``an integer``, ``a list, each a
    string``."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin in _LISTS:
        return f"a list, each {describe(args[0])}"
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        keys = ", ".join(f.name for f in dataclasses.fields(hint))
        return f"a mapping ({keys})"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    names |= {Path: "a path", type(None): "null"}
    return names.get(hint, f"a {getattr(hint, '__name__', hint)}")
