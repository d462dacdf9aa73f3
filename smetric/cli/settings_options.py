"""Command-line flags generated from settings declared once (``core.settings.setting``).

``settings_flags(cls)`` gives a command one typer option per setting of the settings
dataclass ``cls`` and of its sections: named after the key (``--health-interval`` for
``health_interval_s``) unless the setting names its own, with the setting's help, its
default shown in ``--help``, and its bounds and choices checked as a file's are. A
flag's name, help and range thus live in the dataclass alone.

The command receives the settings the user gave as flags (not the defaults of the rest),
so the values of a config file stand where no flag overrides them.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import typer

from smetric.core.settings import Meta
from smetric.core.settings_load import Leaf, leaves

# The settings given as flags, by setting name.
Given = dict[str, Any]

_SCALARS = (bool, int, float, str, Path)


def flag_names(leaf: Leaf) -> tuple[str, ...]:
    """A setting's flags: its declared ones, else ``--KEY`` less a trailing ``_s`` where it
    means seconds (not in a rate, ``_gb_s``)."""
    if leaf.meta.flags:
        return leaf.meta.flags
    key = leaf.field.name
    name = "--" + (key if key.endswith("_gb_s") else key.removesuffix("_s")).replace("_", "-")
    return (f"{name}/--no-{name[2:]}",) if _scalar(leaf.hint) is bool else (name,)


def _scalar(hint: Any) -> Any:
    """The scalar type a flag reads for ``hint``: its own, a list's items', or the first
    scalar of a union (a URL for ``str | Engine``)."""
    if hint in _SCALARS:
        return hint
    args = [a for a in get_args(hint) if a is not type(None)]
    if get_origin(hint) in (Union, types.UnionType):
        return next(_scalar(a) for a in args if _scalar(a) is not None)
    if get_origin(hint) in (tuple, list, frozenset):
        return _scalar(args[0])
    return None


def _is_list(hint: Any) -> bool:
    return get_origin(hint) in (tuple, list, frozenset)


def flag_type(leaf: Leaf) -> Any:
    """The type typer parses the flag as."""
    scalar = _scalar(leaf.hint)
    if leaf.meta.choices:
        scalar = Literal.__getitem__(leaf.meta.choices)
    if _is_list(leaf.hint):
        return list[scalar]  # type: ignore[valid-type]
    optional = type(None) in get_args(leaf.hint)
    return Optional[scalar] if optional else scalar  # noqa: UP045 - built from a variable


def flag_default(leaf: Leaf) -> Any:
    """The flag's default: the setting's (a list's as a list; none for an empty one)."""
    default: Any = leaf.field.default
    if _is_list(leaf.hint):
        return list(default) or None
    return default


def flag_help(meta: Meta) -> str:
    """The setting's help; an open bound, which typer's ranges do not show, added."""
    if meta.gt is not None or meta.lt is not None:
        return f"{meta.help} Range: {meta.range()}."
    return meta.help


def _checker(name: str, meta: Meta) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        try:
            for item in value if isinstance(value, list) else [value]:
                meta.check(name, item)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        return value

    return check


def option(leaf: Leaf, panel: str | None) -> inspect.Parameter:
    """The typer option of one setting, as a keyword parameter of a command."""
    meta, default = leaf.meta, flag_default(leaf)
    shown = default is not None and default != []
    info = typer.Option(
        *flag_names(leaf),
        help=flag_help(meta),
        show_default=shown,
        min=meta.ge,
        max=meta.le,
        callback=_checker(leaf.field.name, meta),
        rich_help_panel=panel,
    )
    return inspect.Parameter(
        leaf.field.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[flag_type(leaf), info],
    )


def given_of(ctx: typer.Context, names: list[str]) -> Given:
    """The settings of ``names`` that the command line of ``ctx`` gave (not defaults)."""
    given: Given = {}
    for name in names:
        source = ctx.get_parameter_source(name)
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            given[name] = ctx.params[name]
    return given


def settings_flags(
    cls: type, panels: Mapping[type, str] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator giving a typer command a flag per setting of ``cls``; the command is
    called with the settings given as flags first (a ``Given``), then its own parameters.
    ``panels`` groups the settings a class declares under a heading of ``--help``."""
    declared = list(leaves(cls))
    names = [leaf.field.name for leaf in declared]
    if len(set(names)) != len(names):
        raise TypeError(f"{cls.__name__}: a setting name appears in two sections")
    panels = panels or {}

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = list(inspect.signature(command, eval_str=True).parameters.values())[1:]
        flags = [option(leaf, panels.get(leaf.declared_in)) for leaf in declared]
        context = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)

        def run(ctx: typer.Context, **values: Any) -> Any:
            given = given_of(ctx, names)
            return command(given, **{k: v for k, v in values.items() if k not in names})

        for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
            setattr(run, attribute, getattr(command, attribute))
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        run.__signature__ = inspect.Signature([context, *own, *flags])  # type: ignore[attr-defined]
        return run

    return decorate
