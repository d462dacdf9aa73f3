"""A trace of the traffic a front door routes, written off the request path.

The front door (``smetric serve``, or any other that routes with ``smetric.core``) hands
one ``RecordedRequest`` per completed request to ``Recorder.observe``, which only appends it
to a queue: no hashing, no encoding, no I/O, no lock held by the writer. A writer thread
drains the queue a few times a second, salts the ids, and every ``rotate_s`` seconds (or
``rotate_requests`` rows) writes the rows as one zstd-compressed Parquet segment, renamed
into place whole so a reader never sees half a file. After each segment it deletes the
oldest ones until the folder is within ``max_bytes``. When the writer falls behind by
``max_pending`` observations, new ones are dropped and counted, never waited for. A
segment that cannot be written (the disk full, the folder gone and not to be made again)
is dropped and counted the same way, its partial file removed; a folder deleted while
recording is made again, manifest and all, at the next segment.

What is written is exactly the trace's columns (``trace.recording_format``): no text, no header
value, no key. Block ids are the router's own chained hashes passed through a keyed
pseudo-random function under a per-deployment salt (``record.salt``), so an id cannot be
tested against guessed content without the salt; session and agent names likewise.
The same salt (``--record-salt-file``) keeps ids comparable across restarts and router
replicas; without one, a fresh salt lives only in memory and the recording stands alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from smetric.core.errors import UserError
from smetric.record.salt import Salter
from smetric.trace.jsonl import list_column
from smetric.trace.recording_format import (
    FORMAT,
    MANIFEST,
    METADATA_KEY,
    SEGMENT_GLOB,
    SEGMENT_SCHEMA,
    VERSION,
)
from smetric.trace.schema import Trigger, common_prefix_len

log = logging.getLogger("smetric.record")

SALT_BYTES = 32


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One completed request as its front door saw it (times: Unix seconds)."""

    arrival_s: float
    completion_s: float
    # The router's chained block ids of the prompt, unsalted (``RequestFacts.blocks``).
    blocks: np.ndarray
    prompt_tokens: int
    output_tokens: int | None
    cached_tokens: int | None
    turn: int
    # The conversation's opening digest (``RequestFacts.session_key``).
    conversation: str
    engine: str
    branch: str
    trigger: Trigger = Trigger.UNKNOWN
    session: str | None = None
    agent: str | None = None
    parent_agent: str | None = None


@dataclass(frozen=True)
class RecordSettings:
    folder: Path
    # Bytes of segments the folder may hold; the oldest go first.
    max_bytes: int = 1 << 30
    # A segment closes after this many seconds or rows, whichever comes first.
    rotate_s: float = 300.0
    rotate_requests: int = 100_000
    # Observations the writer may fall behind by before new ones are dropped.
    max_pending: int = 100_000
    # None: a fresh salt for this process's recording only.
    salt: bytes | None = None
    block_size: int = 16
    tokenizer: str = "bytes"

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.rotate_s <= 0 or self.rotate_requests <= 0:
            raise UserError("recording limits must be positive")
        if self.salt is not None and len(self.salt) < 16:
            raise UserError("a recording salt needs at least 16 bytes")


def read_salt(path: Path) -> bytes:
    """A salt file's bytes (at least 16; ``head -c 32 /dev/urandom > FILE`` makes one)."""
    try:
        salt = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read the recording salt: {exc}") from exc
    if len(salt) < 16:
        raise UserError(f"{path}: a recording salt needs at least 16 bytes, got {len(salt)}")
    return salt


_SCALARS = tuple(c for c in SEGMENT_SCHEMA if c != "new_block_ids")


@dataclass
class _Segment:
    """Rows salted and waiting for their segment file: the new block ids as flat arrays,
    one per drained batch, and each row's count of them; and per agent its latest row
    and that row's unsalted blocks, the base the agent's next request is stored against
    (dropped with the segment)."""

    opened: float = field(default_factory=time.monotonic)
    rows: dict[str, list] = field(default_factory=lambda: {c: [] for c in _SCALARS})
    blocks: list[np.ndarray] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    latest: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.lengths)

    def frame(self) -> pl.DataFrame:
        flat = np.concatenate(self.blocks) if self.blocks else np.empty(0, np.int64)
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        frame = pl.DataFrame(self.rows, schema={c: SEGMENT_SCHEMA[c] for c in _SCALARS})
        blocks = list_column(flat, offsets).alias("new_block_ids")
        return frame.with_columns(blocks).select(list(SEGMENT_SCHEMA))


class Recorder:
    """The queue a front door appends to, and the thread that writes it out.

    ``start`` in the process that serves (a forked worker starts its own writer), then
    ``observe`` per request and ``close`` at shutdown, which writes what is left.
    """

    DRAIN_EVERY_S = 0.25

    def __init__(self, settings: RecordSettings) -> None:
        self.settings = settings
        self.salter = Salter(settings.salt or secrets.token_bytes(SALT_BYTES))
        self.dropped = 0
        self.written = 0
        self._pending: deque[RecordedRequest] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._segment = _Segment()
        self._sequence = 0
        self._prepare_folder()

    # -- the request path ------------------------------------------------------------------

    def observe(self, observation: RecordedRequest) -> None:
        """Queue one request for the writer; never waits (a full queue drops it)."""
        if len(self._pending) >= self.settings.max_pending:
            self.dropped += 1
            return
        self._pending.append(observation)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="smetric-record", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the writer and write every queued request."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._drain()
        self._write_segment()

    # -- the writer ------------------------------------------------------------------------

    def _prepare_folder(self) -> None:
        """The folder and its manifest, made if missing (at start, and again before each
        segment: someone may have deleted it meanwhile); ValueError if that fails or the
        folder holds a recording these ids would not compare with."""
        folder = self.settings.folder
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"{folder}: cannot create the recording folder: {exc}") from exc
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "block_size": self.settings.block_size,
            "tokenizer": self.settings.tokenizer,
            "salt_id": self.salter.salt_id,
        }
        path = folder / MANIFEST
        if path.exists():
            try:
                existing = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise UserError(f"{path}: unreadable recording manifest: {exc}") from exc
            if existing != manifest:
                raise UserError(
                    f"{folder} holds a recording made with another salt, block size or "
                    "tokenizer, whose ids would not compare with these; record into a new "
                    "folder, or pass the same --record-salt-file and settings"
                )
            return
        try:
            path.write_text(json.dumps(manifest, indent=1) + "\n")
        except OSError as exc:
            raise UserError(f"{folder}: cannot write the recording manifest: {exc}") from exc

    def _run(self) -> None:
        while not self._stop.wait(self.DRAIN_EVERY_S):
            try:
                self._drain()
                segment = self._segment
                if len(segment) and (
                    len(segment) >= self.settings.rotate_requests
                    or time.monotonic() - segment.opened >= self.settings.rotate_s
                ):
                    self._write_segment()
            except Exception:  # the recording must never take the router down
                log.exception("recording writer failed; requests since the last segment lost")
                self.dropped += len(self._segment)
                self._segment = _Segment()

    def _drain(self) -> None:
        while self._pending:
            room = self.settings.rotate_requests - len(self._segment)
            self._add([self._pending.popleft() for _ in range(min(room, len(self._pending)))])
            if len(self._segment) >= self.settings.rotate_requests:
                self._write_segment()

    def _add(self, batch: list[RecordedRequest]) -> None:
        segment, salter = self._segment, self.salter
        rows, latest = segment.rows, segment.latest
        fresh = []
        for o in batch:
            conversation = salter.name(o.conversation)
            agent = conversation if o.agent is None else salter.name(o.agent)
            base, shared = latest.get(agent), 0
            if base is not None:
                shared = common_prefix_len(base[1], o.blocks)
            latest[agent] = (len(segment.lengths), o.blocks)
            fresh.append(o.blocks[shared:])
            segment.lengths.append(len(o.blocks) - shared)
            rows["base_row"].append(base[0] if base is not None and shared else None)
            rows["shared_blocks"].append(shared)
            rows["arrival_s"].append(o.arrival_s)
            rows["completion_s"].append(o.completion_s)
            rows["prompt_tokens"].append(o.prompt_tokens)
            rows["output_tokens"].append(o.output_tokens)
            rows["cached_tokens"].append(o.cached_tokens)
            rows["turn"].append(o.turn)
            rows["session"].append(conversation if o.session is None else salter.name(o.session))
            rows["agent"].append(agent)
            parent = o.parent_agent
            rows["parent_agent"].append(None if parent is None else salter.name(parent))
            rows["trigger"].append(o.trigger.value)
            rows["engine"].append(o.engine)
            rows["branch"].append(o.branch)
        segment.blocks.append(salter.block_ids(np.concatenate(fresh)))

    def _write_segment(self) -> None:
        segment, self._segment = self._segment, _Segment()
        if not len(segment):
            return
        folder = self.settings.folder
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self._sequence += 1
        name = f"requests-{stamp}-{os.getpid()}-{self._sequence:05d}.parquet"
        meta = {"salt_id": self.salter.salt_id, "dropped": self.dropped}
        frame = segment.frame()
        temporary = folder / f".{name}.tmp"
        try:
            self._prepare_folder()
            frame.write_parquet(
                temporary, compression="zstd", metadata={METADATA_KEY: json.dumps(meta)}
            )
            os.replace(temporary, folder / name)
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError):
                temporary.unlink()
            self.dropped += len(segment)
            event = {"event": "recording_segment_lost", "rows": len(segment), "reason": str(exc)}
            log.warning(json.dumps(event))
            return
        self.written += len(segment)
        self._enforce_bound()

    def _enforce_bound(self) -> None:
        """Oldest segments out until the folder is within ``max_bytes`` (every worker
        enforces it over all segments, so one may find another's file already gone)."""
        sizes = []
        for path in self.settings.folder.glob(SEGMENT_GLOB):
            with contextlib.suppress(FileNotFoundError):
                stat = path.stat()
                sizes.append((stat.st_mtime, path.name, stat.st_size, path))
        total = sum(size for _, _, size, _ in sizes)
        for _, _, size, path in sorted(sizes):
            if total <= self.settings.max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                log.info(json.dumps({"event": "recording_segment_deleted", "file": path.name}))
            total -= size
