"""A rendered prompt as the router hashes it: cut into segments, the history's first."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Rendering:
    """A rendered prompt cut into segments, each tokenised on its own (``core/block_memo``).

    Cuts fall at message boundaries, where a model's template puts special tokens that
    tokenisers split at anyway, and where the history ends: the first ``history`` segments
    are the history.
    """

    segments: list[str]
    history: int

    @property
    def text(self) -> str:
        return "".join(self.segments)

    def history_end(self) -> int:
        """The offset in ``text`` where the history ends (0 without one)."""
        return sum(map(len, self.segments[: self.history]))
