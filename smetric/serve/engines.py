"""What the router knows of each engine: health, load, progress, and a view of its KV.

The KV view is one of two (``KVView``):

- ``RoutedPrefixes``: the router's own prefix index, the blocks of every request it sent
  to the engine, bounded by the engine's KV capacity and evicted least recently used, the
  same ``PrefixCache`` the simulator uses for a GPU pool. It never asks the engine.
- ``PublishedBlocks``: for an engine that publishes KV events, an ``EventIndex`` kept exact
  by a ``serve.kv_subscriber.KVEventSubscriber``: the engine says what it caches, so
  routing records nothing. Its keys are the router's block ids, so the router must hash
  prompts with the engine's block size.

How the engine speaks (metric names, KV events, tokenising, PD) is its ``backend``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from smetric.core.blocks import reusable_hit_tokens
from smetric.core.kv_events import EventIndex
from smetric.core.prefix_cache import PrefixCache
from smetric.serve.backends import VLLM, EngineBackend
from smetric.serve.scrape import EngineReport

# Columns of the load table, and of ``Engine.totals()``.
INFLIGHT, UNPREFILLED, INFLIGHT_TOKENS = 0, 1, 2
# Columns of the load table (``share_load``).
LOAD_COLUMNS = 3


class KVView(Protocol):
    """What the router believes an engine caches on its device."""

    def match(self, blocks: np.ndarray, block_size: int) -> int:
        """Leading blocks of ``blocks`` the engine holds."""
        ...

    def size(self) -> int: ...

    def remember(self, blocks: np.ndarray, now: float) -> bool:
        """The engine prefilled this prompt; True if the view recorded it (so the other
        router workers should too)."""
        ...

    def learn(self, blocks: np.ndarray, now: float) -> None:
        """Another router worker routed this prompt there."""
        ...

    def restarted(self, capacity: int) -> None:
        """Evidence that the engine process changed."""
        ...

    def readmitted(self, capacity: int, restarts_visible: bool) -> None:
        """Back after failed health checks, which say nothing of its cache."""
        ...

    def resized(self, capacity: int) -> None:
        """The engine's real KV pool is now known to be ``capacity`` blocks."""
        ...


class RoutedPrefixes:
    """The prompts the router sent to the engine, as its cache would hold them."""

    def __init__(self, capacity: int) -> None:
        self.index = PrefixCache(capacity)

    def match(self, blocks: np.ndarray, block_size: int) -> int:
        return self.index.match(blocks)

    def size(self) -> int:
        return self.index.size

    def remember(self, blocks: np.ndarray, now: float) -> bool:
        self.index.insert(blocks, now)
        return True

    def learn(self, blocks: np.ndarray, now: float) -> None:
        self.index.insert(blocks, now)

    def restarted(self, capacity: int) -> None:
        self.index = PrefixCache(capacity)

    def readmitted(self, capacity: int, restarts_visible: bool) -> None:
        """A blip leaves the cache whole, a restart empties it; without a way to tell
        (no start time in the scrapes), the index goes, as the guess it always is."""
        if not restarts_visible:
            self.index = PrefixCache(capacity)

    def resized(self, capacity: int) -> None:
        # The sizes differ, and what it held is a guess either way.
        self.index = PrefixCache(capacity)


class PublishedBlocks:
    """The engine's own account of its cache, from its KV events. Restarts and gaps are
    its subscriber's to handle (its stream shows them), so nothing here clears it."""

    def __init__(self, events: EventIndex) -> None:
        self.events = events

    def match(self, blocks: np.ndarray, block_size: int) -> int:
        if block_size != self.events.block_size:
            raise ValueError(
                f"the engine publishes {self.events.block_size}-token blocks, but prompts "
                f"are hashed with {block_size}"
            )
        return self.events.match(blocks)

    def size(self) -> int:
        return self.events.size()

    def remember(self, blocks: np.ndarray, now: float) -> bool:
        return False  # its BlockStored events say so

    def learn(self, blocks: np.ndarray, now: float) -> None:
        pass

    def restarted(self, capacity: int) -> None:
        pass  # it may already hold what the new process published

    def readmitted(self, capacity: int, restarts_visible: bool) -> None:
        pass

    def resized(self, capacity: int) -> None:
        pass


@dataclass
class Engine:
    url: str
    kv_blocks: int
    healthy: bool = True
    # The engine's latest /metrics, when the router scrapes them.
    report: EngineReport | None = None
    # The engine's own account of its cache, from its KV events; the view then.
    events: EventIndex | None = None
    backend: EngineBackend = VLLM
    # Sent as ``Authorization: Bearer`` to an engine that requires a key ("": none, or the
    # router's --engine-api-key).
    api_key: str = field(default="", repr=False)
    # Its number in the cluster, stable while others come and go (``serve.pool``).
    number: int = 0
    # Called with the blocks of every prompt ``remember`` records (other workers learn them).
    on_remember: Callable[[np.ndarray], None] | None = None
    view: KVView = field(init=False)
    # Monotonic time the engine last showed progress: a response byte, a moved counter,
    # or the moment it went from idle to busy (``serve.pool``'s stall detection).
    progressed_at: float = field(init=False, default=0.0)
    # Unprefilled tokens this worker has ever routed here: a stream's decode is slowed
    # by the prefills routed beside it (the price learner's decode fit, serve/prices.py).
    routed_unprefilled: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.view = (
            RoutedPrefixes(self.kv_blocks) if self.events is None else PublishedBlocks(self.events)
        )
        self.progressed_at = time.monotonic()
        # The attempts in flight here, which a stalled engine's ejection cuts short.
        self.attempts: set[Any] = set()
        # Load counted here per router worker: a row per worker, this worker's is ``_row``,
        # columns ``INFLIGHT``, ``UNPREFILLED`` and ``INFLIGHT_TOKENS``. One row of its
        # own until ``share_load`` maps in a table that every worker writes.
        self._load = np.zeros((1, LOAD_COLUMNS), dtype=np.int64)
        self._row = 0

    def waited_on(self, besides: object = None) -> bool:
        """Whether an attempt here (other than ``besides``) waits on the engine, not on
        its client (``serve.upstream.Attempt.deliver``): the engine's silence counts only
        then."""
        # A loop rather than any() of a generator: asked once per chunk of every stream.
        for attempt in self.attempts:  # noqa: SIM110
            if attempt.waits_on_engine and attempt is not besides:
                return True
        return False

    @property
    def inflight(self) -> int:
        """Requests this worker routed here whose response has not ended."""
        return int(self._load[self._row, INFLIGHT])

    @inflight.setter
    def inflight(self, value: int) -> None:
        self._load[self._row, INFLIGHT] = value

    @property
    def unprefilled(self) -> int:
        """Prompt tokens this worker routed here, not yet prefilled (each request's prompt
        less its predicted hit, until its first token or its end)."""
        return int(self._load[self._row, UNPREFILLED])

    @unprefilled.setter
    def unprefilled(self, value: int) -> None:
        self._load[self._row, UNPREFILLED] = value

    @property
    def inflight_tokens(self) -> int:
        """Prompt tokens of the requests this worker routed here whose response has not
        ended."""
        return int(self._load[self._row, INFLIGHT_TOKENS])

    @inflight_tokens.setter
    def inflight_tokens(self, value: int) -> None:
        self._load[self._row, INFLIGHT_TOKENS] = value

    def charge(self, requests: int, unprefilled: int, tokens: int) -> None:
        """Add to this worker's load here (take off, when negative): requests in flight,
        their unprefilled tokens and their prompt tokens, its row found once for all three
        (element by element: a tuple added to the row costs numpy a conversion)."""
        mine = self._load[self._row]
        mine[INFLIGHT] += requests
        mine[UNPREFILLED] += unprefilled
        mine[INFLIGHT_TOKENS] += tokens

    def totals(self) -> list[int]:
        """Every worker's load here, by column (``INFLIGHT``, ``UNPREFILLED``,
        ``INFLIGHT_TOKENS``): one read for a decision, not one numpy sum per figure."""
        load = self._load
        return (load[0] if load.shape[0] == 1 else load.sum(axis=0)).tolist()

    def total_inflight(self) -> int:
        """Every worker's in-flight requests here."""
        return self.totals()[INFLIGHT]

    def total_inflight_tokens(self) -> int:
        """Every worker's in-flight prompt tokens here: ``ClusterView.inflight_prompt_tokens``."""
        return self.totals()[INFLIGHT_TOKENS]

    def total_unprefilled(self) -> int:
        """Every worker's unprefilled tokens here: ``ClusterView.unprefilled_tokens``."""
        return self.totals()[UNPREFILLED]

    def share_load(self, table: np.ndarray, row: int) -> None:
        """Count load in ``table[row]`` (``(workers, LOAD_COLUMNS)`` int64, in memory all workers
        share), so the load routed on is every worker's: each writes only its own row, so
        no locks are needed."""
        table[row] = self._load[self._row]
        self._load, self._row = table, row

    def predicted_hit(self, blocks: np.ndarray, block_size: int, prompt_tokens: int) -> int:
        """Tokens this engine should find cached: whole blocks, never the whole prompt."""
        matched = self.view.match(blocks, block_size)
        return reusable_hit_tokens(matched, prompt_tokens, block_size)

    def view_blocks(self) -> int:
        """Blocks the router's view says the engine holds on its device."""
        return self.view.size()

    def remember(self, blocks: np.ndarray) -> None:
        """The engine now caches this prompt (as vLLM does after the prefill)."""
        if self.view.remember(blocks, time.monotonic()) and self.on_remember is not None:
            self.on_remember(blocks)

    def forget(self) -> None:
        """The engine restarted (its scraped start time changed)."""
        self.view.restarted(self.kv_blocks)

    def readmit(self) -> None:
        """Back after failed health checks; only evidence of a restart clears a view."""
        visible = self.report is not None and self.report.started_at is not None
        self.view.readmitted(self.kv_blocks, visible)

    def load(self, now: float, staleness_s: float, inflight: int | None = None) -> float:
        """In-flight requests (of every worker; ``inflight`` if already read), raised to
        what the engine reports queued if that is fresh."""
        count = float(self.total_inflight() if inflight is None else inflight)
        report = self.report
        if report is None or now - report.at > staleness_s or report.queued is None:
            return count
        return max(count, report.queued)

    def restarted(self, report: EngineReport) -> bool:
        """The engine process changed since the previous scrape (its start time did)."""
        before = None if self.report is None else self.report.started_at
        return before is not None and report.started_at not in (None, before)

    def adopt(self, report: EngineReport, block_size: int) -> bool:
        """Take a scrape; size the prefix index to the engine's real KV pool once known.

        Returns True when the index was resized (it starts empty: the sizes differ, and
        what it held is a guess either way).
        """
        before = self.report
        if (
            report.progress_tokens is not None
            and before is not None
            and before.progress_tokens != report.progress_tokens
        ):
            self.progressed_at = time.monotonic()
        self.report = report
        if report.num_gpu_blocks is None:
            return False
        blocks = report.num_gpu_blocks * (report.block_size or block_size) // block_size
        if blocks == self.kv_blocks or blocks <= 0:
            return False
        self.kv_blocks = blocks
        # Not ``forget``: the engine did not lose its cache, and the events view knows it.
        self.view.resized(blocks)
        return True


class Lease:
    """One request's load on the engine it is charged to, for every front door: in
    flight, its prompt tokens, and its unprefilled tokens until the prompt is prefilled
    (``prefilled``: its first byte). Moves with the request when another engine serves
    it (``move_to``: a gateway's retry); released once, however the request ends.

    The unprefilled tokens are given back once, at the first token or at whatever ends
    the request first (a failed connection, a client that leaves, an error), so the count
    cannot drift however the request ends.
    """

    def __init__(self, engine: Engine, prompt_tokens: int, unprefilled: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.released = False
        self._take(engine, unprefilled)

    def _take(self, engine: Engine, unprefilled: int) -> None:
        self.engine = engine
        self.unprefilled = unprefilled
        engine.routed_unprefilled += unprefilled
        engine.charge(1, unprefilled, self.prompt_tokens)

    def _give_back(self) -> int:
        """Take the load off its engine; the unprefilled tokens it still held."""
        unprefilled, self.unprefilled = self.unprefilled, 0
        self.engine.charge(-1, -unprefilled, -self.prompt_tokens)
        return unprefilled

    def move_to(self, engine: Engine) -> None:
        if not self.released and engine is not self.engine:
            self._take(engine, self._give_back())

    def prefilled(self) -> None:
        """The prompt is prefilled: its tokens are no longer queued; safe to call again."""
        if self.unprefilled:
            self.engine.charge(0, -self.unprefilled, 0)
            self.unprefilled = 0

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._give_back()
