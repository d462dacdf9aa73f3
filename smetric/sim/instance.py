"""One simulated vLLM-V1-like instance: continuous batching with chunked prefill.

Each engine step serves every decoding sequence one token and spends the rest of a token
budget on prompt chunks, running requests first, then waiting ones in arrival order
(admitted while sequence slots and KV blocks last; a request that does not fit blocks
the queue, as in vLLM). A decode that needs a block when none is free preempts the most
recently admitted request, which later recomputes. The step's duration comes from the
step-time model.

The global tier is read the way vLLM's scheduler reads an external KV store through its
KV connector (LMCache in the paper's testbed). When the scheduler admits a waiting
request (``Scheduler.schedule``), it takes the local prefix hit (``get_computed_blocks``)
and asks the connector how many further tokens the store holds
(``KVConnectorBase_V1.get_num_new_matched_tokens``), so a request that waited, or was
preempted and comes back, finds what the tiers hold at that moment. The connector then
loads them either synchronously, before the forward pass that first computes the
request (``start_load_kv`` / ``wait_for_layer_load``), which stretches that whole step,
or asynchronously (the connector answers ``load_kv_async``): the request holds its
blocks in ``WAITING_FOR_REMOTE_KVS`` and joins the batch once the load lands, while the
batch runs on. LMCache loads synchronously unless ``enable_async_loading`` is set.

Per-step work follows what changed, not the batch size: decode progress is implicit in
the step counter, and heaps keyed by step index say when a sequence finishes or needs
its next KV block.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from smetric.core.blocks import reusable_hit_blocks, reusable_hit_tokens
from smetric.core.prefix_cache import Handle
from smetric.model.kv import GlobalTier, LocalPool, Route
from smetric.model.perf import StepTimeModel

# Longest run of decode-only steps planned at once, so that progress stays visible.
MAX_RUN_STEPS = 4096


@dataclass(slots=True, eq=False)
class SimRequest:
    rid: int
    session: str
    turn: int
    blocks: np.ndarray
    prompt: int
    output: int
    est_hit: int
    block_size: int
    arrival: float = 0.0
    # The conversation (session's agent or sub-agent) and the previous turn's request id.
    agent: str = ""
    parent: int = -1
    instance: int = -1
    branch: str = ""
    rejected: bool = False
    # Asynchronous global-tier load under way: it holds its blocks until ``ready_at``.
    loading: bool = False
    ready_at: float = 0.0
    local_hit: int = 0
    global_hit: int = 0
    # Tokens that must be in KV before the next token (the prompt, plus the output kept
    # across a preemption) and how many are; the part not yet prefilled, as counted in
    # the instance's load.
    target: int = 0
    done: int = 0
    pending: int = 0
    generated: int = 0
    # KV blocks: pinned in the prefix tree, and private to this request.
    pinned_blocks: int = 0
    private_blocks: int = 0
    handle: Handle | None = None
    decoding: bool = False
    decode_start: int = 0
    epoch: int = 0
    preemptions: int = 0
    first_token_at: float = math.nan
    finished_at: float = math.nan
    # What the router saw, for the policy to learn from (an ``Observation``): the local
    # hit it predicted and the unprefilled tokens queued where it routed, and at the first
    # token the prompt tokens in flight there and the unprefilled tokens ever routed there.
    seen_local_hit: int = 0
    seen_queued: float = 0.0
    first_token_tokens: int = 0
    first_token_routed: int = 0

    def leg(self, output: int, est_hit: int, instance: int) -> SimRequest:
        """A fresh request for this one's prompt, run on ``instance`` as one leg of a
        disaggregated request (the prefill's, asking for one token; the decode's): the
        same identity and prompt, none of this one's progress."""
        return SimRequest(
            self.rid, self.session, self.turn, self.blocks, self.prompt, output, est_hit,
            self.block_size, arrival=self.arrival, instance=instance,
        )  # fmt: skip


@dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_bytes_per_token: int = 98_304


@dataclass
class Instance:
    index: int
    pool: LocalPool
    tier_route: Route
    global_tier: GlobalTier
    perf: StepTimeModel
    limits: EngineLimits
    # Global-tier loads: False stretches the admitting step, True holds only the request.
    async_load: bool = False
    waiting: deque[SimRequest] = field(default_factory=deque)
    running: dict[int, SimRequest] = field(default_factory=dict)
    prefilling: list[SimRequest] = field(default_factory=list)
    decode_seqs: int = 0
    # Sum of the decoding sequences' KV lengths at the last step's end.
    decode_context: int = 0
    step_index: int = 0
    finish_heap: list[tuple[int, int, int, SimRequest]] = field(default_factory=list)
    block_heap: list[tuple[int, int, int, SimRequest]] = field(default_factory=list)
    # Load as the router sees it: requests in flight, their prompt tokens, and prompt
    # tokens not yet prefilled.
    inflight: int = 0
    inflight_tokens: int = 0
    unprefilled: int = 0
    # Unprefilled tokens of every request routed here so far, as the router counts them.
    routed_unprefilled: int = 0
    busy: bool = False
    busy_time: float = 0.0
    chunks: list[tuple[SimRequest, int]] = field(default_factory=list)
    # The planned run of steps: when it started, how many steps, each how long.
    run_start: float = 0.0
    run_steps: int = 0
    run_step_s: float = 0.0
    # When the synchronous loads of the step being planned have landed.
    load_until: float = 0.0

    def enqueue(self, req: SimRequest, now: float) -> None:
        """Accept a routed request. Nothing is fetched yet: the tiers are read at admission.

        Its unprefilled tokens, as the router's load counts them, assume the best hit the
        two tiers offer now.
        """
        known = max(self.pool.cache.match(req.blocks), self._remote_blocks(req))
        req.target = req.prompt
        self._set_pending(req, req.prompt - reusable_hit_tokens(known, req.prompt, req.block_size))
        self.routed_unprefilled += req.pending
        self.waiting.append(req)
        self.inflight += 1
        self.inflight_tokens += req.prompt

    def _set_pending(self, req: SimRequest, tokens: int) -> None:
        self.unprefilled += tokens - req.pending
        req.pending = tokens

    # -- scheduling ---------------------------------------------------------------------

    def plan_step(self, now: float) -> float | None:
        """Choose the next steps' work; returns when they end, or None when there is none.

        A step with prompt work is planned alone. Steps that only decode repeat unchanged
        until a sequence finishes or needs a KV block, so they are planned as one run and
        cut short if a request arrives meanwhile (``interrupt``).
        """
        budget = self.limits.max_num_batched_tokens - self.decode_seqs
        self.load_until = now
        chunks: list[tuple[SimRequest, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.target - req.done, budget)
            chunks.append((req, n))
            budget -= n
        if self.waiting:
            self._admit(now, budget, chunks)
        self.chunks = chunks
        if chunks:
            prefill = sum(n for _, n in chunks)
            attn2 = sum(n * (req.done + n / 2) for req, n in chunks)
            step = self.perf.step_time(prefill, attn2, self.decode_seqs, self.decode_context)
            # Synchronous loads finish before the forward pass starts.
            return self._plan_run(now, 1, self.load_until - now + step)
        if self.decode_seqs == 0:
            return None
        steps = self._quiet_steps(now)
        # Step time is affine in the KV read, so the run's mean step is its middle one's.
        middle = self.decode_context + self.decode_seqs * (steps - 1) / 2
        step = self.perf.step_time(0, 0.0, self.decode_seqs, int(middle))
        return self._plan_run(now, steps, step)

    def _plan_run(self, now: float, steps: int, step_s: float) -> float:
        self.run_start, self.run_steps, self.run_step_s = now, steps, step_s
        return now + steps * step_s

    def _quiet_steps(self, now: float) -> int:
        """Decode-only steps before anything changes: a finish, a block, a fetch landing."""
        upcoming = [heap[0][0] for heap in (self.finish_heap, self.block_heap) if heap]
        steps = min(upcoming, default=self.step_index + MAX_RUN_STEPS) - self.step_index
        steps = max(1, min(steps, MAX_RUN_STEPS))
        # A load landing now counts too: one that took no time (a free tier) lands as it
        # starts, and vLLM admits it at the next step, when that step reports it landed.
        landing = min(
            (r.ready_at for r in self.waiting if r.loading and r.ready_at >= now), default=None
        )
        if landing is not None:
            step = self.perf.step_time(0, 0.0, self.decode_seqs, self.decode_context)
            steps = max(1, min(steps, math.ceil((landing - now) / step)))
        return steps

    def interrupt(self, now: float) -> float | None:
        """Cut a decode-only run at the end of the step under way; returns its new end."""
        if self.run_steps <= 1:
            return None
        steps = min(self.run_steps, int((now - self.run_start) / self.run_step_s) + 1)
        if steps >= self.run_steps:
            return None
        self.run_steps = steps
        return self.run_start + steps * self.run_step_s

    def next_ready(self) -> float | None:
        """When the earliest asynchronous load lands (to wake an idle instance)."""
        return min((r.ready_at for r in self.waiting if r.loading), default=None)

    def _admit(self, now: float, budget: int, chunks: list[tuple[SimRequest, int]]) -> None:
        """Admit waiting requests in order; start the global-tier loads they need.

        A request whose asynchronous load is under way is passed over without blocking the
        queue, as vLLM skips one in ``WAITING_FOR_REMOTE_KVS``. Once a request finds no
        room, nothing after it is given blocks; but a load that has landed already holds
        its blocks, so it still runs: were it to wait behind a request that cannot fit
        until it frees them, neither would ever run.
        """
        skipped: list[SimRequest] = []
        full = False
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            req = self.waiting[0]
            if req.loading:
                if req.ready_at > now:
                    skipped.append(self.waiting.popleft())
                    continue
                req.loading = False  # landed: its blocks were allocated when it started
            elif full:
                skipped.append(self.waiting.popleft())
                continue
            else:
                external = self._allocate(req, now)
                if external is None:
                    full = True
                    skipped.append(self.waiting.popleft())
                    continue
                if external:
                    nbytes = external * req.block_size * self.limits.kv_bytes_per_token
                    ready = self._load(req, now, nbytes)
                    if self.async_load:
                        req.loading, req.ready_at = True, ready
                        skipped.append(self.waiting.popleft())
                        continue
                    self.load_until = max(self.load_until, ready)
            self.waiting.popleft()
            self.running[req.rid] = req
            self.prefilling.append(req)
            n = min(req.target - req.done, budget)
            chunks.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _remote_blocks(self, req: SimRequest) -> int:
        """Leading blocks of the request that a remote store holds (here the global tier)."""
        return self.global_tier.match(req.blocks)

    def _load(self, req: SimRequest, now: float, nbytes: float) -> float:
        """Start reading ``nbytes`` of the request's remote blocks; returns when they land."""
        return self.tier_route.transfer(now, nbytes)

    def _allocate(self, req: SimRequest, now: float) -> int | None:
        """Pin the local hit and take private blocks for the rest of what must be in KV.

        Returns how many blocks past the local hit the global tier supplies (0 or more),
        or None when the blocks do not fit. Both tiers are looked up here, at admission.
        """
        bs = req.block_size
        cached = self.pool.cache.match(req.blocks)
        remote = self._remote_blocks(req)
        # At least one token is always computed, to produce the next token.
        hit = reusable_hit_blocks(max(cached, remote), req.target, bs)
        pinned = min(cached, hit)
        handle = self.pool.cache.lock(req.blocks, pinned) if pinned else None
        private = -(-req.target // bs) - pinned
        if not self.pool.reserve(private):
            if handle is not None:
                self.pool.cache.unlock(handle, now)
            return None
        if req.preemptions == 0:
            req.local_hit = pinned * bs
            req.global_hit = (hit - pinned) * bs
        req.handle = handle
        req.pinned_blocks = pinned
        req.private_blocks = private
        req.done = hit * bs
        self._set_pending(req, req.target - req.done)
        return hit - pinned

    # -- step completion ----------------------------------------------------------------

    def finish_step(self, now: float) -> list[SimRequest]:
        """Apply the planned steps' effects at their end; returns requests that finished."""
        self.step_index += self.run_steps
        self.busy_time += self.run_steps * self.run_step_s
        self.decode_context += self.decode_seqs * self.run_steps
        finished = self._pop_finished()
        for req in finished:
            self._retire(req, now)
        self._grow_decode_blocks(now)
        for req, n in self.chunks:
            if req.rid not in self.running or req.decoding:
                continue  # preempted during this step's block growth
            req.done += n
            self._set_pending(req, req.pending - n)
            if req.done >= req.target and self._complete_prefill(req, now):
                finished.append(req)
        self.chunks = []
        return finished

    def _complete_prefill(self, req: SimRequest, now: float) -> bool:
        """Publish the prompt's blocks locally and globally, emit a token; True if done."""
        self.prefilling.remove(req)
        self._set_pending(req, 0)
        moved = len(req.blocks) - req.pinned_blocks
        req.handle = self.pool.publish(req.blocks, req.handle, moved, now)
        req.private_blocks -= moved
        req.pinned_blocks = len(req.blocks)
        new = self.global_tier.write(req.blocks, now)
        if new:
            self.tier_route.transfer(now, new * req.block_size * self.limits.kv_bytes_per_token)
        if math.isnan(req.first_token_at):
            req.first_token_at = now
            req.generated = 1
            req.first_token_tokens = self.inflight_tokens
            req.first_token_routed = self.routed_unprefilled
        if req.generated >= req.output:
            self._retire(req, now)
            return True
        req.decoding = True
        req.decode_start = self.step_index
        self.decode_seqs += 1
        self.decode_context += req.target
        remaining = req.output - req.generated
        heapq.heappush(self.finish_heap, (self.step_index + remaining, req.rid, req.epoch, req))
        held = (req.pinned_blocks + req.private_blocks) * req.block_size
        first_need = self.step_index + max(held - req.target + 1, 1)
        heapq.heappush(self.block_heap, (first_need, req.rid, req.epoch, req))
        return False

    def _decoded(self, req: SimRequest) -> int:
        return self.step_index - req.decode_start

    def _pop_finished(self) -> list[SimRequest]:
        out = []
        while self.finish_heap and self.finish_heap[0][0] <= self.step_index:
            _, _, epoch, req = heapq.heappop(self.finish_heap)
            if epoch == req.epoch and req.rid in self.running:
                req.generated = req.output
                out.append(req)
        return out

    def _grow_decode_blocks(self, now: float) -> None:
        while self.block_heap and self.block_heap[0][0] <= self.step_index:
            _, _, epoch, req = heapq.heappop(self.block_heap)
            if epoch != req.epoch or req.rid not in self.running:
                continue
            if self._reserve_or_preempt(req, now):
                req.private_blocks += 1
                next_need = self.step_index + req.block_size
                heapq.heappush(self.block_heap, (next_need, req.rid, req.epoch, req))

    def _reserve_or_preempt(self, req: SimRequest, now: float) -> bool:
        while not self.pool.reserve(1):
            victim = next(reversed(self.running.values()))
            self._preempt(victim, now)
            if victim is req:
                return False
        return True

    def _preempt(self, req: SimRequest, now: float) -> None:
        """Recompute preemption: drop its KV, requeue it first, keep its output so far."""
        if req.decoding:
            req.generated += self._decoded(req)
        self._release(req, now)
        req.epoch += 1
        req.preemptions += 1
        req.target = req.prompt + req.generated
        req.done = 0
        self._set_pending(req, req.target)
        self.waiting.appendleft(req)

    def _retire(self, req: SimRequest, now: float) -> None:
        self._release(req, now)
        req.finished_at = now
        self.inflight -= 1
        self.inflight_tokens -= req.prompt

    def _release(self, req: SimRequest, now: float) -> None:
        del self.running[req.rid]
        if req.decoding:
            self.decode_seqs -= 1
            self.decode_context -= req.target + self._decoded(req)
            req.decoding = False
        elif req in self.prefilling:
            self.prefilling.remove(req)
            self._set_pending(req, 0)
        if req.handle is not None:
            self.pool.cache.unlock(req.handle, now)
            req.handle = None
        self.pool.release(req.private_blocks)
        req.private_blocks = 0
        req.pinned_blocks = 0
