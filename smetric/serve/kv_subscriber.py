"""One engine's KV-event stream over ZMQ, kept applied to its ``EventIndex``.

The decoding, sequence checks and the index itself are pure (``core/kv_events``); this is
the I/O around them. Batches are applied strictly in sequence order: a missed batch is
fetched from the engine's replay socket before anything newer is applied, because a
``BlockStored`` whose parent was missed cannot be keyed and a missed ``BlockRemoved``
leaves a block the engine no longer has. When the replay cannot fill the hole (no replay
endpoint, no answer, or the engine's buffer no longer reaches back that far) the view
keeps being updated but ``exact`` turns False, so the router can tell a guess from a fact.

A view degrades whenever it loses an event: an unfilled hole, an undecodable batch, a
malformed event (left out, the rest of its batch applied), a ``BlockStored`` whose parent
it does not hold (an orphan: evidence of an earlier loss), blocks forgotten to keep the
view within its cap (``max_blocks``), or a failure of the subscriber itself, which is
counted and restarted after a backoff rather than left dead. A degraded
view is resynced: the engine's history from batch 0 is replayed into a fresh index that
replaces the view only if nothing was missing, retried with a doubling backoff. The view
is exact again after such a complete resync or an engine restart; until then it keeps
being updated as the best guess there is. Only evidence of a restart clears it: a
sequence that starts again, or a changed process start time (``engine_restarted``).

A replay may hold thousands of batches and a flood may never pause, so the event loop
gets a turn per batch and per slice of blocks, whatever arrives: the router's HTTP work
waits on one slice, never on a backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from smetric.core.kv_events import (
    REPLAY_END,
    EventIndex,
    KVEventError,
    SequenceTracker,
    decode_batch,
    in_slices,
    parse_sequence,
)

log = logging.getLogger("smetric.serve")
# Longest wait between resyncs, or between restarts of a failing subscriber.
_MAX_BACKOFF_S = 60.0
# Blocks applied between two turns of the event loop.
_SLICE_BLOCKS = 1024
# Payloads larger than this are decoded in a thread, beside the event loop.
_DECODE_ELSEWHERE_BYTES = 256 * 1024
# Replayed batches queued at most (vLLM's replay buffer holds 10,000 by default).
_REPLAY_QUEUE = 100_000


def _local(endpoint: str) -> bool:
    """Whether a bound ZMQ endpoint is reachable from this host alone: ``ipc://`` and
    ``inproc://``, or ``tcp://`` on a loopback address (``*`` reads back as ``0.0.0.0``)."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _HistoryGone(Exception):
    """The engine's replay buffer starts after the batch asked for."""

    def __init__(self, oldest: int) -> None:
        super().__init__(f"the replay starts at batch {oldest}")
        self.oldest = oldest


@dataclass
class SubscriberCounters:
    """Monotonic totals, for logs and ``/metrics``."""

    batches: int = 0
    """Batches applied, live or replayed."""
    events: int = 0
    skipped_events: int = 0
    """Events of types the decoder does not know (a newer vLLM)."""
    gaps: int = 0
    restarts: int = 0
    replayed: int = 0
    """Batches applied from a replay answer."""
    duplicates: int = 0
    """Replayed batches dropped because they were not the next one missing."""
    unrecovered: int = 0
    """Holes the replay could not fill."""
    decode_errors: int = 0
    invalid_events: int = 0
    """Malformed events left out of their batch (e.g. a token id outside [0, 2**32))."""
    orphaned: int = 0
    """``BlockStored`` events not applied because the view lacks their parent."""
    mismatched: int = 0
    """``BlockStored`` events not applied because their block size is not the router's."""
    unresolved_hashes: int = 0
    """Hashes of hash-only offload ``BlockStored`` events the view could not key (their GPU
    block was gone before the offload was announced); a limit of the format, not a loss."""
    evicted: int = 0
    """Blocks the view forgot, oldest first, to stay within its cap (``max_blocks``)."""
    resyncs: int = 0
    """Degraded views rebuilt whole from the engine's replay buffer."""
    failures: int = 0
    """Errors that stopped the subscriber, which was then restarted."""


class KVEventSubscriber:
    """Subscribes to one engine's topic and applies its batches to ``index``.

    ``endpoint`` is the address this side uses. vLLM with a ``tcp://host:port`` endpoint
    connects, so the subscriber binds it; with ``tcp://*:port`` (or ``ipc://``) vLLM binds,
    so pass the engine's address with ``bind=False``. By default ``tcp://`` binds and
    anything else connects. ``replay_endpoint`` is the engine's ROUTER (vLLM binds it).

    A subscriber that joins after the engine published its first batch asks the replay for
    the engine's history from 0; without all of it the view starts out not ``exact``.
    """

    def __init__(
        self,
        index: EventIndex,
        endpoint: str,
        topic: str,
        replay_endpoint: str | None = None,
        *,
        bind: bool | None = None,
        replay_timeout_s: float = 1.0,
        resync_backoff_s: float = 1.0,
        restart_backoff_s: float = 0.05,
        name: str = "",
    ) -> None:
        self.index = index
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.replay_endpoint = replay_endpoint
        self.bind = endpoint.startswith("tcp://") if bind is None else bind
        self.replay_timeout_s = replay_timeout_s
        # First waits before another resync and before restarting after a failure; both
        # double on each failure up to ``_MAX_BACKOFF_S``.
        self.resync_backoff_s = resync_backoff_s
        self.restart_backoff_s = restart_backoff_s
        # The engine's URL, for log lines.
        self.name = name or endpoint
        self.exact = True
        self.counters = SubscriberCounters()
        self.tracker = SequenceTracker()
        self._context: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        # One batch, resync or restart at a time, whoever calls.
        self._lock = asyncio.Lock()
        self._resync_at = 0.0
        self._resync_wait_s = resync_backoff_s
        # When the stream last showed a restart (monotonic), so that a scrape seeing the
        # same restart later does not clear what the new process has published since.
        self._restart_seen_at = -1.0

    async def start(self) -> None:
        """Open the SUB socket and start applying batches in the background."""
        if self._task is not None:
            raise RuntimeError("the subscriber is already started")
        self._context = zmq.asyncio.Context()
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        if self.bind:
            sub.bind(self.endpoint)
            # The address it got: ``tcp://host:*`` binds a port the OS picks.
            self.endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
            if not _local(self.endpoint):
                self._log(
                    "kv_events_endpoint_exposed",
                    endpoint=self.endpoint,
                    warning="ZMQ has no authentication: whoever reaches this address can "
                    "publish events this engine's view takes as true; bind loopback or a "
                    "private interface and firewall the port",
                )
        else:
            sub.connect(self.endpoint)
        self._sub = sub
        self._task = asyncio.create_task(self._supervise(sub))

    async def close(self) -> None:
        """Stop the task and close every socket; safe to call twice."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        context, self._context = self._context, None
        if context is not None:
            context.destroy(linger=0)
        self._sub = None

    async def _supervise(self, sub: zmq.asyncio.Socket) -> None:
        """Keep the stream applied whatever goes wrong: a failure is counted and logged,
        the view marked degraded (the batch in hand is lost), and reading resumes after a
        backoff that doubles while failures repeat. Only cancelling (``close``) ends it."""
        wait = self.restart_backoff_s
        while True:
            started = time.monotonic()
            try:
                await self._run(sub)
            except Exception as exc:  # whatever it was, the stream must go on
                self.counters.failures += 1
                self._log("kv_subscriber_failed", error=repr(exc))
                self._degrade(f"subscriber failed: {exc!r}")
            if time.monotonic() - started > _MAX_BACKOFF_S:
                wait = self.restart_backoff_s  # it had recovered: start the backoff again
            await asyncio.sleep(wait)
            wait = min(2 * wait, _MAX_BACKOFF_S)

    async def _run(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sub.recv_multipart()
            # SUBSCRIBE filters by prefix: topic "kv" also receives "kv-a". An empty topic
            # (vLLM's default) subscribes to everything the engine publishes, as in ZMQ.
            if len(frames) == 3 and self.topic and frames[0] != self.topic:
                continue
            await self.receive(frames)

    async def receive(self, frames: list[bytes]) -> None:
        """Check one live message's number, fill any hole before it, apply it, and
        resync the view if it is degraded and a resync is due."""
        async with self._lock:
            await self._receive(frames)
            if not self.exact and time.monotonic() >= self._resync_at:
                await self._resync()

    async def engine_restarted(self, since: float) -> None:
        """The engine restarted, as a scrape says (its start time changed after ``since``,
        the previous scrape's monotonic time): its old cache is gone. Unless the stream
        already showed that restart, drop the view and expect the new process's history
        from batch 0, which the next batch asks the replay for."""
        async with self._lock:
            if self._restart_seen_at >= since:
                return
            self._restarted(self.tracker.last, None)
            self.tracker = SequenceTracker()

    async def _receive(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise KVEventError(f"expected [topic, seq, payload], got {len(frames)} frames")
            seq = parse_sequence(frames[1])
            last = self.tracker.last
            check = self.tracker.feed(seq)
        except (KVEventError, ValueError) as exc:
            self.counters.decode_errors += 1
            self._degrade(f"undecodable message: {exc}")
            return
        missing = check.missing
        if check.status == "restart":
            self._restarted(last, seq)
        elif check.status == "gap":
            self.counters.gaps += 1
        elif last is None:
            missing = range(0, seq)
        if missing and not await self._replay(missing, self.index):
            self.counters.unrecovered += 1
            self._degrade(f"batches {missing.start}..{missing.stop - 1} missed, replay failed")
        await self._apply(frames[2], self.index)

    def _restarted(self, last_seq: int | None, seq: int | None) -> None:
        """A new engine process starts with an empty cache: the view is exact again once
        what it published so far is applied."""
        self.counters.restarts += 1
        self._restart_seen_at = time.monotonic()
        self.index.clear()
        self.exact = True
        self._resync_at = 0.0
        self._resync_wait_s = self.resync_backoff_s
        self._log("kv_events_restart", last_seq=last_seq, seq=seq)

    async def _apply(self, payload: bytes, index: EventIndex) -> bool:
        """Apply one batch to ``index``; True when no event of it was lost.

        The batch is applied in slices of at most ``_SLICE_BLOCKS`` blocks with the event
        loop served between them, so that neither a long replay nor a flood of events
        delays the router's HTTP work by more than one slice.
        """
        try:
            if len(payload) > _DECODE_ELSEWHERE_BYTES:
                batch = await asyncio.to_thread(decode_batch, payload)
            else:
                batch = decode_batch(payload)
        except KVEventError as exc:
            self.counters.decode_errors += 1
            self._degrade(f"undecodable batch: {exc}")
            return False
        orphaned, mismatched, unresolved = index.orphaned, index.mismatched, index.unresolved
        evicted = index.evicted
        # A turn of the loop per batch too: a ready message is received without one.
        await asyncio.sleep(0)
        for part in in_slices(batch.events, _SLICE_BLOCKS):
            index.apply(part)
            await asyncio.sleep(0)
        counters = self.counters
        counters.batches += 1
        counters.events += len(batch.events)
        counters.skipped_events += batch.skipped
        counters.invalid_events += len(batch.invalid)
        counters.orphaned += index.orphaned - orphaned
        counters.mismatched += index.mismatched - mismatched
        counters.unresolved_hashes += index.unresolved - unresolved
        counters.evicted += index.evicted - evicted
        if batch.invalid:
            self._degrade(f"malformed event left out: {batch.invalid[0]}")
        elif index.orphaned > orphaned:
            self._degrade("a stored block's parent is missing: events were lost")
        elif index.mismatched > mismatched:
            self._degrade(f"blocks of another size than {index.block_size} left out")
        elif index.evicted > evicted:
            self._degrade(f"more blocks than the view's cap of {index.max_blocks}")
        else:
            return True
        return False

    async def _resync(self) -> None:
        """Rebuild the view from the engine's history: batches 0 to the last one seen are
        replayed into a fresh index, which replaces the view only if none was missing or
        lost; otherwise the degraded view stays and the next try waits twice as long, or
        for a restart if the engine's buffer no longer reaches batch 0."""
        last = self.tracker.last
        if self.replay_endpoint is None or last is None:
            return
        rebuilt = EventIndex(self.index.block_size, self.index.max_blocks)
        try:
            whole = await self._replay(range(0, last + 1), rebuilt, whole=True)
        except _HistoryGone as gone:
            # The engine's buffer starts later and only moves on: no rebuild can be whole
            # before the engine restarts.
            self._resync_at = math.inf
            self._log("kv_view_unresyncable", oldest_batch=gone.oldest)
            return
        if whole:
            self.index.take(rebuilt)
            self.exact = True
            self.counters.resyncs += 1
            self._resync_wait_s = self.resync_backoff_s
            self._log("kv_view_resynced", batches=last + 1)
        else:
            self._resync_at = time.monotonic() + self._resync_wait_s
            self._resync_wait_s = min(2 * self._resync_wait_s, _MAX_BACKOFF_S)

    def _degrade(self, reason: str) -> None:
        """The view may now hold blocks the engine dropped, or lack ones it stored."""
        if self.exact:
            self._log("kv_view_degraded", reason=reason)
        self.exact = False

    def _log(self, event: str, **fields: object) -> None:
        log.warning(json.dumps({"event": event, "engine": self.name, **fields}))

    async def _replay(self, missing: range, index: EventIndex, *, whole: bool = False) -> bool:
        """Apply ``missing`` from the replay socket to ``index`` in order; True when no
        batch or event was lacking. A hole is skipped over, unless ``whole`` (a rebuild,
        useless unless complete) stops at the first one.

        A fresh DEALER per request, so that a late answer to an abandoned request can never
        be read as the answer to the next one.
        """
        if self.replay_endpoint is None or self._context is None:
            return False
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        # The engine's ROUTER drops what its queue to this socket cannot take, and batches
        # are applied slower than they arrive: ZMQ's own thread queues the whole answer.
        dealer.setsockopt(zmq.RCVHWM, _REPLAY_QUEUE)
        expected = missing.start
        complete = True
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", missing.start.to_bytes(8, "big")])
            while True:
                # Each message has its deadline, not the whole answer: an engine's buffer
                # holds up to 10,000 batches, which take seconds to apply.
                async with asyncio.timeout(self.replay_timeout_s):
                    frames = await dealer.recv_multipart()
                if len(frames) < 2:
                    raise KVEventError(f"replay frame has {len(frames)} parts")
                seq = parse_sequence(frames[-2])
                if seq == REPLAY_END:
                    break
                if seq < expected or seq >= missing.stop:
                    self.counters.duplicates += 1
                    continue
                if seq > expected:
                    if whole and expected == missing.start:
                        raise _HistoryGone(seq)
                    if whole:
                        return False
                    complete = False
                complete = await self._apply(frames[-1], index) and complete
                self.counters.replayed += 1
                expected = seq + 1
        except (TimeoutError, KVEventError, zmq.ZMQError):
            return False
        finally:
            dealer.close(linger=0)
        return complete and expected == missing.stop
