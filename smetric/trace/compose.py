"""Turn a loaded trace into the request stream a cluster run issues.

Session traces such as WEKA's Claude Code captures have no global clock and no
cross-session block namespace, so a cluster workload is *composed*: sessions start by an
arrival process at a chosen rate, each drawn copy gets its own block ids (two users running
the same session do not share their KV cache, except for the framework's system prompt), and
turns are issued closed loop, each ``think_time_s`` after its parent completes. Completion
depends on the system under test, so the closed loop is driven by the simulator or the live
replayer through ``ClosedLoopIssuer``. Traces with a real clock can instead be replayed open
loop at their recorded arrival times with ``replay_arrivals``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from smetric.core.errors import UserError
from smetric.trace.schema import SCHEMA, Trace, common_prefix_len

ARRIVAL_PROCESSES = ("poisson", "uniform")

WORKLOAD_SCHEMA: dict[str, pl.DataType] = {
    **SCHEMA,
    # When the session copy this request belongs to starts on the run's clock.
    "session_start_s": pl.Float64(),
    # The row of the request in the trace it was drawn from.
    "source_request_id": pl.Int64(),
}

_INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class BlockIds:
    """A trace's block ids as one flat array, and how a session copy renames them.

    Copy ``c`` of a row has the row's ids shifted by ``c * span`` past its shared prefix:
    shifted ranges of different copy indices are disjoint, and within one copy index the
    trace's own id uniqueness holds, so copies never share a private block while the
    framework's shared prefix keeps its ids. The ids are made when a driver asks for a
    request's (``of_row``), never stored per copy: a day of traffic draws millions of
    requests of thousands of blocks each.
    """

    flat: np.ndarray
    offsets: np.ndarray
    # Leading blocks of each trace row that belong to the framework's shared prompt.
    shared: np.ndarray
    span: int

    @staticmethod
    def of(trace: Trace) -> BlockIds:
        flat, offsets = trace.block_arrays()
        low, high = (int(flat.min()), int(flat.max())) if len(flat) else (0, 0)
        shared = trace.requests["shared_prefix_blocks"].fill_null(0).to_numpy()
        return BlockIds(flat, offsets, shared, high - low + 1)

    def check_copies(self, copies: int) -> None:
        """Fail early when ``copies`` copies of the ids would overflow int64."""
        high = int(self.flat.max()) if len(self.flat) else 0
        top = copies - 1
        if top > 0 and (_INT64_MAX - high) // top < self.span:
            raise UserError(f"{copies} copies of block ids spanning {self.span} overflow int64")

    def common_prefix(self, a: int, b: int, copy: int) -> int:
        """Leading blocks that copy ``copy`` of rows ``a`` and ``b`` share.

        A copy shifts the same positions of both rows when their shared prefixes are
        equal, so then the trace's own ids answer without making the copy's.
        """
        if self.shared[a] == self.shared[b]:
            copy = 0
        return common_prefix_len(self.of_row(a, copy), self.of_row(b, copy))

    def of_row(self, row: int, copy: int) -> np.ndarray:
        """Block ids of copy ``copy`` of trace row ``row`` (copy 0: the trace's own)."""
        blocks = self.flat[self.offsets[row] : self.offsets[row + 1]]
        if copy:
            shift = copy * self.span
            blocks = blocks + shift
            blocks[: int(self.shared[row])] -= shift
        return blocks


@dataclass(frozen=True)
class Workload:
    """The requests of one run, in issue order of their sessions, with how to issue them.

    A request is a row of the trace (``source``) in a session copy (``copy``), so the
    workload holds a few numbers per request and refers to the trace for the rest;
    ``requests`` materialises the full table where a caller wants one.
    """

    trace: Trace
    # Trace row, session copy index, parent (workload id, -1 for a root) and the start of
    # the session copy, per request.
    source: np.ndarray
    copy: np.ndarray
    parent: np.ndarray
    session_start: np.ndarray
    # Open loop: every request is issued at its arrival. None: closed loop, requests after
    # a session's roots wait for their parent (ClosedLoopIssuer).
    arrival: np.ndarray | None
    seed: int | None
    # Session starts per second, for composed workloads.
    rate: float | None
    blocks: BlockIds

    @property
    def closed_loop(self) -> bool:
        return self.arrival is None

    @property
    def num_requests(self) -> int:
        return len(self.source)

    @property
    def num_sessions(self) -> int:
        sessions = self.trace.requests["session_id"].gather(self.source)
        return pl.DataFrame({"session": sessions, "copy": self.copy}).n_unique()

    def roots(self) -> np.ndarray:
        """Request ids that wait for no other request (one per session in WEKA traces)."""
        return np.flatnonzero(self.parent < 0)

    def block_ids(self, request_id: int) -> np.ndarray:
        return self.blocks.of_row(int(self.source[request_id]), int(self.copy[request_id]))

    @property
    def requests(self) -> pl.DataFrame:
        """Every request as a row of ``WORKLOAD_SCHEMA``, block ids included (built anew)."""
        blocks = [self.block_ids(rid) for rid in range(self.num_requests)]
        session = pl.col("session_id")
        if self.closed_loop:
            session = session + "#" + pl.Series(self.copy).cast(pl.String)
        arrival = pl.lit(None, dtype=pl.Float64) if self.arrival is None else self.arrival
        return (
            self.trace.requests.drop("block_ids")[self.source]
            .with_columns(
                request_id=pl.int_range(pl.len(), dtype=pl.Int64),
                session_id=session,
                parent_id=pl.when(pl.Series(self.parent) >= 0).then(pl.Series(self.parent)),
                # A closed loop's run decides issue times; a recorded clock would mislead.
                arrival_s=arrival,
                block_ids=pl.Series("block_ids", blocks, dtype=pl.List(pl.Int64())),
                session_start_s=pl.Series(self.session_start),
                source_request_id=pl.col("request_id"),
            )
            .select([pl.col(c).cast(t) for c, t in WORKLOAD_SCHEMA.items()])
        )


def compose_sessions(
    trace: Trace,
    *,
    rate: float,
    duration_s: float | None = None,
    num_sessions: int | None = None,
    seed: int = 0,
    arrival: str = "poisson",
) -> Workload:
    """Draw session copies from ``trace`` and start them at ``rate`` sessions per second.

    Start times and session picks use separate streams spawned from ``seed``, so changing
    the rate or the arrival process alters when sessions start but not which ones run.
    """
    layout, picks, starts = _draw(trace, rate, duration_s, num_sessions, seed, arrival)
    source, copy_of_row, copy_base = _rows_of(layout, picks)
    copies = copy_indices(picks)
    blocks = BlockIds.of(trace)
    blocks.check_copies(int(copies.max()) + 1)
    return Workload(
        trace=trace,
        source=source,
        copy=copies[copy_of_row],
        parent=_remap_parents(trace.requests, layout, source, copy_base[copy_of_row]),
        session_start=starts[copy_of_row],
        arrival=None,
        seed=seed,
        rate=rate,
        blocks=blocks,
    )


def session_schedule(
    trace: Trace,
    *,
    rate: float,
    duration_s: float | None = None,
    num_sessions: int | None = None,
    seed: int = 0,
    arrival: str = "poisson",
) -> tuple[np.ndarray, np.ndarray]:
    """The trace row behind each request of ``compose_sessions`` and its session's start.

    The same draw without copying block ids, for studies that need only the timing.
    """
    layout, picks, starts = _draw(trace, rate, duration_s, num_sessions, seed, arrival)
    source, copy_of_row, _ = _rows_of(layout, picks)
    return source, starts[copy_of_row]


def _draw(
    trace: Trace,
    rate: float,
    duration_s: float | None,
    num_sessions: int | None,
    seed: int,
    arrival: str,
) -> tuple[_SessionLayout, np.ndarray, np.ndarray]:
    if not rate > 0:
        raise UserError(f"rate must be > 0 sessions/s, got {rate}")
    if trace.num_requests == 0:
        raise UserError(f"trace {trace.name!r} has no requests to compose sessions from")
    start_rng, pick_rng = np.random.default_rng(seed).spawn(2)
    starts = session_starts(
        start_rng, rate=rate, arrival=arrival, duration_s=duration_s, num_sessions=num_sessions
    )
    layout = _SessionLayout.of(trace.requests)
    picks = draw_sessions(pick_rng, available=layout.num_sessions, needed=len(starts))
    return layout, picks, starts


def session_starts(
    rng: np.random.Generator,
    *,
    rate: float,
    arrival: str,
    duration_s: float | None,
    num_sessions: int | None,
) -> np.ndarray:
    """Start times of the session copies; the first starts at 0 so a run has no idle head."""
    if arrival not in ARRIVAL_PROCESSES:
        raise UserError(f"arrival must be one of {ARRIVAL_PROCESSES}, got {arrival!r}")
    if (duration_s is None) == (num_sessions is None):
        raise UserError(
            "give exactly one of duration_s (start sessions until then) or "
            "num_sessions (start that many sessions)"
        )
    if num_sessions is not None:
        if num_sessions < 1:
            raise UserError(f"num_sessions must be >= 1, got {num_sessions}")
        return _starts(rng, rate, arrival, num_sessions)
    assert duration_s is not None
    if not duration_s > 0:
        raise UserError(f"duration_s must be > 0, got {duration_s}")
    expected = rate * duration_s
    count = int(expected + 6 * np.sqrt(expected)) + 16
    starts = _starts(rng, rate, arrival, count)
    while starts[-1] < duration_s:
        # Rare for a Poisson count to exceed its mean by 6 sigma; draw the rest on.
        more = _starts(rng, rate, arrival, count + 1)[1:] + starts[-1]
        starts = np.concatenate([starts, more])
    return starts[starts < duration_s]


def _starts(rng: np.random.Generator, rate: float, arrival: str, count: int) -> np.ndarray:
    if arrival == "uniform":
        return np.arange(count, dtype=np.float64) / rate
    starts = np.zeros(count, dtype=np.float64)
    np.cumsum(rng.exponential(1.0 / rate, count - 1), out=starts[1:])
    return starts


def draw_sessions(rng: np.random.Generator, *, available: int, needed: int) -> np.ndarray:
    """Session indices for the copies: distinct while the trace suffices, then every
    session once and the remainder with replacement, so no session is over-represented
    by chance before all have been used."""
    if needed <= available:
        return rng.permutation(available)[:needed]
    extra = rng.integers(0, available, needed - available)
    return np.concatenate([rng.permutation(available), extra])


def copy_indices(picks: np.ndarray) -> np.ndarray:
    """For each pick, how many earlier picks chose the same session (0 for the first)."""
    order = np.argsort(picks, kind="stable")
    ranked = picks[order]
    firsts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    sizes = np.diff(np.r_[firsts, len(picks)])
    copies = np.empty(len(picks), dtype=np.int64)
    copies[order] = np.arange(len(picks)) - np.repeat(firsts, sizes)
    return copies


@dataclass(frozen=True)
class _SessionLayout:
    """Trace rows grouped by session (CSR), so a session's rows are one slice."""

    # Session index of each trace row (lexicographic order of session ids).
    session_of_row: np.ndarray
    # Trace rows grouped by session, original order within each session.
    rows: np.ndarray
    # rows[offsets[s]:offsets[s + 1]] are session s's rows.
    offsets: np.ndarray
    # Position of each trace row within its session.
    position: np.ndarray

    @property
    def num_sessions(self) -> int:
        return len(self.offsets) - 1

    @staticmethod
    def of(requests: pl.DataFrame) -> _SessionLayout:
        ids = requests["request_id"].to_numpy()
        if not np.array_equal(ids, np.arange(len(ids))):
            raise ValueError("request_id must number the rows 0..n-1 in order (see finalize)")
        if requests["session_id"].null_count():
            raise UserError("every request needs a session_id to compose sessions")
        session_of_row = (requests["session_id"].rank("dense") - 1).to_numpy().astype(np.int64)
        rows = np.argsort(session_of_row, kind="stable")
        sizes = np.bincount(session_of_row)
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        position = np.empty(len(rows), dtype=np.int64)
        position[rows] = np.arange(len(rows)) - np.repeat(offsets[:-1], sizes)
        return _SessionLayout(session_of_row, rows, offsets, position)


def _rows_of(
    layout: _SessionLayout, picks: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Trace row, copy index and the copy's first workload row, for every workload row."""
    sizes = np.diff(layout.offsets)[picks]
    copy_of_row = np.repeat(np.arange(len(picks)), sizes)
    copy_base = np.zeros(len(picks), dtype=np.int64)
    np.cumsum(sizes[:-1], out=copy_base[1:])
    position = np.arange(int(sizes.sum())) - copy_base[copy_of_row]
    source = layout.rows[layout.offsets[picks][copy_of_row] + position]
    return source, copy_of_row, copy_base


def _remap_parents(
    requests: pl.DataFrame, layout: _SessionLayout, source: np.ndarray, base: np.ndarray
) -> np.ndarray:
    """Workload id of each row's parent (-1 for roots): the same copy, same position."""
    parent = requests["parent_id"].fill_null(-1).to_numpy()[source]
    has = parent >= 0
    parent_row = np.where(has, parent, 0)
    outside = has & (layout.session_of_row[parent_row] != layout.session_of_row[source])
    if outside.any():
        first = int(np.argmax(outside))
        raise UserError(
            f"request {source[first]} has parent {parent[first]} in another session; "
            "a session copy must be self-contained"
        )
    return np.where(has, base + layout.position[parent_row], -1)


class ClosedLoopIssuer:
    """Releases each request when its parent completes, plus its think time.

    Drivers (simulator, live replayer) own completion; this only tracks the dependency
    graph, indexed once so that each completion costs O(children).
    """

    def __init__(self, workload: Workload) -> None:
        if not workload.closed_loop:
            raise ValueError("open-loop workloads are issued at arrival_s, not by completion")
        trace = workload.trace.requests
        source = workload.source
        self._parent = workload.parent
        self._think = trace["think_time_s"].fill_null(0.0).to_numpy()[source]
        session_time = trace["session_time_s"].fill_null(0.0).to_numpy()[source]
        self._root_time = workload.session_start + session_time
        kids = np.flatnonzero(self._parent >= 0)
        self._children = kids[np.argsort(self._parent[kids], kind="stable")]
        self._child_offsets = np.zeros(len(self._parent) + 1, dtype=np.int64)
        np.cumsum(
            np.bincount(self._parent[kids], minlength=len(self._parent)),
            out=self._child_offsets[1:],
        )
        self._issued_at = np.full(len(self._parent), np.nan)
        self._completed = np.zeros(len(self._parent), dtype=bool)
        self._num_completed = 0

    def initial(self) -> list[tuple[float, int]]:
        """(issue time, request id) of every root: its session's start + its session time."""
        roots = np.flatnonzero(self._parent < 0)
        if not np.isnan(self._issued_at[roots]).all():
            raise RuntimeError("initial() was already called")
        return self._issue(roots, self._root_time[roots])

    def complete(self, request_id: int, t: float) -> list[tuple[float, int]]:
        """Record that ``request_id`` finished at ``t``; return the children it releases."""
        issued = self._issued_at[request_id]
        if np.isnan(issued):
            raise ValueError(f"request {request_id} completed before it was issued")
        if self._completed[request_id]:
            raise ValueError(f"request {request_id} completed twice")
        if t < issued:
            raise ValueError(f"request {request_id} completed at {t} before its issue at {issued}")
        self._completed[request_id] = True
        self._num_completed += 1
        kids = self._children[self._child_offsets[request_id] : self._child_offsets[request_id + 1]]
        return self._issue(kids, t + self._think[kids])

    @property
    def done(self) -> bool:
        return self._num_completed == len(self._parent)

    def _issue(self, ids: np.ndarray, times: np.ndarray) -> list[tuple[float, int]]:
        self._issued_at[ids] = times
        return sorted(zip(times.tolist(), ids.tolist(), strict=True))


def replay_arrivals(trace: Trace, *, speed: float = 1.0, limit_s: float | None = None) -> Workload:
    """Open-loop replay at the recorded arrival times, compressed ``speed`` times.

    Only the clock is scaled; recorded think and session times stay as recorded.
    ``limit_s`` cuts the replay at that time on the scaled clock.
    """
    if not trace.has_clock:
        raise UserError(
            f"trace {trace.name!r} ({trace.source_format}) has no global clock, so its "
            "arrival times cannot be replayed; compose a workload with compose_sessions()"
        )
    if not speed > 0:
        raise UserError(f"speed must be > 0, got {speed}")
    if limit_s is not None and not limit_s > 0:
        raise UserError(f"limit_s must be > 0, got {limit_s}")
    if trace.requests["arrival_s"].null_count():
        raise UserError(f"trace {trace.name!r} has requests without arrival_s")
    frame = trace.requests.select(
        "session_id",
        "parent_id",
        arrival_s=pl.col("arrival_s") / speed,
        source=pl.col("request_id"),
    )
    if limit_s is not None:
        frame = frame.filter(pl.col("arrival_s") < limit_s)
    frame = frame.sort("arrival_s", "source")
    old_ids = frame["source"]
    new_ids = pl.int_range(frame.height, dtype=pl.Int64, eager=True)
    frame = frame.with_columns(
        parent_id=pl.col("parent_id").replace_strict(old_ids, new_ids, default=None),
        session_start_s=pl.col("arrival_s").min().over("session_id"),
    )
    return Workload(
        trace=trace,
        source=frame["source"].to_numpy(),
        copy=np.zeros(frame.height, dtype=np.int64),
        parent=frame["parent_id"].fill_null(-1).to_numpy(),
        session_start=frame["session_start_s"].to_numpy(),
        arrival=frame["arrival_s"].to_numpy(),
        seed=None,
        rate=None,
        blocks=BlockIds.of(trace),
    )


def open_loop_issue_times(workload: Workload) -> np.ndarray:
    """Issue time of every request of an open-loop workload, indexed by request_id."""
    if workload.closed_loop:
        raise ValueError(
            "a closed-loop workload has no fixed issue times; drive it with ClosedLoopIssuer"
        )
    assert workload.arrival is not None
    return workload.arrival
