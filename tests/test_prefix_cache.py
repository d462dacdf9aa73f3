"""The prefix cache: hand-worked cases, then random op sequences against a brute-force model.

The model is the set of present prefixes, each a tuple of block ids; it is rebuilt after
every operation from ``match`` over every sequence the run uses, and each operation's
effect on it is checked against what that operation may and must do.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smetric.core.prefix_cache import Handle, PrefixCache

from conftest import TRIE_SEQUENCES


def ids(*blocks: int) -> np.ndarray:
    return np.array(blocks, dtype=np.int64)


def run_of(start: int, length: int) -> np.ndarray:
    return np.arange(start, start + length, dtype=np.int64)


def test_match_after_insert() -> None:
    cache = PrefixCache(None)
    assert cache.insert(ids(1, 2, 3, 4), now=1) == 4
    assert cache.match(ids(1, 2, 3, 4)) == 4
    assert cache.match(ids(1, 2, 3, 4, 5)) == 4
    assert cache.match(ids(1, 2, 9, 4)) == 2
    assert cache.match(ids(2, 3)) == 0
    assert cache.match(ids()) == 0
    assert cache.insert(ids(1, 2), now=2) == 0
    assert cache.size == 4


def test_any_one_dimensional_integer_sequence_is_accepted() -> None:
    cache = PrefixCache(None)
    cache.insert([1, 2, 3, 4], now=1)
    strided = np.array([1, 0, 2, 0, 3, 0, 9, 0], dtype=np.int32)[::2]
    assert cache.match(strided) == 3
    with pytest.raises(ValueError, match="one-dimensional"):
        cache.match(np.ones((2, 2), dtype=np.int64))


def test_session_extension_stays_one_node() -> None:
    cache = PrefixCache(None)
    prompt = np.empty(0, dtype=np.int64)
    held: Handle | None = None
    for turn in range(500):
        prompt = np.concatenate((prompt, run_of(10 * turn, 3)))
        added = cache.insert(prompt, now=turn)
        assert added == 3
        # The running request pins its prompt; the previous turn's pin ends after it.
        handle = cache.lock(prompt, len(prompt))
        if held is not None:
            cache.unlock(held, now=turn)
        held = handle
    assert held is not None
    cache.unlock(held, now=500)
    assert cache.size == 1500
    assert cache.match(prompt) == 1500
    assert cache.node_count == 1
    assert cache.locked == 0


def test_divergence_splits_an_edge() -> None:
    cache = PrefixCache(None)
    cache.insert(ids(1, 2, 3, 4), now=1)
    assert cache.insert(ids(1, 2, 7, 8), now=2) == 2
    assert cache.node_count == 3
    assert cache.size == 6
    assert cache.match(ids(1, 2, 3, 4)) == 4
    assert cache.match(ids(1, 2, 7, 8)) == 4
    assert cache.match(ids(1, 2, 5)) == 2


def test_stale_last_blocks_go_first_and_the_path_compacts() -> None:
    # Traces re-hash a turn's partial last block, so each turn diverges one block short
    # of the previous prompt and leaves a one-block dead end behind.
    cache = PrefixCache(None)
    history = np.empty(0, dtype=np.int64)
    for turn in range(50):
        history = np.concatenate((history, run_of(1000 * turn, 20)))
        cache.insert(np.concatenate((history, ids(-turn - 1))), now=turn)
    assert cache.node_count == 99
    assert cache.evict(49) == 49
    assert cache.node_count == 1
    assert cache.match(np.concatenate((history, ids(-50)))) == 50 * 20 + 1


def test_least_recently_used_session_goes_first() -> None:
    cache = PrefixCache(None)
    a, b = run_of(100, 5), run_of(200, 5)
    cache.insert(a, now=1)
    cache.insert(b, now=2)
    cache.insert(a[:3], now=3)  # a hit on A's prefix refreshes A
    assert cache.evict(5) == 5
    assert cache.match(a) == 5
    assert cache.match(b) == 0


def test_equal_times_evict_in_insertion_order() -> None:
    cache = PrefixCache(None)
    a, b = run_of(100, 5), run_of(200, 5)
    cache.insert(a, now=1)
    cache.insert(b, now=1)
    cache.evict(5)
    assert (cache.match(a), cache.match(b)) == (0, 5)


def test_eviction_truncates_the_tail_first() -> None:
    cache = PrefixCache(None)
    prompt = run_of(0, 300)
    cache.insert(prompt, now=1)
    assert cache.evict(10) == 10
    assert cache.match(prompt) == 290
    assert cache.size == 290
    assert cache.node_count == 1


def test_emptied_branch_lets_its_parent_be_evicted() -> None:
    cache = PrefixCache(None)
    shared = run_of(0, 4)
    a = np.concatenate((shared, run_of(100, 3)))
    b = np.concatenate((shared, run_of(200, 3)))
    cache.insert(a, now=1)
    cache.insert(b, now=2)
    assert cache.evict(4) == 4
    # A's branch went whole, then the newer B lost one block from its tail.
    assert cache.match(a) == 4
    assert cache.match(b) == 6
    assert cache.node_count == 1
    assert cache.evict(100) == 6
    assert cache.size == 0
    assert cache.node_count == 0


def test_a_prefix_hit_outlives_its_older_branches() -> None:
    cache = PrefixCache(None)
    shared = run_of(0, 4)
    a = np.concatenate((shared, run_of(100, 3)))
    b = np.concatenate((shared, run_of(200, 3)))
    d = run_of(300, 3)
    cache.insert(a, now=1)
    cache.insert(b, now=2)
    cache.insert(d, now=3)
    cache.insert(shared, now=5)
    assert cache.evict(3) == 3  # A's branch
    # The shared run (used at 5) is not merged into B's older tail (used at 2): B's tail
    # goes next, then D, and the shared run last.
    assert cache.node_count == 3
    assert cache.evict(6) == 6
    assert (cache.match(b), cache.match(d)) == (4, 0)
    assert cache.evict(100) == 4


def test_lock_prevents_eviction_and_nests() -> None:
    cache = PrefixCache(None)
    a, b = run_of(100, 5), run_of(200, 5)
    cache.insert(a, now=1)
    cache.insert(b, now=2)
    first = cache.lock(a, 5)
    second = cache.lock(a, 5)
    assert cache.locked == 5
    assert cache.evict(100) == 5
    assert cache.match(a) == 5
    assert cache.match(b) == 0
    cache.unlock(first, now=3)
    assert cache.evict(100) == 0
    cache.unlock(second, now=4)
    assert cache.locked == 0
    assert cache.evict(100) == 5


def test_lock_pins_exactly_its_prefix() -> None:
    cache = PrefixCache(None)
    a = run_of(100, 5)
    cache.insert(a, now=1)
    handle = cache.lock(a, 3)
    assert cache.locked == 3
    assert cache.evict(100) == 2
    assert cache.match(a) == 3
    cache.unlock(handle, now=2)
    assert cache.node_count == 1


def test_locked_leaf_can_still_be_extended() -> None:
    cache = PrefixCache(None)
    a = run_of(100, 5)
    longer = run_of(100, 8)
    cache.insert(a, now=1)
    handle = cache.lock(a, 5)
    assert cache.insert(longer, now=2) == 3
    assert cache.locked == 5
    assert cache.evict(100) == 3
    assert cache.insert(longer, now=3) == 3
    cache.unlock(handle, now=4)
    # The run grown under the lock was last used before the unlock, so it stays apart
    # until the session's next use touches both.
    assert cache.node_count == 2
    assert cache.insert(longer, now=5) == 0
    assert cache.node_count == 1
    assert cache.match(longer) == 8


def test_lock_and_unlock_reject_misuse() -> None:
    cache = PrefixCache(None)
    cache.insert(ids(1, 2, 3), now=1)
    with pytest.raises(ValueError, match="present"):
        cache.lock(ids(1, 2, 4), 3)
    with pytest.raises(ValueError, match="cannot lock"):
        cache.lock(ids(1, 2), 3)
    handle = cache.lock(ids(1, 2, 3), 2)
    cache.unlock(handle, now=2)
    with pytest.raises(ValueError, match="already"):
        cache.unlock(handle, now=3)
    with pytest.raises(ValueError, match="capacity"):
        PrefixCache(-1)


def test_capacity_is_never_exceeded() -> None:
    cache = PrefixCache(10)
    a, b = run_of(100, 6), run_of(200, 6)
    assert cache.insert(a, now=1) == 6
    assert cache.insert(b, now=2) == 6
    assert cache.size == 10
    assert cache.match(a) == 4
    assert cache.match(b) == 6


def test_insert_larger_than_capacity_keeps_a_prefix() -> None:
    cache = PrefixCache(10)
    big = run_of(0, 25)
    assert cache.insert(big, now=1) == 10
    assert cache.match(big) == 10
    assert cache.size == 10
    other = run_of(100, 6)
    handle = cache.lock(big, 4)
    # Everything unlocked goes, and only what fits beside the 4 pinned blocks is added.
    assert cache.insert(other, now=2) == 6
    assert cache.match(big) == 4
    cache.unlock(handle, now=3)


def test_insert_never_evicts_its_own_prefix() -> None:
    cache = PrefixCache(10)
    prompt = run_of(0, 12)
    cache.insert(prompt[:8], now=1)
    assert cache.insert(prompt, now=2) == 2
    assert cache.match(prompt) == 10


def test_zero_capacity_holds_nothing() -> None:
    cache = PrefixCache(0)
    assert cache.insert(run_of(0, 5), now=1) == 0
    assert cache.size == 0
    assert cache.node_count == 0


# Ops name sequences by index into a small pool so that the same sessions come back, get
# locked while present and are cut to prefixes (a cut past the end takes the whole).
POOLS = st.lists(TRIE_SEQUENCES, min_size=1, max_size=6)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 5), st.integers(0, 16)),
        st.tuples(st.just("lock"), st.integers(0, 5), st.integers(0, 16)),
        st.tuples(st.just("unlock"), st.integers(0, 20)),
        st.tuples(st.just("evict"), st.integers(0, 20)),
    ),
    max_size=40,
)
CAPACITIES = st.one_of(st.none(), st.integers(0, 30))

Prefixes = set[tuple[int, ...]]


def present(cache: PrefixCache, universe: list[tuple[int, ...]]) -> Prefixes:
    out: Prefixes = set()
    for seq in universe:
        out.update(seq[:i] for i in range(1, cache.match(np.array(seq, dtype=np.int64)) + 1))
    return out


def prefixes(seq: tuple[int, ...], n: int) -> Prefixes:
    return {seq[:i] for i in range(1, n + 1)}


def brute_match(seq: tuple[int, ...], model: Prefixes) -> int:
    n = 0
    while n < len(seq) and seq[: n + 1] in model:
        n += 1
    return n


def run_ops(capacity: int | None, pool: list[tuple[int, ...]], ops: list[tuple]) -> list:
    """Apply ``ops`` and check each against the model; returns what was observed."""
    universe = pool + [pool[op[1] % len(pool)][: op[2]] for op in ops if op[0] == "insert"]
    cache = PrefixCache(capacity)
    locks: list[tuple[tuple[int, ...], int, Handle]] = []
    before: Prefixes = set()
    observed: list = []
    for now, op in enumerate(ops, start=1):
        pinned: Prefixes = set().union(*(prefixes(seq, n) for seq, n, _ in locks))
        size_before = cache.size
        if op[0] == "insert":
            seq = pool[op[1] % len(pool)][: op[2]]
            matched = cache.match(np.array(seq, dtype=np.int64))
            result = cache.insert(np.array(seq, dtype=np.int64), now)
            after = present(cache, universe)
            need = len(seq) - matched
            assert after - before <= prefixes(seq, len(seq))
            assert not (before - after) & (pinned | prefixes(seq, matched))
            assert brute_match(seq, after) == matched + result
            if capacity is None:
                assert result == need
            else:
                room = capacity - len(pinned | prefixes(seq, matched))
                assert result == min(need, room)
                assert cache.size == min(capacity, size_before + need)
        elif op[0] == "lock":
            seq = pool[op[1] % len(pool)]
            n = min(op[2], cache.match(np.array(seq, dtype=np.int64)))
            locks.append((seq, n, cache.lock(np.array(seq, dtype=np.int64), n)))
            result = n
            after = present(cache, universe)
            assert after == before
        elif op[0] == "unlock":
            result = -1
            if locks:
                result = op[1] % len(locks)
                cache.unlock(locks.pop(result)[2], now)
            after = present(cache, universe)
            assert after == before
        else:
            result = cache.evict(op[1])
            after = present(cache, universe)
            assert after <= before
            assert result == len(before - after) == min(op[1], size_before - len(pinned))
            assert not (before - after) & pinned
        # Conservation, capacity, lock safety and prefix-closure after every operation.
        locked: Prefixes = set().union(*(prefixes(seq, n) for seq, n, _ in locks))
        assert cache.size == len(after)
        assert capacity is None or cache.size <= capacity
        assert cache.locked == len(locked)
        for seq, n, _ in locks:
            assert cache.match(np.array(seq, dtype=np.int64)) >= n
        matches = [cache.match(np.array(seq, dtype=np.int64)) for seq in universe]
        assert matches == [brute_match(seq, after) for seq in universe]
        observed.append((result, cache.size, cache.locked, cache.node_count, matches))
        before = after
    return observed


@settings(max_examples=400, deadline=None)
@given(capacity=CAPACITIES, pool=POOLS, ops=OPS)
def test_random_ops_agree_with_the_model(
    capacity: int | None, pool: list[tuple[int, ...]], ops: list[tuple]
) -> None:
    run_ops(capacity, pool, ops)


@settings(max_examples=100, deadline=None)
@given(capacity=CAPACITIES, pool=POOLS, ops=OPS)
def test_replay_is_deterministic(
    capacity: int | None, pool: list[tuple[int, ...]], ops: list[tuple]
) -> None:
    assert run_ops(capacity, pool, ops) == run_ops(capacity, pool, ops)
