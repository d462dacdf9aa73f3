"""Frozen records that convert to and from JSON by field name: the base of every result
file's schema (a run's summary, a trace's analysis), so that each is written once and
read through attributes that mypy checks.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Self

import msgspec


class JsonRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A record of a result file: frozen, converted to and from JSON by field name."""

    # The version of the file's shape this code reads, named when a file does not match.
    schema_version: ClassVar[int] = 1

    def to_builtins(self) -> dict[str, Any]:
        """The record as the JSON-able dict written to disk."""
        return msgspec.to_builtins(self)

    @classmethod
    def from_builtins(cls, data: object) -> Self:
        """The record from its JSON-able form; ``ValueError`` naming the schema version
        when ``data`` is not one (a file from an older or newer release, or not a result).
        Numeric keys may be strings, as JSON writes them (a knee's probed loads)."""
        try:
            return msgspec.convert(data, cls, str_keys=True)
        except msgspec.ValidationError as exc:
            raise ValueError(
                f"not a {cls.__name__} of results schema version {cls.schema_version}: {exc}"
            ) from exc

    def to_json(self) -> str:
        """The record as the result files write it (indented; NaN where a ratio has no
        windows to measure, as Python's ``json`` reads and writes it)."""
        return json.dumps(self.to_builtins(), indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> Self:
        return cls.from_builtins(json.loads(text))
