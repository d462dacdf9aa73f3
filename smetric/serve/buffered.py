"""The bytes of request bodies the router holds at once, all requests together.

A body is held from its first byte to its request's end: its bytes, kept for a retry on
another engine, and its parsed form, several times their size. The per-request limit
(``--max-body-bytes``) bounds one request; a few large ones at once still add up to
gigabytes. ``ByteBudget`` bounds their sum. A request holds what its ``Content-Length``
promises before a byte of its body is read, else what has arrived so far, growing as it
arrives (a compressed body, once arrived: the most it may inflate to); a
request that would take the router past ``--max-buffered-bytes`` waits a moment for
others to give bytes back, then gets a 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

from smetric.serve.refusals import Refusal


class ByteBudget:
    """Bytes held, against ``limit``; a request alone always fits, so that a limit below
    one body's size slows the router to one such body at a time rather than refusing it.

    Whoever gives bytes back wakes every waiter (they recheck: the first that fits takes
    the room); waiting has no order, so a large body may wait longer than a small one,
    never longer than ``wait_s``. ``report`` is told the bytes held after each change
    (a gauge's ``set``).
    """

    def __init__(
        self, limit: int, wait_s: float = 2.0, report: Callable[[int], None] | None = None
    ) -> None:
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit}")
        self.limit = limit
        self.wait_s = wait_s
        self.used = 0
        self.report = report
        self._freed = asyncio.Event()
        self._waiting = 0  # requests waiting for room: only they need waking

    def fits(self, held: int, size: int) -> bool:
        """Whether a request holding ``held`` bytes may hold ``size`` in all."""
        others = self.used - held
        return others == 0 or others + size <= self.limit

    def held(self, size: int = 0) -> _Held:
        """A request's ``Hold``, of ``size`` bytes to start with, for an ``async with``
        block; given back on every exit."""
        return _Held(Hold(self), size)

    def _add(self, size: int) -> None:
        self.used += size
        if self.report is not None:
            self.report(self.used)
        if size < 0 and self._waiting:
            # Wake this generation's waiters; later ones wait on a fresh event.
            freed, self._freed = self._freed, asyncio.Event()
            freed.set()


class Hold:
    """The bytes one request holds of a ``ByteBudget``: grown as its body arrives, given
    back in part once its real size is known, and whole at its end (``shrink(0)``, which
    may be called again)."""

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.size = 0

    async def grow(self, size: int) -> None:
        """Hold at least ``size`` bytes; a ``Refusal`` (503) when they cannot be had
        within the budget's ``wait_s``."""
        budget = self.budget
        if size <= self.size:
            return
        if budget.fits(self.size, size):  # as nearly always: no wait, no timer
            budget._add(size - self.size)
            self.size = size
            return
        budget._waiting += 1
        try:
            async with asyncio.timeout(budget.wait_s):
                while not budget.fits(self.size, size):
                    await budget._freed.wait()
        except TimeoutError:
            raise Refusal(
                503,
                "buffers_full",
                f"the router holds {budget.used} bytes of request bodies, its limit is "
                f"{budget.limit}: retry shortly",
                retry_after_s=1,
            ) from None
        finally:
            budget._waiting -= 1
        budget._add(size - self.size)
        self.size = size

    def shrink(self, size: int) -> None:
        """Hold at most ``size`` bytes, giving the rest back."""
        if size >= self.size:
            return
        self.budget._add(size - self.size)
        self.size = size


class _Held:
    """``ByteBudget.held``'s block (a class, not a generator, since every request enters
    one)."""

    def __init__(self, hold: Hold, size: int) -> None:
        self.hold = hold
        self.size = size

    async def __aenter__(self) -> Hold:
        await self.hold.grow(self.size)  # holds nothing more unless it returns
        return self.hold

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.hold.shrink(0)
