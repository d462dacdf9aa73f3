"""Requests the router answers itself, without an engine: each one counted and logged.

A refusal is the router's own judgement (not JSON, over a limit, a bad key, no engine to
serve), so an operator must see it: a client refused on every request otherwise looks
like a client sending nothing. Each one moves ``smetric_refused_requests_total{route,
status, reason}`` and writes a log line naming the same three, at most one per reason a
second, with the count of those left out since: a client retrying in a loop must not
flood the log. The line holds no message: messages may quote the body, and a log line
must never hold the body or a key.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

log = logging.getLogger("smetric.serve")

# Paths the router serves, as they appear in the counter's ``route`` label; any other path
# is ``other``, so a client cannot mint label values.
_KNOWN_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/models",
        "/metrics",
        "/health",
        "/live",
    }
)


def route_label(path: str) -> str:
    path = path.split("?")[0]
    return path if path in _KNOWN_ROUTES else "other"


class Refusal(Exception):
    """The router answers ``status`` itself; ``reason`` is a short label for the counter
    and the log, ``message`` the sentence the client reads (in the route's error shape,
    unless ``body`` is the answer already)."""

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        body: dict[str, Any] | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body
        self.retry_after_s = retry_after_s
        """Seconds the client should wait before it tries again (``Retry-After``)."""


@dataclass
class RefusalLog:
    """Counts every refusal and logs the first of each reason per ``interval_s``."""

    counter: Counter
    interval_s: float = 1.0
    # Per reason: when its last line was written, and how many were left out since.
    _last: dict[str, float] = field(default_factory=dict)
    _suppressed: dict[str, int] = field(default_factory=dict)

    def note(self, path: str, refusal: Refusal) -> None:
        route = route_label(path)
        self.counter.labels(route, str(refusal.status), refusal.reason).inc()
        now = time.monotonic()
        if now - self._last.get(refusal.reason, -self.interval_s) < self.interval_s:
            self._suppressed[refusal.reason] = self._suppressed.get(refusal.reason, 0) + 1
            return
        self._last[refusal.reason] = now
        line = {
            "event": "refused",
            "route": route,
            "status": refusal.status,
            "reason": refusal.reason,
            "suppressed": self._suppressed.pop(refusal.reason, 0),
        }
        log.warning(json.dumps(line))
