"""The mock engine's continuous-batching loop, timed and cached by the simulator's own code.

A router is only as good as its tests, and real engines need GPUs. This loop behaves like
vLLM V1 where a router can observe it: requests wait until their KV fits, each step runs
every decode plus prompt chunks under a token budget, a prompt's full blocks become a
reusable prefix once its prefill completes, and the cache evicts least recently used
prefixes. The KV pool is ``model.kv.LocalPool`` (cached blocks in ``core.prefix_cache`` plus
private blocks, one budget) and a step lasts ``StepTimeModel.step_time`` of what it
computes, so the engine and the simulator cannot disagree about either.

Simplifications, chosen so the engine never has to preempt: a request reserves the blocks
for its whole prompt and ``max_tokens`` when admitted, and only prompt blocks are cached
(generated text is filler, so caching it would promise hits no client can produce).

With a ``kv_sink`` the engine also reports its cache as vLLM's KV events do (map-form
``BlockStored``/``BlockRemoved`` dicts, one list per step, ``engine.kv_report``), using the
router's own chained block ids as its block hashes.

With ``cpu_offload_blocks`` it also offloads to CPU memory as vLLM's ``OffloadingConnector``
with its CPU backend does, at the granularity of one GPU block: every prompt block it
computes is copied to an LRU store of that many blocks (``_get_reqs_to_store`` copies
each newly computed block that the store lacks; here once the prefill completes), announced
as ``BlockStored`` with ``medium="CPU"`` in the connector's hash-only form, and
``BlockRemoved`` when the store evicts it. At admission, after the GPU hit, the store is
asked for the blocks that follow (``get_num_new_matched_tokens``), which are then loaded
instead of computed and count in ``cached_tokens``, as vLLM counts loaded tokens. The load
takes no time here (the simulator models it); only the hit is modelled.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from smetric.core.blocks import reusable_hit_blocks
from smetric.core.prefix_cache import Handle, PrefixCache
from smetric.core.settings import check_settings, setting
from smetric.engine.kv_report import CacheReport
from smetric.model.kv import LocalPool
from smetric.model.perf import StepTimeModel, load_hardware, load_model

# What a finished request's queue receives last, after its tokens.
END = None

_FILLER = (
    "the",
    "agent",
    "reads",
    "a",
    "file",
    "and",
    "calls",
    "one",
    "more",
    "tool",
    "before",
    "it",
    "writes",
    "its",
    "answer",
)


def filler_token(index: int) -> str:
    """The text of generated token ``index``: deterministic, so tests and demos can compare."""
    return _FILLER[index % len(_FILLER)] + " "


# What an engine may do in a disaggregated cluster.
ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class EngineConfig:
    """What ``smetric engine`` is started with; the defaults mimic one H20 serving Qwen3-30B.

    ``speed`` multiplies every step's modelled duration: 1.0 is real time, 0.001 makes a
    test's steps microseconds long without changing what any step contains.
    """

    served_model_name: str = setting("Qwen/Qwen3-30B-A3B", "Model id it reports in /v1/models.")
    model: str = setting("Qwen3-30B-A3B", "Step-time model preset (smetric model lists them).")
    hardware: str = setting("H20", "GPU preset.")
    gpus: int = setting(1, "GPUs (tensor parallel).", ge=1)
    block_size: int = setting(16, "Tokens per KV block.", ge=1)
    kv_blocks: int = setting(4096, "KV blocks in the pool.", ge=1)
    max_num_batched_tokens: int = setting(
        2048, "Token budget per engine step (chunked prefill).", ge=1
    )
    max_num_seqs: int = setting(256, "Running sequences cap.", ge=1)
    default_max_tokens: int = setting(
        16, "Tokens generated for a request that does not set max_tokens.", ge=1
    )
    max_model_len: int | None = setting(
        None,
        "Longest prompt plus max_tokens a request may have; none: what the KV pool holds "
        "(kv_blocks x block_size), the most it may be.",
        ge=1,
    )
    speed: float = setting(1.0, "Multiplier on every step's modelled duration (1: real).", ge=0)
    # Agent mode (engine/agent.py): replies a harness can run several turns on.
    agent: bool = setting(
        False,
        "Reply as an agent's model: a short reply that ends its turn, or a call to a "
        "read-only tool the request offers; seeded by the request's content. Off: every "
        "reply runs to max_tokens (without one, default_max_tokens, ending there).",
    )
    agent_seed: int = setting(0, "Seed of the agent mode's replies.", ge=0, lt=2**64)
    # Disaggregated serving (engine/disagg.py): what the engine may do for a proxy, the link
    # a decode engine pulls prompt blocks over (one 200 Gbps RDMA NIC by default), and how
    # long a prefill engine keeps finished prompts' blocks for a decode to pull.
    role: str = setting(
        "both",
        "Disaggregated serving: prefill (holds a finished prompt's KV for a decode engine, "
        "answers kv_transfer_params), decode (pulls it over the link model first), or both.",
        choices=ROLES,
    )
    kv_link_gb_s: float = setting(21.7, "Bandwidth a decode engine pulls KV at, GB/s.", gt=0)
    kv_lease_s: float = setting(
        30.0, "Seconds a prefill engine keeps a finished prompt's KV for a decode to pull.", gt=0
    )
    # KV events as vLLM's ``--kv-events-config`` publishes them: the engine connects its PUB
    # socket to a ``tcp://host:port`` endpoint and binds a ROUTER on the replay endpoint,
    # which resends any of the last ``kv_events_buffer_steps`` batches.
    kv_events_endpoint: str | None = setting(
        None,
        "Publish vLLM KV events on this ZMQ endpoint, as vLLM does: tcp://*:PORT binds "
        "(routers connect, several per engine; PORT * : any free port, the startup line "
        "names it), tcp://HOST:PORT connects (to a router that binds). None: no events.",
    )
    kv_events_topic: str = setting("kv", "Topic of the KV events.")
    kv_events_replay_endpoint: str | None = setting(
        None,
        "ZMQ endpoint to bind the replay socket on (tcp://HOST:* : any free port, the "
        "startup line names it). None: no replay.",
    )
    # None decides from the endpoint as vLLM does (``publisher_binds``).
    kv_events_bind: bool | None = setting(
        None,
        "Bind the events socket (several subscribers, e.g. router replicas, connect to "
        "one engine) or connect it. None: as vLLM decides from the endpoint.",
    )
    kv_events_buffer_steps: int = setting(
        10_000, "Steps of KV events the replay socket can resend.", ge=1
    )
    cpu_offload_blocks: int = setting(
        0,
        "Offload prompt blocks to an LRU CPU store of this many blocks and load them back "
        "on a hit, as vLLM's OffloadingConnector with its CPU backend does; its KV events "
        "report them with medium CPU (0: no offloading).",
        ge=0,
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.max_model_len is not None and self.max_model_len > self.pool_tokens:
            # As vLLM refuses to start when one longest request would not fit its cache:
            # here it would wait for room forever.
            raise ValueError(
                f"max_model_len {self.max_model_len} is more than the KV pool holds "
                f"({self.kv_blocks} blocks x {self.block_size} = {self.pool_tokens} tokens); "
                "raise kv_blocks"
            )

    @property
    def pool_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    @property
    def context_len(self) -> int:
        """Longest prompt plus output one request may have: ``max_model_len`` or the pool."""
        return self.pool_tokens if self.max_model_len is None else self.max_model_len


@dataclass(eq=False)
class EngineRequest:
    """One request's progress; the server reads ``tokens`` until it yields ``END``."""

    token_ids: np.ndarray
    blocks: np.ndarray
    max_tokens: int
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    cached_tokens: int = 0
    computed: int = 0
    generated: int = 0
    handle: Handle | None = None
    pinned_blocks: int = 0
    private_blocks: int = 0
    finished: bool = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class EngineCounters:
    """Monotonic totals behind the ``/metrics`` counters, in vLLM's units (tokens)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    finished_requests: int = 0


class MockEngine:
    """Waiting queue, running batch and KV pool, advanced one modelled step at a time."""

    def __init__(
        self, config: EngineConfig, kv_sink: Callable[[list[dict[str, Any]]], None] | None = None
    ) -> None:
        """``kv_sink`` receives each step's KV events; without one none are recorded."""
        self.config = config
        self.kv_sink = kv_sink
        self._kv_events: list[dict[str, Any]] = []
        self.pool = LocalPool(config.kv_blocks)
        bs = config.block_size
        self._gpu_report = CacheReport(self.pool.cache, "GPU", self._kv_events, bs)
        # The CPU store offloaded prompt blocks go to, when there is one.
        self.cpu: PrefixCache | None = None
        if config.cpu_offload_blocks:
            self.cpu = PrefixCache(config.cpu_offload_blocks)
            self._cpu_report = CacheReport(self.cpu, "CPU", self._kv_events, bs, with_tokens=False)
        self.perf = StepTimeModel(
            load_model(config.model), load_hardware(config.hardware, config.gpus)
        )
        self.waiting: deque[EngineRequest] = deque()
        self.prefilling: list[EngineRequest] = []
        self.decoding: list[EngineRequest] = []
        self.counters = EngineCounters()
        self._wake = asyncio.Event()

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def kv_cache_usage(self) -> float:
        """Share of blocks in use, as vLLM reports it: cached blocks nobody holds count free."""
        used = self.pool.cache.locked + self.pool.private
        return used / self.pool.capacity

    def submit(self, request: EngineRequest) -> None:
        """Queue a request; the caller has checked it fits ``context_len``."""
        self.waiting.append(request)
        self._wake.set()

    def adopt(self, token_ids: np.ndarray, blocks: np.ndarray, n: int, now: float) -> Handle | None:
        """Cache ``n`` prompt blocks read from another engine (a remote prefill), pinned by
        the returned handle; None when the pool has no room, so the request computes them."""
        cached = self.pool.cache.size
        reserved = self.pool.reserve(n)
        if self.kv_sink is not None and self.pool.cache.size < cached:
            self._gpu_report.removed()
        if not reserved:
            return None
        present = self.pool.cache.match(blocks[:n])
        handle = self.pool.publish(blocks[:n], None, n, now)
        if self.kv_sink is not None:
            self._gpu_report.stored(blocks[:n], token_ids, present)
        self._flush_kv_events()
        return handle

    def cancel(self, request: EngineRequest) -> None:
        """Drop a request whose client went away, freeing its blocks at once."""
        if request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
            request.finished = True
            return
        self._release(request, asyncio.get_running_loop().time())

    async def run(self) -> None:
        """Step forever: sleep while idle, otherwise plan a step, wait its time, apply it."""
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting and not self.num_running:
                self._wake.clear()
                await self._wake.wait()
            chunks = self._plan(loop.time())
            self._flush_kv_events()
            decodes = list(self.decoding)
            if not chunks and not decodes:
                # Nothing admitted: the head request waits for blocks that running ones hold.
                self._wake.clear()
                await self._wake.wait()
                continue
            prefill = sum(n for _, n in chunks)
            attn2 = sum(n * (req.computed + n / 2) for req, n in chunks)
            context = sum(req.prompt_tokens + req.generated for req in decodes)
            step_s = self.perf.step_time(prefill, attn2, len(decodes), context)
            await asyncio.sleep(step_s * self.config.speed)
            self._apply(chunks, decodes, loop.time())
            self._flush_kv_events()

    def _plan(self, now: float) -> list[tuple[EngineRequest, int]]:
        """This step's prompt chunks: running prefills first, then admissions, in order."""
        budget = self.config.max_num_batched_tokens - len(self.decoding)
        chunks: list[tuple[EngineRequest, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                return chunks
            n = min(req.prompt_tokens - req.computed, budget)
            chunks.append((req, n))
            budget -= n
        while self.waiting and budget > 0 and self.num_running < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self._allocate(req, now):
                break
            self.waiting.popleft()
            self.prefilling.append(req)
            n = min(req.prompt_tokens - req.computed, budget)
            chunks.append((req, n))
            budget -= n
        return chunks

    def _allocate(self, req: EngineRequest, now: float) -> bool:
        """Pin the cached prefix and reserve the rest; the hit is counted once, on success.

        As in vLLM, at least the prompt's last token is always computed (it yields the first
        output token), so a fully cached prompt still gives up its last block.
        """
        bs = self.config.block_size
        hit = reusable_hit_blocks(self.pool.cache.match(req.blocks), req.prompt_tokens, bs)
        handle = self.pool.cache.lock(req.blocks, hit) if hit else None
        private = -(-(req.prompt_tokens + req.max_tokens) // bs) - hit
        cached = self.pool.cache.size
        reserved = self.pool.reserve(private)
        if self.kv_sink is not None and self.pool.cache.size < cached:
            self._gpu_report.removed()
        if not reserved:
            if handle is not None:
                self.pool.cache.unlock(handle, now)
            return False
        req.handle, req.pinned_blocks, req.private_blocks = handle, hit, private
        # Blocks the CPU store holds past the GPU hit are loaded into the private blocks.
        loaded = max(self._offloaded_hit(req, now) - hit, 0)
        req.cached_tokens = req.computed = (hit + loaded) * bs
        self.counters.prefix_cache_queries += req.prompt_tokens
        self.counters.prefix_cache_hits += hit * bs
        return True

    def _offloaded_hit(self, req: EngineRequest, now: float) -> int:
        """Leading prompt blocks the CPU store can give back, capped as any hit is; the
        look-up refreshes their recency, as the connector's ``touch`` does."""
        if self.cpu is None:
            return 0
        held = self.cpu.match(req.blocks)
        if held:
            self.cpu.insert(req.blocks[:held], now)
        return reusable_hit_blocks(held, req.prompt_tokens, self.config.block_size)

    def _apply(
        self, chunks: list[tuple[EngineRequest, int]], decodes: list[EngineRequest], now: float
    ) -> None:
        """The step's effects at its end; requests cancelled meanwhile are skipped."""
        for req in decodes:
            if not req.finished:
                self._emit(req, now)
        for req, n in chunks:
            if req.finished:
                continue
            req.computed += n
            if req.computed == req.prompt_tokens:
                self._complete_prefill(req, now)

    def _complete_prefill(self, req: EngineRequest, now: float) -> None:
        """Publish the prompt's full blocks as a reusable prefix and sample the first token."""
        self.prefilling.remove(req)
        moved = len(req.blocks) - req.pinned_blocks
        present = self.pool.cache.match(req.blocks)
        req.handle = self.pool.publish(req.blocks, req.handle, moved, now)
        if self.kv_sink is not None:
            self._gpu_report.stored(req.blocks, req.token_ids, present)
        self._offload(req, now)
        req.private_blocks -= moved
        req.pinned_blocks = len(req.blocks)
        self.counters.prompt_tokens += req.prompt_tokens
        self.decoding.append(req)
        self._emit(req, now)

    def _offload(self, req: EngineRequest, now: float) -> None:
        """Copy the prompt's blocks that the CPU store lacks into it, evicting its least
        recently used ones to make room."""
        if self.cpu is None:
            return
        present = self.cpu.match(req.blocks)
        before = self.cpu.size
        added = self.cpu.insert(req.blocks, now)
        if self.kv_sink is None:
            return
        self._cpu_report.stored(req.blocks[: present + added], req.token_ids, present)
        if self.cpu.size < before + added:
            self._cpu_report.removed()

    def _flush_kv_events(self) -> None:
        if self._kv_events and self.kv_sink is not None:
            self.kv_sink(list(self._kv_events))
            self._kv_events.clear()

    def _emit(self, req: EngineRequest, now: float) -> None:
        req.tokens.put_nowait(req.generated)
        req.generated += 1
        self.counters.generation_tokens += 1
        if req.generated >= req.max_tokens:
            self._release(req, now)
            self.counters.finished_requests += 1
            req.tokens.put_nowait(END)

    def _release(self, req: EngineRequest, now: float) -> None:
        if req in self.decoding:
            self.decoding.remove(req)
        elif req in self.prefilling:
            self.prefilling.remove(req)
        if req.handle is not None:
            self.pool.cache.unlock(req.handle, now)
            req.handle = None
        self.pool.release(req.private_blocks)
        req.private_blocks = req.pinned_blocks = 0
        req.finished = True
        # Freed blocks may let the head of the queue in.
        self._wake.set()
