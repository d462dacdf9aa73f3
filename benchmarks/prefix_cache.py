"""The prefix cache under an agentic routing load, against a per-block LRU baseline.

    python benchmarks/prefix_cache.py [--sessions 600] [--baseline-sessions 60]

Sessions of 70 turns each extend their previous prompt by about 30 blocks (about 2,000
blocks a prompt on average, after a 64-block system prompt every session shares), with 64
sessions live at a time. Every request is matched against all 32 instance caches of
4,000 blocks (what routing does), then inserted and locked on one instance (round-robin
for a session's first turn, the longest hit after that) and unlocked eight requests
later. The baseline is the usual per-block design, a dict of lock counts plus an
OrderedDict of unlocked blocks in LRU order, fed Python lists made before the clock
starts; it runs on fewer sessions because it is slow, so the two are compared per request
on the same smaller workload, with the cache's full-size figures beside them.
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from smetric.core.prefix_cache import PrefixCache

INSTANCES = 32
CAPACITY = 4_000
TURNS = 70
LIVE_SESSIONS = 64
IN_FLIGHT = 8
SYSTEM_PROMPT = 64


class Cache(Protocol):
    def match(self, blocks: Any) -> int: ...
    def insert(self, blocks: Any, now: float) -> int: ...
    def lock(self, blocks: Any, n: int) -> Any: ...
    def unlock(self, handle: Any, now: float) -> None: ...


class NaiveLRU:
    """Per-block baseline with the same semantics: tails evicted first, hits pinned."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.refs: dict[int, int] = {}
        # Unlocked present blocks, least recently used first.
        self.free: OrderedDict[int, None] = OrderedDict()

    def match(self, blocks: list[int]) -> int:
        refs = self.refs
        n = 0
        for block in blocks:
            if block not in refs:
                break
            n += 1
        return n

    def insert(self, blocks: list[int], now: float) -> int:
        refs, free = self.refs, self.free
        matched = self.match(blocks)
        for block in blocks[:matched]:
            free.pop(block, None)
        need = len(blocks) - matched
        while len(refs) + need > self.capacity and free:
            del refs[free.popitem(last=False)[0]]
        fit = min(need, self.capacity - len(refs))
        for block in blocks[matched : matched + fit]:
            refs[block] = 0
        # Tail first, so that the head is the most recent and eviction takes tails.
        for block in reversed(blocks[: matched + fit]):
            if refs[block] == 0:
                free[block] = None
        return fit

    def lock(self, blocks: list[int], n: int) -> list[int]:
        refs, free = self.refs, self.free
        for block in blocks[:n]:
            count = refs[block]
            if count == 0:
                del free[block]
            refs[block] = count + 1
        return blocks[:n]

    def unlock(self, handle: list[int], now: float) -> None:
        refs, free = self.refs, self.free
        for block in reversed(handle):
            count = refs[block] - 1
            refs[block] = count
            if count == 0:
                free[block] = None


def workload(sessions: int, seed: int = 0) -> tuple[list[np.ndarray], list[tuple[int, int, int]]]:
    """Each session's final prompt, and the requests as (session, turn, prompt length)."""
    rng = np.random.default_rng(seed)
    system = np.arange(1, SYSTEM_PROMPT + 1, dtype=np.int64)
    prompts, lengths = [], []
    for s in range(sessions):
        steps = np.concatenate(([rng.integers(700, 1_200)], rng.integers(15, 46, TURNS - 1)))
        turn_lengths = SYSTEM_PROMPT + np.cumsum(steps)
        own = ((s + 1) << 32) + np.arange(turn_lengths[-1] - SYSTEM_PROMPT, dtype=np.int64)
        prompts.append(np.concatenate((system, own)))
        lengths.append(turn_lengths.tolist())
    live = list(range(min(LIVE_SESSIONS, sessions)))
    started, turn = len(live), [0] * sessions
    requests = []
    while live:
        slot = int(rng.integers(len(live)))
        s = live[slot]
        requests.append((s, turn[s], lengths[s][turn[s]]))
        turn[s] += 1
        if turn[s] == TURNS:
            if started < sessions:
                live[slot] = started
                started += 1
            else:
                live.pop(slot)
    return prompts, requests


def replay(
    make: Callable[[], Cache], prompts: list[Any], requests: list[tuple[int, int, int]]
) -> tuple[float, int, float]:
    """CPU seconds, cache operations and hit ratio (in blocks) of one run.

    CPU time rather than wall time, so that other work on a shared machine skews it less.
    """
    caches = [make() for _ in range(INSTANCES)]
    in_flight: deque[tuple[Cache, Any]] = deque()
    ops = hits = blocks_total = 0
    next_rr = 0
    start = time.process_time()
    for now, (s, turn, length) in enumerate(requests):
        blocks = prompts[s][:length]
        matches = [cache.match(blocks) for cache in caches]
        if turn == 0:
            best, next_rr = next_rr, (next_rr + 1) % INSTANCES
        else:
            best = max(range(INSTANCES), key=matches.__getitem__)
        cache = caches[best]
        added = cache.insert(blocks, now)
        in_flight.append((cache, cache.lock(blocks, matches[best] + added)))
        ops += INSTANCES + 2
        if len(in_flight) > IN_FLIGHT:
            done, handle = in_flight.popleft()
            done.unlock(handle, now)
            ops += 1
        hits += matches[best]
        blocks_total += length
    return time.process_time() - start, ops, hits / blocks_total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=600)
    parser.add_argument("--baseline-sessions", type=int, default=60)
    args = parser.parse_args()

    def tree() -> PrefixCache:
        return PrefixCache(CAPACITY)

    def naive() -> NaiveLRU:
        return NaiveLRU(CAPACITY)

    small, small_requests = workload(args.baseline_sessions)
    small_lists = [prompt.tolist() for prompt in small]
    full, full_requests = workload(args.sessions)
    runs = {
        f"PrefixCache, {args.sessions} sessions": replay(tree, full, full_requests),
        f"PrefixCache, {args.baseline_sessions} sessions": replay(tree, small, small_requests),
        f"per-block LRU, {args.baseline_sessions} sessions": replay(
            naive, small_lists, small_requests
        ),
    }
    print(f"{'run':32} {'requests':>8} {'cpu s':>8} {'us/request':>10} {'ops/s':>9} {'hit':>6}")
    per_request = {}
    for (name, (seconds, ops, hit)), requests in zip(
        runs.items(), [full_requests, small_requests, small_requests], strict=True
    ):
        per_request[name] = seconds / len(requests)
        print(
            f"{name:32} {len(requests):8} {seconds:8.2f} {per_request[name] * 1e6:10.1f} "
            f"{ops / seconds:9.0f} {hit:6.1%}"
        )
    names = list(per_request)
    speedup = per_request[names[2]] / per_request[names[1]]
    print(f"per request, the per-block LRU takes {speedup:.1f}x as long as PrefixCache")


if __name__ == "__main__":
    main()
