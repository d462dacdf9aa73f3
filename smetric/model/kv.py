"""The two KV tiers of the simulated cluster: each instance's GPU pool and the global tier.

The local pool holds blocks in two states, as vLLM's block manager does: *cached* blocks,
in the instance's prefix tree (shared, reusable, evictable unless a running request holds
them), and *private* blocks a running request is still filling (its uncached prompt and its
output). Both come out of one fixed budget of GPU blocks.

The global tier is one cluster-wide prefix store in CPU memory (Mooncake's store behind
LMCache in the paper's testbed). A transfer between an instance and the tier crosses two
links: the GPU's own PCIe lane to host memory and its server's RDMA NICs, which every GPU
of the server shares (``Route``). Fetches and writes of completed prefills queue on each
link first come, first served.
"""

from __future__ import annotations

import numpy as np

from smetric.core.prefix_cache import CacheWatcher, Handle, PrefixCache


class LocalPool:
    """An instance's GPU KV blocks: cached (in the prefix tree) plus private."""

    def __init__(self, capacity_blocks: int, watcher: CacheWatcher | None = None) -> None:
        self.capacity = capacity_blocks
        self.cache = PrefixCache(None, watcher)
        self.private = 0

    @property
    def free(self) -> int:
        return self.capacity - self.cache.size - self.private

    def reserve(self, blocks: int) -> bool:
        """Take private blocks, evicting cached blocks nobody holds if needed."""
        short = blocks - self.free
        if short > 0:
            self.cache.evict(short)
            if blocks > self.free:
                return False
        self.private += blocks
        return True

    def release(self, blocks: int) -> None:
        self.private -= blocks

    def publish(self, blocks: np.ndarray, held: Handle | None, private: int, now: float) -> Handle:
        """Move a finished prefill's private blocks into the tree, and pin its whole prompt.

        Blocks another request cached meanwhile are not added twice: the surplus private
        blocks are simply freed.
        """
        self.private -= private
        self.cache.insert(blocks, now)
        handle = self.cache.lock(blocks, len(blocks))
        if held is not None:
            self.cache.unlock(held, now)
        return handle


class GlobalTier:
    """The cluster's CPU-memory prefix store; ``capacity_blocks`` None means it never evicts."""

    def __init__(self, capacity_blocks: int | None) -> None:
        self.enabled = capacity_blocks != 0
        self.cache = PrefixCache(capacity_blocks)

    def match(self, blocks: np.ndarray) -> int:
        return self.cache.match(blocks) if self.enabled else 0

    def write(self, blocks: np.ndarray, now: float) -> int:
        """Store a completed prefill; returns the blocks that were new (what the link carries)."""
        return self.cache.insert(blocks, now) if self.enabled else 0


class Link:
    """One link (a PCIe lane, or a server's NICs together): transfers queue first come,
    first served, each paying ``setup_s`` before its bytes."""

    def __init__(self, bytes_per_s: float, setup_s: float = 0.0) -> None:
        self.bytes_per_s = bytes_per_s
        self.setup_s = setup_s
        self.busy_until = 0.0
        self.bytes_moved = 0.0

    def transfer(self, now: float, nbytes: float) -> float:
        """When a transfer of ``nbytes`` issued at ``now`` completes."""
        start = max(now, self.busy_until)
        self.busy_until = start + self.setup_s + nbytes / self.bytes_per_s
        self.bytes_moved += nbytes
        return self.busy_until


class Route:
    """An instance's way to the global tier: its private PCIe lane, then its server's NICs.

    The data streams through both links at once (cut-through), so a transfer is done when
    the slower of its two queues has carried it. ``bytes_moved`` counts what this instance
    moved, read off its private lane.
    """

    def __init__(self, pcie: Link, nic: Link) -> None:
        self.pcie = pcie
        self.nic = nic

    @property
    def bytes_moved(self) -> float:
        return self.pcie.bytes_moved

    def transfer(self, now: float, nbytes: float) -> float:
        """When a transfer of ``nbytes`` issued at ``now`` completes."""
        return max(self.pcie.transfer(now, nbytes), self.nic.transfer(now, nbytes))
