"""Command-line options generated from the settings' one declaration.

A setting (``core.settings.setting``) carries its default, help and bounds; a command
that offers it as a flag takes all three from there, so ``--help``, the YAML key and the
check of a given value cannot disagree. Each flag's Python default is the declared
default, so ``--help`` shows it, and the command receives only the flags its command
line gave: a value read from a ``--config`` file is overridden by a flag, never by a
flag's default.

Usage: ``flags = setting_flags(ClusterConfig, "cluster", panel="Cluster")``, then
``@with_setting_flags(flags)`` under ``@app.command()`` on a function that takes
``given: Given``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import typer

from smetric.cli.app import user_errors
from smetric.core.settings import Meta, default_of, settings_of

Command = TypeVar("Command", bound=Callable[..., Any])


@dataclass(frozen=True)
class SettingFlag:
    """One setting offered as a flag: where it lives and what its declaration says."""

    section: str  # the YAML section holding the key; "" for the top level
    field: str  # the key: the dataclass field's name
    decls: tuple[str, ...]  # the flag's names, as click takes them
    annotation: Any
    default: Any
    meta: Meta
    panel: str | None = None

    @property
    def key(self) -> str:
        """The setting as a YAML error names it: ``cluster.instances``, ``warmup_s``."""
        return f"{self.section}.{self.field}" if self.section else self.field

    @property
    def flag(self) -> str:
        """The flag as an error names it: its first name."""
        return self.decls[0].split("/")[0]

    @property
    def param(self) -> str:
        """The command parameter that receives it (unique across the sections)."""
        return self.field

    def help(self) -> str:
        """The declared help, with the values it takes, as the configuration page says."""
        text = self.meta.help
        if self.meta.choices:
            return f"{text} One of: {', '.join(self.meta.choices)}."
        if self.meta.bounded:
            return f"{text} Range: {self.meta.range()}."
        return text

    def parameter(self) -> inspect.Parameter:
        option = typer.Option(
            self.default, *self.decls, help=self.help(), rich_help_panel=self.panel
        )
        return inspect.Parameter(
            self.param, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=self.annotation
        )


def _dashed(name: str) -> str:
    return "--" + name.replace("_", "-")


_LISTS = (tuple, list, frozenset)


def flag_type(hint: Any) -> Any:
    """The type typer parses a setting's flag as: a list setting takes the flag once per
    item; a setting that is a string or a mapping (``str | Engine``) takes the string."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in _LISTS:
        return list[flag_type(args[0])]  # type: ignore[misc]
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if not dataclasses.is_dataclass(a)]
        if len(kept) < len(args):
            return functools.reduce(lambda a, b: a | b, kept)
    return hint


def flag_default(hint: Any, default: Any) -> Any:
    """The flag's default: the setting's, a list one's as a list (none when empty)."""
    if typing.get_origin(hint) in _LISTS:
        return list(default) or None
    return default


def setting_flags(
    cls: type,
    section: str = "",
    *,
    panel: str | None = None,
    names: Mapping[str, Sequence[str]] | None = None,
) -> tuple[SettingFlag, ...]:
    """A flag per setting of the dataclass ``cls``: ``--field-name`` unless ``names``
    gives a field its flag names (aliases, a ``--on/--off`` pair, a rename where the
    field's own name is taken)."""
    names = names or {}
    hints = typing.get_type_hints(cls)
    return tuple(
        SettingFlag(
            section=section,
            field=f.name,
            decls=tuple(names.get(f.name, (_dashed(f.name),))),
            annotation=flag_type(hints[f.name]),
            default=flag_default(hints[f.name], default_of(f)),
            meta=meta,
            panel=panel,
        )
        for f, meta in settings_of(cls)
    )


@dataclass(frozen=True)
class Given:
    """The settings a command line gave, each checked against its declaration, by key
    (``cluster.instances``); settings left at their default are absent."""

    values: Mapping[str, Any]

    def __contains__(self, key: object) -> bool:
        return key in self.values

    def section(self, name: str) -> dict[str, Any]:
        """The given settings of one section (``""``: the top level), by field."""
        if not name:
            return {key: value for key, value in self.values.items() if "." not in key}
        prefix = f"{name}."
        return {
            key.removeprefix(prefix): value
            for key, value in self.values.items()
            if key.startswith(prefix)
        }


# Where a parameter's value came from, as click names it: a default is not "given".
DEFAULTS = frozenset({"DEFAULT", "DEFAULT_MAP"})
CONTEXT = "settings_context"  # the parameter through which typer passes the click context


def given_settings(
    flags: Iterable[SettingFlag], values: Mapping[str, Any], ctx: typer.Context
) -> Given:
    """The flags of ``values`` (a command's parameters) that its command line set, checked
    as a YAML file's keys are, a ValueError naming the flag otherwise."""
    given = {}
    for flag in flags:
        source = ctx.get_parameter_source(flag.param)
        if source is None or source.name in DEFAULTS:
            continue
        given[flag.key] = flag.meta.check(flag.flag, values[flag.param])
    return Given(given)


def with_setting_flags(flags: Sequence[SettingFlag]) -> Callable[[Command], Command]:
    """A decorator: the command gains one option per flag, after its own parameters, and
    is called with ``given``, the settings its command line gave, instead of them."""

    def decorate(command: Command) -> Command:
        own = inspect.signature(command, eval_str=True)
        params = [p for p in own.parameters.values() if p.name != "given"]
        clash = {p.name for p in params} & {f.param for f in flags}
        if clash or len({f.param for f in flags}) != len(flags):
            raise TypeError(f"{command.__name__}: flag parameters collide: {sorted(clash)}")
        context = inspect.Parameter(
            CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context
        )
        generated = [f.parameter() for f in flags]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            ctx = kwargs.pop(CONTEXT)
            with user_errors():
                given = given_settings(flags, kwargs, ctx)
            for flag in flags:
                del kwargs[flag.param]
            return command(**kwargs, given=given)

        wrapper.__signature__ = own.replace(  # type: ignore[attr-defined]
            parameters=[*params, context, *generated], return_annotation=own.return_annotation
        )
        wrapper.__annotations__ = {p.name: p.annotation for p in (*params, context, *generated)}
        return typing.cast(Command, wrapper)

    return decorate
