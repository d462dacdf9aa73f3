"""How policies break ties: a rotating pointer, and the longest hit at the lowest load.

The simulator calls ``route`` tens of thousands of times a second over 32-64 instances, so
these lean on C-level list scans (``min``, ``max``, ``index``, ``count``) and touch each
instance in Python at most once; for N this small that beats numpy.
"""

from __future__ import annotations

from collections.abc import Sequence


class TieBreaker:
    """A rotating pointer, so that ties (and plain round-robin) spread over instances.

    Always picking the lowest index among equal loads would send every burst of first turns
    on an idle cluster to instance 0; rotating the start spreads them in order.
    """

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = 0

    def take(self, n: int) -> int:
        """The next instance in cyclic order."""
        chosen = self._next % n
        self._next = chosen + 1
        return chosen

    def argmin(self, values: Sequence[float]) -> int:
        """The first minimum at or after the pointer, wrapping; the pointer moves past it."""
        low = min(values)
        chosen = values.index(low)
        start = self._next % len(values)
        # The pointer is reduced modulo N on use, so a cluster that grows or shrinks is fine.
        if chosen < start and values.count(low) > 1:
            try:  # noqa: SIM105 - contextlib.suppress costs three times as much here
                chosen = values.index(low, start)
            except ValueError:
                pass  # every tie lies before the pointer: wrap to the first
        self._next = chosen + 1
        return chosen


def best_hit(hits: Sequence[int], loads: Sequence[float]) -> int:
    """The instance with the longest local hit; ties go to the lower load, then lower index."""
    top = max(hits)
    best = hits.index(top)
    if hits.count(top) > 1:
        for i in range(best + 1, len(hits)):
            if hits[i] == top and loads[i] < loads[best]:
                best = i
    return best
