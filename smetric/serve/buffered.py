"""The bytes of request bodies the router holds at once, all requests together.

A body is held from its first byte to its request's end: its bytes, kept for a retry on
another engine, and its parsed form, several times their size. The per-request limit
(``--max-body-bytes``) bounds one request; a few large ones at once still add up to
gigabytes. ``ByteBudget`` bounds their sum: a request whose body would take the router
past ``--max-buffered-bytes`` waits a moment for others to end, then gets a 503 with
``Retry-After`` before a byte of its body is read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from smetric.serve.refusals import Refusal


class ByteBudget:
    """Bytes held, against ``limit``; a request alone always fits, so that a limit below
    one body's size slows the router to one such body at a time rather than refusing it.

    Whoever releases wakes every waiter (they recheck: the first that fits takes the room);
    waiting has no order, so a large body may wait longer than a small one, never longer
    than ``wait_s``.
    """

    def __init__(self, limit: int, wait_s: float = 2.0) -> None:
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit}")
        self.limit = limit
        self.wait_s = wait_s
        self.used = 0
        self._released = asyncio.Event()

    def fits(self, size: int) -> bool:
        return self.used == 0 or self.used + size <= self.limit

    @contextlib.asynccontextmanager
    async def held(self, size: int) -> AsyncIterator[None]:
        """Hold ``size`` bytes for the block; a ``Refusal`` (503) when they cannot be had
        within ``wait_s``."""
        try:
            async with asyncio.timeout(self.wait_s):
                while not self.fits(size):
                    await self._released.wait()
        except TimeoutError:
            raise Refusal(
                503,
                "buffers_full",
                f"the router holds {self.used} bytes of request bodies, its limit is "
                f"{self.limit}: retry shortly",
                retry_after_s=1,
            ) from None
        self.used += size
        try:
            yield
        finally:
            self.used -= size
            # Wake this generation's waiters; later ones wait on a fresh event.
            released, self._released = self._released, asyncio.Event()
            released.set()
