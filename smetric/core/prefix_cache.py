"""The KV prefix cache every driver shares: a radix tree of block-id runs with LRU eviction.

The simulator's per-instance local tier and its global CPU tier, the live router's
approximate per-engine index and the mock engine all answer the same two questions: how
many leading blocks of this request are cached, and what goes when room is needed. One
structure answers both so the drivers cannot drift apart.

Agentic prompts are thousands of blocks long and each turn re-sends the previous one, so
a per-block dictionary costs thousands of Python operations a request. Here each tree edge
holds a numpy run of block ids and runs are compared with one vectorised comparison, so a
request costs work proportional to the edges it touches. A session that keeps extending
its leaf extends that leaf's run in place and stays a one-node path however many turns it
has.

Invariants the code keeps:

- The cache is prefix-closed: a block is present only with its whole prefix. Eviction
  therefore takes blocks from the end of a leaf's run, never from the middle of a path.
- Locks count per node and cover whole nodes (``lock`` splits an edge so that exactly the
  requested prefix is pinned). A node is locked whenever any of its descendants is, so
  every unlocked block can be reached by repeatedly evicting leaves: ``evict`` frees
  ``min(n, size - locked)`` blocks, exactly.
- Recency is per node, and a path is touched as a whole, so a parent is never older than
  its child; it is newer when it was used later without that child (through another
  branch, a hit on the shared prefix alone, a lock that ends there). Eviction is exact LRU
  at node granularity: a leaf's run goes when its time is the oldest, and an inner node
  waits for its subtree, as prefix-closure demands. A partly matched edge is touched
  whole rather than split.
- An unlocked node other than the root whose only child is as recent as itself is merged
  with that child, so a session that grows turn after turn stays one node. A newer parent
  is kept apart from its child: merging would lose its later use.
- Locked nodes are never merged, truncated or removed, and a split keeps the existing
  node as the lower half, which is what keeps a ``Handle`` valid.
- Eviction order depends only on the sequence of calls (ties in time go to the node whose
  heap entry was pushed first), never on dict order or object ids.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Protocol

import numpy as np

_EMPTY = np.empty(0, dtype=np.int64)


class _Node:
    """One edge of the tree and the node it leads to; ``run`` is never mutated in place.

    Runs are replaced rather than written to, so splitting an edge can hand out views of
    the old run without copying it.
    """

    __slots__ = ("children", "entry", "key", "last_access", "lock_count", "parent", "run")

    def __init__(self, run: np.ndarray, parent: _Node | None, last_access: float) -> None:
        self.run = run
        self.key = int(run[0]) if len(run) else 0
        # The root is its own parent, so that walks up a path need no None checks.
        self.parent = self if parent is None else parent
        self.children: dict[int, _Node] = {}
        self.last_access = last_access
        self.lock_count = 0
        # Counter of this node's latest heap entry, -1 once dead. A leaf gets a fresh entry
        # whenever its time changes or it becomes evictable, so older ones are stale.
        self.entry = -1


class Handle:
    """A pin on the first ``length`` blocks of a sequence, from ``PrefixCache.lock``.

    It keeps the deepest pinned node rather than the blocks: a split keeps the existing
    node as the lower half, and pinned nodes are never merged, truncated or removed, so the
    node marks the same prefix for as long as the lock lives.
    """

    __slots__ = ("_node", "length")

    def __init__(self, node: _Node, length: int) -> None:
        self._node: _Node | None = node
        self.length = length


class CacheWatcher(Protocol):
    """Told every change of which prefixes a cache holds, in the order they happen.

    A cluster-wide index of the caches' contents (the simulator's ``HolderIndex``) keeps
    itself exact from these two calls alone.
    """

    def grew(self, blocks: np.ndarray, length: int) -> None:
        """``blocks[:length]`` is now held, and was not wholly held before."""

    def shrank(self, path: np.ndarray, keep: int) -> None:
        """A leaf's tail went: of the held path ``path``, only ``path[:keep]`` is left."""


class PrefixCache:
    """Present block-id prefixes, least recently used unlocked tails evicted first.

    ``capacity_blocks=None`` never evicts on its own (the fully provisioned global tier);
    ``evict`` still works on it. A ``watcher`` hears of every block added or evicted.
    """

    __slots__ = (
        "_capacity",
        "_counter",
        "_heap",
        "_locked",
        "_nodes",
        "_root",
        "_size",
        "_watcher",
    )

    def __init__(self, capacity_blocks: int | None, watcher: CacheWatcher | None = None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0 or None, not {capacity_blocks}")
        self._capacity = capacity_blocks
        self._watcher = watcher
        self._root = _Node(_EMPTY, None, float("-inf"))
        self._size = 0
        self._locked = 0
        self._nodes = 0
        # (last_access, push counter, node): stale entries are skipped when popped.
        self._heap: list[tuple[float, int, _Node]] = []
        self._counter = 0

    @property
    def size(self) -> int:
        """Blocks held."""
        return self._size

    @property
    def locked(self) -> int:
        """Blocks pinned by at least one lock; ``size - locked`` is what eviction can free."""
        return self._locked

    @property
    def capacity(self) -> int | None:
        return self._capacity

    @property
    def node_count(self) -> int:
        """Tree nodes besides the root: how fragmented the cached prefixes are."""
        return self._nodes

    def match(self, blocks: np.ndarray | Sequence[int]) -> int:
        """How many leading blocks are present. Pure: routing may probe every instance."""
        blocks = _as_blocks(blocks)
        return self._descend(blocks, len(blocks))[1]

    def insert(self, blocks: np.ndarray | Sequence[int], now: float) -> int:
        """Make ``blocks`` present, evicting LRU tails to fit; returns how many were added.

        The already present prefix is pinned while evicting, so an insert never evicts its
        own prefix. When even evicting every unlocked block leaves too little room, only the
        longest prefix that fits is added: ``match(blocks)`` afterwards says how far it got.
        The whole present path, new part included, gets recency ``now``.
        """
        blocks = _as_blocks(blocks)
        node, matched, offset = self._descend(blocks, len(blocks))
        fit = 0
        if matched < len(blocks):
            node, fit = self._grow(node, offset, blocks[matched:])
            if fit and self._watcher is not None:
                self._watcher.grew(blocks, matched + fit)
        self._touch(node, now)
        self._compact_path(node)
        return fit

    def lock(self, blocks: np.ndarray | Sequence[int], n: int) -> Handle:
        """Pin the first ``n`` blocks of ``blocks`` (all present) against eviction.

        Locks nest: a block stays pinned until every lock covering it is released.
        """
        blocks = _as_blocks(blocks)
        if not 0 <= n <= len(blocks):
            raise ValueError(f"cannot lock {n} blocks of a {len(blocks)}-block sequence")
        node, matched, offset = self._descend(blocks, n)
        if matched < n:
            raise ValueError(f"only {matched} of the {n} blocks to lock are present")
        if offset < len(node.run):
            node = self._split(node, offset)
        self._retain(node)
        return Handle(node, n)

    def unlock(self, handle: Handle, now: float) -> None:
        """Release a lock; its path gets recency ``now`` (the request just finished with it)."""
        node = handle._node
        if node is None:
            raise ValueError("this handle is already unlocked")
        handle._node = None
        self._release(node)
        self._touch(node, now)
        self._compact_path(node)

    def evict(self, n: int) -> int:
        """Free up to ``n`` unlocked blocks, LRU leaf tails first; returns how many."""
        return self._evict(n) if n > 0 else 0

    def _descend(self, blocks: np.ndarray, limit: int) -> tuple[_Node, int, int]:
        """Follow ``blocks[:limit]``: (last node entered, blocks matched, its run matched)."""
        node = self._root
        i = 0
        while i < limit:
            child = node.children.get(int(blocks[i]))
            if child is None:
                break
            run = child.run
            k = min(len(run), limit - i)
            head, window = run[:k], blocks[i : i + k]
            # Equality by memcmp is a few times cheaper than an elementwise compare, which
            # is left for finding where a mismatching run diverges.
            if head.tobytes() != window.tobytes():
                j = int((head != window).argmax())
                return child, i + j, j
            i += k
            if k < len(run):
                return child, i, k
            node = child
        return node, i, len(node.run)

    def _grow(self, node: _Node, offset: int, new: np.ndarray) -> tuple[_Node, int]:
        """Add as much of ``new`` as fits after ``node.run[:offset]``: (its node, count)."""
        if offset < len(node.run):
            node = self._split(node, offset)
        fit = len(new)
        if self._capacity is not None:
            excess = self._size + fit - self._capacity
            if excess > 0:
                # Pin the present prefix so that making room for its tail never evicts it.
                self._retain(node)
                self._evict(excess)
                self._release(node)
            fit = min(fit, self._capacity - self._size)
        if fit:
            if node is not self._root and not node.children and node.lock_count == 0:
                node.run = np.concatenate((node.run, new[:fit]))
            else:
                node = self._add_child(node, new[:fit].copy())
            self._size += fit
        return node, fit

    def _split(self, node: _Node, offset: int) -> _Node:
        """Cut ``node``'s edge after ``offset`` blocks and return the new upper node.

        The existing object stays the lower half so that handles to it keep their meaning;
        the upper half inherits its locks, since every lock through ``node`` passes it.
        """
        parent = node.parent
        top = _Node(node.run[:offset], parent, node.last_access)
        top.lock_count = node.lock_count
        parent.children[top.key] = top
        node.run = node.run[offset:]
        node.key = int(node.run[0])
        node.parent = top
        top.children[node.key] = node
        self._nodes += 1
        return top

    def _add_child(self, parent: _Node, run: np.ndarray) -> _Node:
        child = _Node(run, parent, parent.last_access)
        parent.children[child.key] = child
        self._nodes += 1
        return child

    def _touch(self, node: _Node, now: float) -> None:
        """Give the path to ``node`` recency ``now``; only ``node`` can be a leaf on it."""
        x = node
        while x is not self._root:
            x.last_access = now
            x = x.parent
        if node is not self._root and not node.children and node.lock_count == 0:
            self._push(node)

    def _retain(self, node: _Node) -> None:
        x = node
        while x is not self._root:
            if x.lock_count == 0:
                self._locked += len(x.run)
            x.lock_count += 1
            x = x.parent

    def _release(self, node: _Node) -> None:
        x = node
        while x is not self._root:
            x.lock_count -= 1
            if x.lock_count == 0:
                self._locked -= len(x.run)
            x = x.parent

    def _push(self, node: _Node) -> None:
        self._counter += 1
        node.entry = self._counter
        heapq.heappush(self._heap, (node.last_access, self._counter, node))
        if len(self._heap) > 2 * self._nodes + 64:
            # Re-touched leaves leave stale entries behind; drop them before they dominate.
            self._heap = [e for e in self._heap if _evictable(e)]
            heapq.heapify(self._heap)

    def _evict(self, n: int) -> int:
        freed = 0
        heap = self._heap
        while freed < n and heap:
            entry = heap[0]
            if not _evictable(entry):
                heapq.heappop(heap)
                continue
            node = entry[2]
            length = len(node.run)
            take = min(length, n - freed)
            freed += take
            if self._watcher is not None:
                path = self._path(node)
                self._watcher.shrank(path, len(path) - take)
            if take < length:
                # The entry stays valid: same node, same recency, just a shorter run.
                node.run = node.run[: length - take]
                break
            heapq.heappop(heap)
            self._remove_leaf(node)
        self._size -= freed
        return freed

    def _path(self, node: _Node) -> np.ndarray:
        """The block ids from the root to the end of ``node``'s run."""
        runs = []
        while node is not self._root:
            runs.append(node.run)
            node = node.parent
        return np.concatenate(runs[::-1])

    def _remove_leaf(self, node: _Node) -> None:
        parent = node.parent
        del parent.children[node.key]
        node.entry = -1
        self._nodes -= 1
        if parent is not self._root and parent.lock_count == 0:
            if not parent.children:
                self._push(parent)
            elif _mergeable(parent):
                self._merge(parent)

    def _merge(self, node: _Node) -> None:
        """Absorb ``node``'s only child, which is no older than ``node`` itself."""
        (child,) = node.children.values()
        node.run = np.concatenate((node.run, child.run))
        node.children = child.children
        for grandchild in node.children.values():
            grandchild.parent = node
        node.last_access = child.last_access
        child.entry = -1
        self._nodes -= 1
        if not node.children:
            self._push(node)

    def _compact_path(self, node: _Node) -> None:
        """Merge what can be merged on the path to ``node``.

        Needed after an unlock (a lock-split edge or a child grown under a locked leaf can
        now be joined) and after an insert (its pinned path could not merge while evicting).
        """
        x = node
        while x is not self._root:
            parent = x.parent
            while _mergeable(x):
                self._merge(x)
            x = parent


def _mergeable(node: _Node) -> bool:
    """Whether ``node`` can absorb its child without changing any block's recency."""
    if node.lock_count or len(node.children) != 1:
        return False
    (child,) = node.children.values()
    return child.last_access >= node.last_access


def _evictable(entry: tuple[float, int, _Node]) -> bool:
    node = entry[2]
    return node.entry == entry[1] and not node.children and node.lock_count == 0


def _as_blocks(blocks: np.ndarray | Sequence[int]) -> np.ndarray:
    blocks = np.asarray(blocks, dtype=np.int64)
    if blocks.ndim != 1:
        raise ValueError(f"blocks must be one-dimensional, not of shape {blocks.shape}")
    return blocks
