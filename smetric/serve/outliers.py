"""Passive health: ejecting an engine that answers ``/health`` but fails real requests.

An engine that fails fast (a 500 to every generation, garbage, a stall the timeouts cut)
finishes its requests soonest, so it shows the lowest load and a load balancer sends it the
most traffic: it becomes a black hole. What the router sees on real requests is the better
health check. After ``threshold`` consecutive failures the engine is ejected for a backoff
that doubles with every ejection that follows without a success in between (capped), and
the active health check may re-admit it only once that backoff is over.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Record:
    failures: int = 0  # consecutive
    ejections: int = 0  # consecutive, without a success between them
    until: float = 0.0  # monotonic time before which the engine stays out


@dataclass
class OutlierDetector:
    threshold: int = 3
    backoff_s: float = 5.0
    max_backoff_s: float = 300.0

    def __post_init__(self) -> None:
        self._records: dict[str, _Record] = {}

    def _record(self, engine: str) -> _Record:
        return self._records.setdefault(engine, _Record())

    def failed(self, engine: str, now: float) -> float | None:
        """Count a failure; the backoff in seconds when this one ejects the engine.

        Failures while the engine is out are of requests sent before it was ejected: one
        incident, which must not stretch the backoff once per request it cut.
        """
        record = self._record(engine)
        if now < record.until:
            return None
        record.failures += 1
        if record.failures < self.threshold:
            return None
        return self.eject(engine, now)

    def eject(self, engine: str, now: float) -> float:
        """Eject the engine now (a stall seen by its progress); the backoff in seconds."""
        record = self._record(engine)
        record.failures = 0
        backoff = min(self.backoff_s * 2**record.ejections, self.max_backoff_s)
        record.ejections += 1
        record.until = now + backoff
        return backoff

    def succeeded(self, engine: str) -> None:
        if engine in self._records:
            del self._records[engine]

    def may_readmit(self, engine: str, now: float) -> bool:
        record = self._records.get(engine)
        return record is None or now >= record.until
