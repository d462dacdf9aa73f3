"""``smetric replay``: a trace's sessions against any OpenAI-compatible endpoint, measured.

The sessions are composed closed loop as the simulator composes them (or, for a trace with
a clock, every request is sent at its recorded arrival time), and their text is
synthesised as ``smetric demo`` does (``filler``): equal content gives equal prompt blocks,
and each follow-up carries the conversation as it happened, the endpoint's answers
included, so prefix caching works as it would for a real agent. Requests stream so that
TTFT is measured at the first content chunk, and outputs are forced to the trace's length
(``max_tokens`` with ``ignore_eos``) so decode load matches the trace whatever the model
says. The results use the simulator's per-request columns and ``summarize``, so simulated
and measured runs compare side by side.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import aiohttp
import numpy as np
import polars as pl

from smetric.core.block_memo import BlockMemo
from smetric.core.blocks import Tokenizer
from smetric.core.conversation import ChatTemplate, analyze_request
from smetric.core.errors import UserError
from smetric.core.headers import (
    DECODE_HEADER,
    ENGINE_HEADER,
    PREDICTED_HIT_HEADER,
    PREFILL_CACHED_HEADER,
    PREFILL_HEADER,
    PREFILL_SECONDS_HEADER,
)
from smetric.metrics.pd import disaggregated_summary, with_prefill_latency
from smetric.metrics.runs import run_file_name
from smetric.metrics.slo import SLOConfig
from smetric.metrics.summary import WINDOW_S, summarize, with_latencies
from smetric.trace.compose import ClosedLoopIssuer, compose_sessions, replay_arrivals
from smetric.trace.sample import sample_sessions
from smetric.trace.schema import Trace, common_prefix_len, finalize

_WORDS = ("read", "file", "grep", "test", "patch", "build", "diff", "log", "run", "fix")


def filler(seed: str, tokens: int) -> str:
    """Deterministic text of about ``tokens`` bytes, different per seed."""
    digest = hashlib.blake2b(seed.encode(), digest_size=8).digest()
    words = [_WORDS[(b + i) % len(_WORDS)] for i, b in enumerate(digest * (tokens // 40 + 1))]
    return (" ".join(words) + " ")[: max(tokens, 1)]


MIN_CHUNK = 16


def next_conversation(
    session: str,
    turn: int,
    trace_tokens: int,
    history: list[dict] | None,
    token_scale: float,
) -> list[dict]:
    """The messages a synthetic agent sends: its history as it happened, plus new content
    that brings the prompt to the trace's size (scaled), deterministic per session and turn.

    Tool output goes back as a user turn: strict OpenAI servers (sglang-router, for one)
    reject a ``tool`` message without the ``tool_call_id`` of a real tool call.
    """
    scaled = max(int(trace_tokens / token_scale), MIN_CHUNK)
    if history is None:
        system = {"role": "system", "content": filler("system-prompt", scaled // 3)}
        task = {"role": "user", "content": filler(f"{session}/task", scaled - scaled // 3)}
        return [system, task]
    grown = max(scaled - sum(len(m["content"]) for m in history), MIN_CHUNK)
    return [*history, {"role": "user", "content": filler(f"{session}/{turn}", grown)}]


def scaled_output(trace_tokens: int, token_scale: float) -> int:
    """The ``max_tokens`` a replay asks for a trace output of ``trace_tokens``."""
    return max(round(trace_tokens / token_scale), 1)


def replayed_trace(
    trace: Trace,
    token_scale: float,
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
    block_size: int,
    max_model_len: int,
) -> Trace:
    """``trace`` as ``Replayer`` sends it at ``token_scale`` to engines that tokenise with
    ``tokenizer`` and ``template``: so that the simulator can run what a replay measured.

    A row's prompt is the conversation a replayed session sends for it (``next_conversation``
    over its parent's messages and answer), rendered and cut into ``block_size`` blocks as
    the router cuts it, so its length is the engine's prompt tokens and its block ids share
    exactly what the replayed prompts share: a session's history, and the leading blocks of
    the common system prompt across sessions (its ``shared_prefix_blocks``, which every
    session copy keeps). An answer is stood in for by filler text of the scaled output's
    length in tokens (the engine's real answer differs in text, not in length). Outputs are
    scaled as ``max_tokens`` is. A request the engines refuse (prompt and output over
    ``max_model_len``) stays, and its descendants go: a replayed session stops there.
    """
    rows = trace.requests.select(
        "session_id", "parent_id", "input_tokens", "output_tokens", "turn"
    ).rows()
    probe = filler("probe", 4000)
    chars_per_token = len(probe) / max(len(tokenizer.encode(probe)), 1)
    # Two copies of every session: what their renderings share, every copy shares.
    sent: tuple[dict[int, list[dict[str, str]]], ...] = ({}, {})
    outputs: list[int] = []
    prompts: list[int] = []
    blocks: list[list[int]] = []
    shared: list[int] = []
    keep: list[bool] = []
    dense: dict[int, int] = {}
    # Each follow-up resends its history: the memo encodes a segment once, as a router does.
    memo = BlockMemo(tokenizer, block_size)
    for rid, (session, parent, tokens, output, turn) in enumerate(rows):
        outputs.append(scaled_output(output, token_scale))
        keep.append(
            parent is None or (keep[parent] and prompts[parent] + outputs[parent] <= max_model_len)
        )
        facts = []
        for copy, messages in enumerate(sent):
            name = f"{session}#{copy}"
            history = None
            if parent is not None:
                answer = filler(f"{name}/{parent}/answer", round(outputs[parent] * chars_per_token))
                history = [*messages[parent], {"role": "assistant", "content": answer}]
            messages[rid] = next_conversation(name, turn, tokens, history, token_scale)
            body = {"messages": messages[rid]}
            facts.append(analyze_request(body, "chat", tokenizer, block_size, template, memo))
        prompts.append(facts[0].prompt_tokens)
        blocks.append([dense.setdefault(int(h), len(dense)) for h in facts[0].blocks])
        shared.append(common_prefix_len(facts[0].blocks, facts[1].blocks))
    kept = np.flatnonzero(keep)
    renumbered = np.full(len(rows), -1, dtype=np.int64)
    renumbered[kept] = np.arange(len(kept))
    parents = trace.requests["parent_id"].fill_null(-1).to_numpy()[kept]
    frame = trace.requests[kept].with_columns(
        request_id=pl.Series(np.arange(len(kept))),
        parent_id=pl.Series(np.where(parents >= 0, renumbered[parents], -1)),
        input_tokens=pl.Series(np.array(prompts)[kept]),
        output_tokens=pl.Series(np.array(outputs)[kept]),
        block_size=pl.lit(block_size),
        block_ids=pl.Series([blocks[i] for i in kept], dtype=pl.List(pl.Int64())),
        shared_prefix_blocks=pl.Series(np.array(shared)[kept]),
    )
    note = f"prompts as replayed with tokens / {token_scale:g}, {tokenizer.name} tokens"
    frame = frame.with_columns(parent_id=pl.when(pl.col("parent_id") >= 0).then("parent_id"))
    return replace(trace, requests=finalize(frame), notes=(*trace.notes, note))


# The simulator's per-request columns (``request_table``), with their types.
REQUEST_SCHEMA: dict[str, pl.DataType] = {
    "request_id": pl.Int64(),
    "session_id": pl.String(),
    "turn": pl.Int64(),
    "instance": pl.Int64(),
    "branch": pl.String(),
    "rejected": pl.Boolean(),
    "arrival_s": pl.Float64(),
    "first_token_s": pl.Float64(),
    "finished_s": pl.Float64(),
    "prompt_tokens": pl.Int64(),
    "output_tokens": pl.Int64(),
    "est_hit_tokens": pl.Int64(),
    "local_hit_tokens": pl.Int64(),
    "global_hit_tokens": pl.Int64(),
    "preemptions": pl.Int64(),
}


class ReplayError(UserError):
    """The endpoint cannot be replayed against; reported as a user error."""


@dataclass(frozen=True)
class ReplayOptions:
    url: str
    rate: float = 1.0
    duration_s: float = 60.0
    # Trace seconds per replay second, and trace tokens per prompt byte (or token).
    time_scale: float = 1.0
    token_scale: float = 1.0
    concurrency: int = 256
    # closed-loop: sessions composed at ``rate``, each turn its think time after its parent
    # ends; recorded: every request at the trace's own arrival time (traces with a clock).
    arrivals: Literal["closed-loop", "recorded"] = "closed-loop"
    # Recorded arrivals: the seeded fraction of sessions kept (the paper's load scaling).
    sample: float = 1.0
    seed: int = 0
    # None: the first model the endpoint lists.
    model: str | None = None


@dataclass
class Measured:
    """One request as the client saw it; times in seconds since the replay started."""

    request_id: int
    session_id: str
    turn: int
    arrival_s: float
    prompt_tokens: int
    engine: str | None = None
    rejected: bool = False
    first_token_s: float | None = None
    finished_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    # What an SMetric router expected the engine to have cached (its response header).
    predicted_hit_tokens: int | None = None
    # Behind a disaggregating SMetric router: the decode engine, how long the prefill leg
    # took and what the prefill engine found cached (its response headers).
    decode_engine: str | None = None
    prefill_s: float | None = None
    prefill_cached_tokens: int = 0


@dataclass
class Progress:
    elapsed_s: float = 0.0
    sent: int = 0
    completed: int = 0
    failed: int = 0


class Replayer:
    """Drives the sessions and keeps every measurement, so an interrupted run still reports.

    A request goes out its (scaled) think time after its parent finished, or with recorded
    arrivals at its (scaled) arrival time, once a concurrency slot is free; the run stops
    at the duration and cancels what is in flight, which then counts as unfinished, as
    requests still running at the simulator's horizon.
    """

    def __init__(self, trace: Trace, options: ReplayOptions) -> None:
        if options.concurrency < 1:
            raise UserError(f"concurrency must be at least 1, got {options.concurrency}")
        if not (options.time_scale > 0 and options.token_scale > 0):
            raise UserError("time and token scales must be > 0")
        self.options = options
        self.base = options.url.rstrip("/")
        if options.arrivals not in ("closed-loop", "recorded"):
            raise UserError(f"arrivals must be 'closed-loop' or 'recorded': {options.arrivals!r}")
        if options.arrivals == "closed-loop" and options.sample != 1.0:
            raise UserError(
                "--sample scales recorded arrivals (--arrivals recorded); "
                "closed-loop load is set by --rate"
            )
        horizon = options.duration_s * options.time_scale
        self.issuer: ClosedLoopIssuer | None = None
        if options.arrivals == "recorded":
            try:
                sampled = sample_sessions(trace, options.sample, options.seed)
                self.workload = replay_arrivals(sampled, limit_s=horizon)
            except ValueError as exc:
                raise ReplayError(str(exc)) from exc
        else:
            self.workload = compose_sessions(
                trace, rate=options.rate / options.time_scale, duration_s=horizon, seed=options.seed
            )
            self.issuer = ClosedLoopIssuer(self.workload)
        columns = ("session_id", "parent_id", "input_tokens", "output_tokens", "turn")
        self.rows = self.workload.requests.select(*columns).rows()
        # What each request sent, and the endpoint's answer once it has one: a follow-up's
        # history is its parent's messages plus that answer.
        self.sent: dict[int, list[dict[str, str]]] = {}
        self.answers: dict[int, str] = {}
        self.records: dict[int, Measured] = {}
        self.engines: dict[str, int] = {}
        self.decoders: dict[str, int] = {}
        self.progress = Progress()
        self.tasks: set[asyncio.Task] = set()
        self.model: str | None = options.model
        self.horizon_s = options.duration_s
        self.t0 = time.monotonic()
        self._slots = asyncio.Semaphore(options.concurrency)

    async def run(self, on_tick: Callable[[Progress], None] | None = None) -> None:
        """Replay for the duration; cancelled (Ctrl-C), it keeps what it measured so far."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        connector = aiohttp.TCPConnector(limit=self.options.concurrency)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as client:
            await self._probe(client)
            self.t0 = time.monotonic()
            if self.issuer is None:
                for rid, at in enumerate(self.workload.requests["arrival_s"]):
                    self._schedule(client, at, rid)
            else:
                for at, rid in self.issuer.initial():
                    self._schedule(client, at, rid)
            try:
                while self._now() < self.options.duration_s:
                    self.progress.elapsed_s = self._now()
                    if on_tick:
                        on_tick(self.progress)
                    await asyncio.sleep(0.1)
            except asyncio.CancelledError:
                self.horizon_s = min(self._now(), self.options.duration_s)
                raise
            finally:
                for task in self.tasks:
                    task.cancel()
                await asyncio.gather(*self.tasks, return_exceptions=True)
                self.progress.elapsed_s = self.horizon_s
                if on_tick:
                    on_tick(self.progress)

    async def _probe(self, client: aiohttp.ClientSession) -> None:
        """Fail before the clock starts if the endpoint is down, and learn its model."""
        try:
            async with client.get(
                self.base + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)
            ) as reply:
                data = await reply.json(content_type=None) if reply.status == 200 else {}
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise ReplayError(f"cannot reach {self.base}: {exc}") from exc
        except ValueError:
            data = {}
        if self.model is None:
            listed = data.get("data") if isinstance(data, dict) else None
            if listed and isinstance(listed[0], dict):
                self.model = listed[0].get("id")

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _schedule(self, client: aiohttp.ClientSession, at_trace_s: float, rid: int) -> None:
        at = at_trace_s / self.options.time_scale
        if at > self.options.duration_s:
            return
        task = asyncio.create_task(self._send(client, rid, max(at - self._now(), 0.0)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _conversation(self, rid: int) -> list[dict[str, str]]:
        session, parent, tokens, _, turn = self.rows[rid]
        history = None
        if parent in self.sent:
            answer = self.answers.get(parent)
            if answer is None:
                # Open loop, the parent still running (or failed): an agent would have
                # waited, a recorded arrival does not, so a stand-in of its length answers.
                answer = filler(f"{session}/{parent}/answer", self._output(parent))
            history = [*self.sent[parent], {"role": "assistant", "content": answer}]
        return next_conversation(session, turn, tokens, history, self.options.token_scale)

    def _output(self, rid: int) -> int:
        return scaled_output(self.rows[rid][3], self.options.token_scale)

    async def _send(self, client: aiohttp.ClientSession, rid: int, delay: float) -> None:
        await asyncio.sleep(delay)
        session, _, _, _, turn = self.rows[rid]
        messages = self._conversation(rid)
        self.sent[rid] = messages
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": self._output(rid),
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        async with self._slots:
            record = Measured(
                rid,
                session,
                turn,
                self._now(),
                prompt_tokens=sum(len(m["content"]) for m in messages),
            )
            self.records[rid] = record
            self.progress.sent += 1
            try:
                answer = await self._stream(client, body, record)
            except (aiohttp.ClientError, ValueError):
                answer = None
            if answer is None:
                record.rejected = record.finished_s is None
                self.progress.failed += 1
                return
        self.progress.completed += 1
        self.answers[rid] = answer
        if self.issuer is None:
            return  # open loop: every request is already scheduled at its arrival
        assert record.finished_s is not None  # _stream stamps every answer's finish
        now_trace = record.finished_s * self.options.time_scale
        for at, child in self.issuer.complete(rid, now_trace):
            self._schedule(client, at, child)

    async def _stream(
        self, client: aiohttp.ClientSession, body: dict[str, Any], record: Measured
    ) -> str | None:
        """The answer's text, or None when the endpoint refused the request."""
        async with client.post(self.base + "/v1/chat/completions", json=body) as reply:
            engine = reply.headers.get(ENGINE_HEADER, "")
            if reply.status != 200:
                await reply.read()
                return None
            record.engine = engine
            if PREFILL_HEADER in reply.headers:
                self._disaggregated(record, reply.headers)
            if PREDICTED_HIT_HEADER in reply.headers:
                record.predicted_hit_tokens = int(reply.headers[PREDICTED_HIT_HEADER])
            self.engines.setdefault(record.engine, len(self.engines))
            parts: list[str] = []
            usage: dict[str, Any] = {}
            async for line in reply.content:
                data = line.strip()
                if not data.startswith(b"data:"):
                    continue
                data = data[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text and record.first_token_s is None:
                        record.first_token_s = self._now()
                    parts.append(text)
                usage = chunk.get("usage") or usage
        record.finished_s = self._now()
        if record.first_token_s is None:
            record.first_token_s = record.finished_s
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        record.output_tokens = usage.get("completion_tokens", sum(1 for p in parts if p))
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = details.get("cached_tokens") or 0
        return "".join(parts)

    def _disaggregated(self, record: Measured, headers: Any) -> None:
        """The prefill engine is where the request was routed; the decode engine apart."""
        record.engine = headers[PREFILL_HEADER]
        record.decode_engine = headers.get(DECODE_HEADER)
        if record.decode_engine is not None:
            self.decoders.setdefault(record.decode_engine, len(self.decoders))
        if PREFILL_SECONDS_HEADER in headers:
            record.prefill_s = float(headers[PREFILL_SECONDS_HEADER])
        record.prefill_cached_tokens = int(headers.get(PREFILL_CACHED_HEADER, 0))

    def table(self) -> pl.DataFrame:
        """What was measured, in the simulator's columns, for requests sent by the horizon."""
        sent = sorted(
            (r for r in self.records.values() if r.arrival_s <= self.horizon_s),
            key=lambda r: r.request_id,
        )
        disaggregated = bool(self.decoders)
        table = pl.DataFrame(
            {
                "request_id": [r.request_id for r in sent],
                "session_id": [r.session_id for r in sent],
                "turn": [r.turn for r in sent],
                "instance": [-1 if r.engine is None else self.engines[r.engine] for r in sent],
                "branch": ["" for _ in sent],
                "rejected": [r.rejected for r in sent],
                "arrival_s": [r.arrival_s for r in sent],
                "first_token_s": [r.first_token_s for r in sent],
                "finished_s": [r.finished_s for r in sent],
                "prompt_tokens": [r.prompt_tokens for r in sent],
                "output_tokens": [r.output_tokens for r in sent],
                "est_hit_tokens": [0 for _ in sent],
                "local_hit_tokens": [
                    r.prefill_cached_tokens if disaggregated else r.cached_tokens for r in sent
                ],
                "global_hit_tokens": [0 for _ in sent],
                "preemptions": [0 for _ in sent],
            },
            schema=REQUEST_SCHEMA,
        )
        if not disaggregated:
            return table
        # The prefill's end as the router saw it; the decode's reported hit is the pull.
        return table.with_columns(
            prefill_done_s=pl.Series(
                [None if r.prefill_s is None else r.arrival_s + r.prefill_s for r in sent],
                dtype=pl.Float64,
            ),
            decode_instance=pl.Series(
                [self.decoders.get(r.decode_engine or "", -1) for r in sent], dtype=pl.Int64
            ),
            transfer_tokens=pl.Series(
                [r.cached_tokens if r.decode_engine else 0 for r in sent], dtype=pl.Int64
            ),
        )

    def results(self, slo: SLOConfig | None = None) -> tuple[pl.DataFrame, dict]:
        """The per-request table with latencies and its summary, as a simulated run has.

        Imbalance windows are the simulator's, in replay seconds, so that a time-scaled
        replay measures over the same stretch of trace time as its simulation.
        """
        slo = slo or SLOConfig()
        horizon = max(self.horizon_s, 1e-9)
        table = with_latencies(self.table(), slo, horizon)
        window = WINDOW_S / self.options.time_scale
        if self.decoders:
            table = with_prefill_latency(table, slo, horizon)
            instances = max(len(self.engines), 1)
            return table, disaggregated_summary(table, slo, horizon, instances, True, window)
        summary = summarize(table, slo, horizon, max(len(self.engines), 1), window)
        return table, summary

    def write(self, out: Path) -> dict:
        """``requests-replay.parquet`` and ``summary.json``, laid out as ``simulate`` writes."""
        table, summary = self.results()
        out.mkdir(parents=True, exist_ok=True)
        table.write_parquet(out / run_file_name("replay"))
        meta = {
            "endpoint": self.base,
            "model": self.model,
            "engines": list(self.engines),
            "decode_engines": list(self.decoders),
            "options": {k: v for k, v in vars(self.options).items() if k != "url"},
            "policies": {"replay": summary},
        }
        (out / "summary.json").write_text(json.dumps(meta, indent=1))
        return summary
