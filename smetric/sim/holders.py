"""Which instances hold which prefixes: routing's per-instance hits in one tree walk.

Routing needs every instance's local-tier hit for each request. Asking each instance's
prefix tree costs a walk per instance, so a request's cost grew with the cluster even
though only the few instances that served its session hold more than the shared system
prompt. ``HolderIndex`` keeps the union of the routed instances' prefix trees as one radix
tree whose nodes are marked with the instances that hold all of them (a bitmask), kept
exact by the caches' ``CacheWatcher`` calls. One walk down the request's path then gives
every instance's hit: an instance's hit is the depth at which its bit leaves the path.

Invariants the code keeps:

- The tree is a trie over block ids, so a path of ids has one place in it whatever the
  instance; an instance's held prefixes are exactly the paths to the nodes carrying its
  bit. Each instance's holdings end on node boundaries (updates split where they end).
- A child's mask is a subset of its parent's (each cache is prefix-closed); a node whose
  mask empties goes, with its subtree, which is then empty too.
- A node with one child of the same mask is merged with it, so a session that grows on one
  instance stays one node, and the nodes on a path are about the distinct places where its
  holders' prefixes end.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from smetric.core.prefix_cache import CacheWatcher

_EMPTY = np.empty(0, dtype=np.int64)


class _Node:
    """One edge and the node it leads to; ``mask`` has bit i set when instance i holds it."""

    __slots__ = ("children", "key", "mask", "parent", "run")

    def __init__(self, run: np.ndarray, parent: _Node | None, mask: int) -> None:
        self.run = run
        self.key = int(run[0]) if len(run) else 0
        self.parent = self if parent is None else parent
        self.children: dict[int, _Node] = {}
        self.mask = mask


class HolderIndex:
    """The routed instances' cached prefixes together, each node marked with its holders."""

    def __init__(self, instances: int) -> None:
        self.instances = instances
        self._root = _Node(_EMPTY, None, 0)

    def watcher(self, instance: int) -> CacheWatcher:
        """What instance ``instance``'s cache reports its changes to."""
        return _InstanceWatcher(self, 1 << instance)

    def per_instance(self, blocks: np.ndarray, value: Callable[[int], int]) -> list[int]:
        """``value(matched blocks)`` for each instance, in instance order.

        ``value`` is called once per distinct hit, not once per instance.
        """
        out = np.full(self.instances, value(0), dtype=np.int64)
        for mask, depth in self._levels(np.asarray(blocks, dtype=np.int64)):
            if mask and depth:
                out[self._members(mask)] = value(depth)
        return out.tolist()

    def matches(self, blocks: np.ndarray) -> list[int]:
        """Each instance's matched leading blocks, as its own cache's ``match`` says."""
        return self.per_instance(blocks, int)

    def node_count(self) -> int:
        """Nodes besides the root: how many places the holders' prefixes branch or end."""
        count, stack = 0, [self._root]
        while stack:
            node = stack.pop()
            count += len(node.children)
            stack.extend(node.children.values())
        return count

    def _levels(self, blocks: np.ndarray) -> list[tuple[int, int]]:
        """(instances whose hit is ``depth``, ``depth``) for the depths where bits leave."""
        levels = []
        node, mask, i, n = self._root, 0, 0, len(blocks)
        while i < n:
            child = node.children.get(int(blocks[i]))
            if child is None:
                break
            levels.append((mask & ~child.mask, i))
            mask = child.mask
            run = child.run
            k = min(len(run), n - i)
            head, window = run[:k], blocks[i : i + k]
            if head.tobytes() != window.tobytes():
                i += int((head != window).argmax())
                break
            i += k
            if k < len(run):
                break
            node = child
        levels.append((mask, i))
        return levels

    def _members(self, mask: int) -> np.ndarray:
        """The instance numbers whose bits ``mask`` sets, as a boolean selector."""
        raw = np.frombuffer(mask.to_bytes((self.instances + 7) // 8, "little"), np.uint8)
        return np.unpackbits(raw, count=self.instances, bitorder="little").view(bool)

    def grew(self, bit: int, blocks: np.ndarray, length: int) -> None:
        """The instance of ``bit`` now holds ``blocks[:length]``."""
        node, i = self._root, 0
        while i < length:
            child = node.children.get(int(blocks[i]))
            if child is None:
                child = _Node(blocks[i:length].copy(), node, bit)
                node.children[child.key] = child
                node = child
                break
            run = child.run
            k = min(len(run), length - i)
            head, window = run[:k], blocks[i : i + k]
            j = k if head.tobytes() == window.tobytes() else int((head != window).argmax())
            if j < len(run):
                child = self._split(child, j)
            child.mask |= bit
            i += j
            node = child
        self._compact_path(node)

    def shrank(self, bit: int, path: np.ndarray, keep: int) -> None:
        """The instance of ``bit`` held ``path`` as a leaf and now holds only ``path[:keep]``."""
        node, i = self._root, 0
        while i < keep:
            node = node.children[int(path[i])]
            i += len(node.run)
        if i > keep:
            if node.mask == bit and not node.children:
                # Only this instance holds the node, so it is the path's last: cut it short.
                node.run = node.run[: len(node.run) - (i - keep)]
                return
            node, i = self._split(node, len(node.run) - (i - keep)), keep
        while i < len(path):
            child = node.children[int(path[i])]
            child.mask &= ~bit
            if not child.mask:
                del node.children[child.key]
                break
            i += len(child.run)
            node = child
        # From the deepest node left on the path: each node on it may now merge.
        self._compact_path(node)

    def _split(self, node: _Node, offset: int) -> _Node:
        """Cut ``node``'s edge after ``offset`` blocks; returns the new upper node."""
        parent = node.parent
        top = _Node(node.run[:offset], parent, node.mask)
        parent.children[top.key] = top
        node.run = node.run[offset:]
        node.key = int(node.run[0])
        node.parent = top
        top.children[node.key] = node
        return top

    def _compact_path(self, node: _Node) -> None:
        """Merge what the last update made mergeable, from ``node`` up to the root."""
        while node is not self._root:
            parent = node.parent
            while len(node.children) == 1:
                (child,) = node.children.values()
                if child.mask != node.mask:
                    break
                node.run = np.concatenate((node.run, child.run))
                node.children = child.children
                for grandchild in node.children.values():
                    grandchild.parent = node
            node = parent


class _InstanceWatcher:
    """One instance's cache, reporting to the shared index under its own bit."""

    __slots__ = ("bit", "index")

    def __init__(self, index: HolderIndex, bit: int) -> None:
        self.index = index
        self.bit = bit

    def grew(self, blocks: np.ndarray, length: int) -> None:
        self.index.grew(self.bit, blocks, length)

    def shrank(self, path: np.ndarray, keep: int) -> None:
        self.index.shrank(self.bit, path, keep)
