"""One engine's KV-event stream over ZMQ, kept applied to its ``EventIndex``.

The decoding, sequence checks and the index itself are pure (``core/kv_events``); this is
the I/O around them. Batches are applied strictly in sequence order: a missed batch is
fetched from the engine's replay socket before anything newer is applied, because a
``BlockStored`` whose parent was missed cannot be keyed and a missed ``BlockRemoved``
leaves a block the engine no longer has. When the replay cannot fill the hole (no replay
endpoint, no answer, or the engine's buffer no longer reaches back that far) the view
keeps being updated but ``exact`` turns False, so the router can tell a guess from a fact.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio

from smetric.core.kv_events import (
    REPLAY_END,
    EventIndex,
    KVEventError,
    SequenceTracker,
    decode_batch,
    parse_sequence,
)

log = logging.getLogger("smetric.serve")


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
        name: str = "",
    ) -> None:
        self.index = index
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.replay_endpoint = replay_endpoint
        self.bind = endpoint.startswith("tcp://") if bind is None else bind
        self.replay_timeout_s = replay_timeout_s
        # The engine's URL, for log lines.
        self.name = name or endpoint
        self.exact = True
        self.counters = SubscriberCounters()
        self.tracker = SequenceTracker()
        self._context: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

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
        else:
            sub.connect(self.endpoint)
        self._sub = sub
        self._task = asyncio.create_task(self._run(sub))

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

    async def _run(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sub.recv_multipart()
            # SUBSCRIBE filters by prefix: topic "kv" also receives "kv-a".
            if len(frames) == 3 and frames[0] != self.topic:
                continue
            await self.receive(frames)

    async def receive(self, frames: list[bytes]) -> None:
        """Check one live message's number, fill any hole before it, then apply it."""
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
            # A new engine process starts with an empty cache: the view is exact again once
            # what it published so far is applied.
            self.counters.restarts += 1
            self.index.clear()
            self.exact = True
            self._log("kv_events_restart", last_seq=last, seq=seq)
        elif check.status == "gap":
            self.counters.gaps += 1
        elif last is None:
            missing = range(0, seq)
        if missing and not await self._replay(missing):
            self.counters.unrecovered += 1
            self._degrade(f"batches {missing.start}..{missing.stop - 1} missed, replay failed")
        self._apply(frames[2])

    def _apply(self, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
            self.index.apply(batch.events)
        except KVEventError as exc:
            self.counters.decode_errors += 1
            self._degrade(f"undecodable batch: {exc}")
            return
        self.counters.batches += 1
        self.counters.events += len(batch.events)
        self.counters.skipped_events += batch.skipped

    def _degrade(self, reason: str) -> None:
        """The view may now hold blocks the engine dropped, or lack ones it stored."""
        if self.exact:
            self._log("kv_view_degraded", reason=reason)
        self.exact = False

    def _log(self, event: str, **fields: object) -> None:
        log.warning(json.dumps({"event": event, "engine": self.name, **fields}))

    async def _replay(self, missing: range) -> bool:
        """Apply ``missing`` from the replay socket in order; True when none was lacking.

        A fresh DEALER per request, so that a late answer to an abandoned request can never
        be read as the answer to the next one.
        """
        if self.replay_endpoint is None or self._context is None:
            return False
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        expected = missing.start
        complete = True
        try:
            await dealer.send_multipart([b"", missing.start.to_bytes(8, "big")])
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
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
                        complete = False
                    self._apply(frames[-1])
                    self.counters.replayed += 1
                    expected = seq + 1
        except (TimeoutError, KVEventError):
            return False
        finally:
            dealer.close(linger=0)
        return complete and expected == missing.stop
