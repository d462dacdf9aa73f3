"""Settings declared once: a dataclass field carries its default, its help and its bounds.

Everything that reads or shows a setting (a policy spec, a command-line flag, a YAML key,
the configuration reference) takes them from the field, so a default or a range is written
in one place and checked the same way wherever the value came from.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from smetric.core.errors import ConfigError

# Where a policy parameter's value comes from: set by hand (the default), derived from the
# hardware a driver knows (``model.calibrate``; the setting names the ``rate`` it takes),
# or fitted to measurements. A policy's learner may set those of the last two.
Source = Literal["tuned", "hardware", "learned"]


@dataclass(frozen=True)
class Meta:
    """What a setting's field says about it beyond its type and default."""

    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] | None = None
    source: Source = "tuned"
    # The hardware rate a ``source="hardware"`` setting takes where a driver knows it.
    rate: str | None = None
    # For a collection of strings: every item must hold more than whitespace.
    nonempty_items: bool = False

    def check(self, name: str, value: Any) -> Any:
        """``value`` if it lies within the bounds and choices, else a ValueError naming
        ``name``, what it got and what it takes."""
        if value is None:
            return value
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{name} {value!r}: use one of {', '.join(self.choices)}")
        if self.nonempty_items and any(not str(item).strip() for item in value):
            raise ConfigError(f"{name}: an item must not be empty")
        if isinstance(value, bool) or not isinstance(value, int | float):
            return value
        # Written so that NaN fails every bound.
        inside = (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )
        if not inside or (self.bounded and math.isnan(value)):
            raise ConfigError(f"{name} must lie in {self.range()}, got {value}")
        return value

    @property
    def learnable(self) -> bool:
        """Whether a policy's learner may set it: its value belongs to the engines."""
        return self.source != "tuned"

    @property
    def bounded(self) -> bool:
        return any(bound is not None for bound in (self.ge, self.gt, self.le, self.lt))

    def range(self) -> str:
        """The bounds as an interval: ``[0, 1.0]``, ``(0, inf)``."""
        low = (
            "-inf"
            if self.ge is None and self.gt is None
            else self.ge
            if self.gt is None
            else self.gt
        )
        high = (
            "inf"
            if self.le is None and self.lt is None
            else self.le
            if self.lt is None
            else self.lt
        )
        opening = "(" if self.gt is not None or low == "-inf" else "["
        closing = ")" if self.lt is not None else "]"
        return f"{opening}{low}, {high}{closing}"


def setting(
    default: Any,
    help: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple[str, ...] | None = None,
    source: Source = "tuned",
    rate: str | None = None,
    nonempty_items: bool = False,
) -> Any:
    """A dataclass field declaring one setting: its default, help text and bounds."""
    if (source == "hardware") != (rate is not None):
        raise TypeError("a setting takes a hardware rate exactly when its source is hardware")
    meta = Meta(
        help,
        ge=ge,
        gt=gt,
        le=le,
        lt=lt,
        choices=choices,
        source=source,
        rate=rate,
        nonempty_items=nonempty_items,
    )
    return field(default=default, metadata={"setting": meta})


def settings_of(cls_or_obj: Any) -> Iterator[tuple[dataclasses.Field[Any], Meta]]:
    """Each field of a dataclass that declares a setting, with what it declares."""
    for f in dataclasses.fields(cls_or_obj):
        meta = f.metadata.get("setting")
        if meta is not None:
            yield f, meta


def default_of(f: dataclasses.Field[Any]) -> Any:
    """A setting's default (every setting has one)."""
    if f.default is dataclasses.MISSING:
        raise TypeError(f"setting {f.name} declares no default")
    return f.default


def check_settings(obj: Any, prefix: str = "") -> None:
    """Raise a ValueError for the first setting of ``obj`` outside its bounds or choices,
    looking into its sections (fields holding settings dataclasses) too, so a value is
    named by its whole key (``cluster.instances``)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        meta = f.metadata.get("setting")
        if meta is not None:
            meta.check(prefix + f.name, value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_settings(value, f"{prefix}{f.name}.")
