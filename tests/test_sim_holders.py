"""The holder index: its per-instance hits equal each instance's own ``match``, always.

Random operations (inserts, locks, unlocks, evictions, inserts that evict to fit) go to
random instances' caches, each watched by one shared index; after every operation the
index must give, for every sequence the run uses and for probes that diverge inside them,
exactly what each cache's ``match`` gives.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from smetric.core.prefix_cache import Handle, PrefixCache
from smetric.sim.holders import HolderIndex

from conftest import TRIE_SEQUENCES


def ids(*blocks: int) -> np.ndarray:
    return np.array(blocks, dtype=np.int64)


def test_hits_per_instance_and_the_depth_where_each_leaves() -> None:
    index = HolderIndex(3)
    caches = [PrefixCache(None, index.watcher(i)) for i in range(3)]
    caches[0].insert(ids(1, 2, 3, 4, 5), now=1)
    caches[1].insert(ids(1, 2, 3), now=1)
    caches[2].insert(ids(7, 8), now=1)
    assert index.matches(ids(1, 2, 3, 4, 5, 6)) == [5, 3, 0]
    assert index.matches(ids(1, 2, 9)) == [2, 2, 0]
    assert index.matches(ids(7, 8, 9)) == [0, 0, 2]
    assert index.matches(ids()) == [0, 0, 0]
    # A value is asked once per distinct hit.
    asked: list[int] = []

    def value(m: int) -> int:
        asked.append(m)
        return 10 * m

    assert index.per_instance(ids(1, 2, 3, 4), value) == [40, 30, 0]
    assert sorted(asked) == [0, 3, 4]


def test_a_session_growing_on_one_instance_stays_one_node() -> None:
    index = HolderIndex(2)
    cache = PrefixCache(None, index.watcher(1))
    prompt = np.empty(0, dtype=np.int64)
    for turn in range(200):
        prompt = np.concatenate((prompt, np.arange(10 * turn, 10 * turn + 3)))
        cache.insert(prompt, now=turn)
    assert index.node_count() == 1
    assert index.matches(prompt) == [0, len(prompt)]


def test_evicting_everything_empties_the_index() -> None:
    index = HolderIndex(2)
    caches = [PrefixCache(None, index.watcher(i)) for i in range(2)]
    caches[0].insert(ids(1, 2, 3, 4), now=1)
    caches[1].insert(ids(1, 2, 5), now=2)
    caches[0].evict(2)
    assert index.matches(ids(1, 2, 3, 4)) == [2, 2]
    assert index.node_count() == 2  # (1, 2) and (5,); the tail (3, 4) went
    caches[1].evict(3)
    caches[0].evict(2)
    assert index.node_count() == 0
    assert index.matches(ids(1, 2, 5)) == [0, 0]


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 4), st.integers(0, 5), st.integers(0, 16)),
        st.tuples(st.just("lock"), st.integers(0, 4), st.integers(0, 5), st.integers(0, 16)),
        st.tuples(st.just("unlock"), st.integers(0, 4), st.integers(0, 20)),
        st.tuples(st.just("evict"), st.integers(0, 4), st.integers(0, 20)),
    ),
    max_size=60,
)


def probes(pool: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Every prefix of every pooled sequence, and each with its last id changed."""
    out = []
    for seq in pool:
        for n in range(len(seq) + 1):
            out.append(np.array(seq[:n], dtype=np.int64))
            if n:
                out.append(np.array((*seq[: n - 1], -1), dtype=np.int64))
    return out


@settings(max_examples=300, deadline=None)
@given(
    capacities=st.lists(st.one_of(st.none(), st.integers(0, 30)), min_size=1, max_size=5),
    pool=st.lists(TRIE_SEQUENCES, min_size=1, max_size=6),
    ops=OPS,
)
def test_index_matches_every_cache_after_every_operation(
    capacities: list[int | None], pool: list[tuple[int, ...]], ops: list[tuple]
) -> None:
    index = HolderIndex(len(capacities))
    caches = [PrefixCache(c, index.watcher(i)) for i, c in enumerate(capacities)]
    locks: list[list[Handle]] = [[] for _ in caches]
    universe = probes(pool)
    for now, op in enumerate(ops, start=1):
        which = op[1] % len(caches)
        cache = caches[which]
        if op[0] == "insert":
            cache.insert(np.array(pool[op[2] % len(pool)][: op[3]], dtype=np.int64), now)
        elif op[0] == "lock":
            seq = np.array(pool[op[2] % len(pool)], dtype=np.int64)
            locks[which].append(cache.lock(seq, min(op[3], cache.match(seq))))
        elif op[0] == "unlock":
            if locks[which]:
                cache.unlock(locks[which].pop(op[2] % len(locks[which])), now)
        else:
            cache.evict(op[2])
        for blocks in universe:
            assert index.matches(blocks) == [c.match(blocks) for c in caches]
