"""What the router knows of each engine: health, load, and an approximate KV view.

The KV view is the router's own prefix index: the blocks of every request it sent to the
engine, bounded by the engine's KV capacity and evicted least recently used, the same
``PrefixCache`` the simulator uses for a GPU pool. It never asks the engine.

An engine that publishes KV events can carry an ``EventIndex`` (``events``) instead, kept
exact by a ``serve.kv_subscriber.KVEventSubscriber``: then the engine says what it caches,
so routing does not record anything, and only the events view answers hits. Its keys are
the router's block ids, so the router must hash prompts with the engine's block size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from smetric.core.blocks import reusable_hit_tokens
from smetric.core.kv_events import EventIndex
from smetric.core.prefix_cache import PrefixCache
from smetric.serve.scrape import EngineReport

_INFLIGHT, _UNPREFILLED, _INFLIGHT_TOKENS = 0, 1, 2
# Columns of the load table (``share_load``).
LOAD_COLUMNS = 3


@dataclass
class Engine:
    url: str
    kv_blocks: int
    healthy: bool = True
    index: PrefixCache = field(init=False)
    # The engine's latest /metrics, when the router scrapes them.
    report: EngineReport | None = None
    # The engine's own account of its cache, from its KV events; replaces ``index``.
    events: EventIndex | None = None

    # Called with the blocks of every prompt ``remember`` records (other workers learn them).
    on_remember: Callable[[np.ndarray], None] | None = None

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.index = PrefixCache(self.kv_blocks)
        # Load counted here per router worker: a row per worker, this worker's is ``_row``,
        # columns ``_INFLIGHT``, ``_UNPREFILLED`` and ``_INFLIGHT_TOKENS``. One row of its
        # own until ``share_load`` maps in a table that every worker writes.
        self._load = np.zeros((1, LOAD_COLUMNS), dtype=np.int64)
        self._row = 0

    @property
    def inflight(self) -> int:
        """Requests this worker routed here whose response has not ended."""
        return int(self._load[self._row, _INFLIGHT])

    @inflight.setter
    def inflight(self, value: int) -> None:
        self._load[self._row, _INFLIGHT] = value

    @property
    def unprefilled(self) -> int:
        """Prompt tokens this worker routed here, not yet prefilled (each request's prompt
        less its predicted hit, until its first token or its end)."""
        return int(self._load[self._row, _UNPREFILLED])

    @unprefilled.setter
    def unprefilled(self, value: int) -> None:
        self._load[self._row, _UNPREFILLED] = value

    @property
    def inflight_tokens(self) -> int:
        """Prompt tokens of the requests this worker routed here whose response has not
        ended."""
        return int(self._load[self._row, _INFLIGHT_TOKENS])

    @inflight_tokens.setter
    def inflight_tokens(self, value: int) -> None:
        self._load[self._row, _INFLIGHT_TOKENS] = value

    def total_inflight_tokens(self) -> int:
        """Every worker's in-flight prompt tokens here: ``smetric_cost``'s ``token_load``."""
        return int(self._load[:, _INFLIGHT_TOKENS].sum())

    def total_unprefilled(self) -> int:
        """Every worker's unprefilled tokens here: Dynamo's ``prefill_tokens`` load."""
        return int(self._load[:, _UNPREFILLED].sum())

    def share_load(self, table: np.ndarray, row: int) -> None:
        """Count load in ``table[row]`` (``(workers, LOAD_COLUMNS)`` int64, in memory all workers
        share), so the load routed on is every worker's: each writes only its own row, so
        no locks are needed."""
        table[row] = self._load[self._row]
        self._load, self._row = table, row

    def predicted_hit(self, blocks: np.ndarray, block_size: int, prompt_tokens: int) -> int:
        """Tokens this engine should find cached: whole blocks, never the whole prompt."""
        if self.events is None:
            matched = self.index.match(blocks)
        else:
            if block_size != self.events.block_size:
                raise ValueError(
                    f"{self.url} publishes {self.events.block_size}-token blocks, but "
                    f"prompts are hashed with {block_size}"
                )
            matched = self.events.match(blocks)
        return reusable_hit_tokens(matched, prompt_tokens, block_size)

    def view_blocks(self) -> int:
        """Blocks the router's view says the engine holds on its device."""
        return self.index.size if self.events is None else self.events.size()

    def remember(self, blocks: np.ndarray) -> None:
        """The engine now caches this prompt (as vLLM does after the prefill).

        With an events view the engine's own ``BlockStored`` says so instead.
        """
        if self.events is None:
            self.index.insert(blocks, time.monotonic())
            if self.on_remember is not None:
                self.on_remember(blocks)

    def forget(self) -> None:
        """The engine restarted (its scraped start time changed): drop the approximate
        index. The events view is its subscriber's to reset, since it may already hold
        what the new process published."""
        self.index = PrefixCache(self.kv_blocks)

    def readmit(self) -> None:
        """Back after failed health checks, which say nothing of its cache: a network
        blip leaves it whole, a restart empties it. Only evidence of a restart clears a
        view, so the events view is kept (its stream shows a restart itself), and so is
        the approximate index when scrapes can tell (the engine reports its start time);
        without that evidence either way the index is dropped, as a guess it always is."""
        if self.report is None or self.report.started_at is None:
            self.index = PrefixCache(self.kv_blocks)

    def load(self, now: float, staleness_s: float) -> float:
        """In-flight requests (of every worker), raised to what the engine reports queued if
        that is fresh."""
        inflight = float(self._load[:, _INFLIGHT].sum())
        report = self.report
        if report is None or now - report.at > staleness_s or report.queued is None:
            return inflight
        return max(inflight, report.queued)

    def restarted(self, report: EngineReport) -> bool:
        """The engine process changed since the previous scrape (its start time did)."""
        before = None if self.report is None else self.report.started_at
        return before is not None and report.started_at not in (None, before)

    def adopt(self, report: EngineReport, block_size: int) -> bool:
        """Take a scrape; size the prefix index to the engine's real KV pool once known.

        Returns True when the index was resized (it starts empty: the sizes differ, and
        what it held is a guess either way).
        """
        self.report = report
        if report.num_gpu_blocks is None:
            return False
        blocks = report.num_gpu_blocks * (report.block_size or block_size) // block_size
        if blocks == self.kv_blocks or blocks <= 0:
            return False
        self.kv_blocks = blocks
        # Not ``forget``: the engine did not lose its cache, and the events view knows it.
        self.index = PrefixCache(self.kv_blocks)
        return True


class QueuedPrefill:
    """One routed request's share of its engine's ``unprefilled`` tokens.

    Added when the request is routed and given back once, at its first token or at
    whatever ends it first (a failed connection, a client that leaves, an error), so the
    count cannot drift however the request ends.
    """

    __slots__ = ("engine", "tokens")

    def __init__(self, engine: Engine, tokens: int) -> None:
        self.engine = engine
        self.tokens = tokens
        engine.unprefilled += tokens

    def done(self) -> None:
        """The prompt is prefilled, or never will be; safe to call again."""
        self.engine.unprefilled -= self.tokens
        self.tokens = 0
