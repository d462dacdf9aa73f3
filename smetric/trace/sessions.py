"""Session structure for traces that record none (Mooncake): *inferred*, not observed.

A chat turn re-sends the whole conversation so far, so its prefix blocks repeat those of
the previous turn. Request B is taken to continue an earlier request A when B's block ids
start with all of A's ids except A's last one::

    B.ids[:len(A) - 1] == A.ids[:-1]

A's last block is left out because it may be partial: the next turn appends to it, which
changes its content and so its id.

Many unrelated conversations start with the same system prompt (in Mooncake, block 0 opens
most requests), and matching on it alone would chain them into one giant session. A match is
therefore accepted only when the matched prefix ``A.ids[:-1]`` has at least
``MIN_MATCH_BLOCKS`` blocks *and* holds at least one block first seen in A's own inferred
session: content the conversation wrote itself, not a popular shared prefix.

Among the candidates the longest match wins; on a tie, the most recent A (the conversation's
latest turn). Candidates are found through a hash of every eligible request's prefix
``A.ids[:-1]``, one table per prefix length, so each request costs one lookup per block it
holds instead of a scan over all earlier requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from smetric.core.errors import UserError

MIN_MATCH_BLOCKS = 2

# Random odd per-position weights: the prefix hash is a weighted sum of (id + 1), so equal
# prefixes hash equal and different ones collide with probability about 2**-64. A match
# found through the hash is still compared block by block before it is accepted.
_HASH_SEED = 0x5E55_1015


class ParentCycleError(UserError):
    """A parent chain that loops back on itself; ``index`` is a request on the loop."""

    def __init__(self, index: int) -> None:
        self.index = index
        super().__init__(f"request {index} is its own ancestor")


def infer_sessions(
    block_ids: Sequence[np.ndarray] | np.ndarray, offsets: np.ndarray | None = None
) -> np.ndarray:
    """Parent index of each request (-1 for a session's first), requests in issue order.

    ``block_ids`` is either one id array per request or, with ``offsets``, the flat array
    of all ids where request ``i`` holds ``block_ids[offsets[i]:offsets[i + 1]]`` (the form
    ``Trace.block_arrays`` returns).
    """
    flat, offsets = _flatten(block_ids) if offsets is None else (block_ids, offsets)
    flat = np.asarray(flat, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    hashes = _prefix_hashes(flat, offsets).tolist()
    ids = flat.tolist()
    bounds = offsets.tolist()
    n = len(bounds) - 1
    parents = [-1] * n
    session = [0] * n
    first_session: dict[int, int] = {}
    # by_length[k][hash of a prefix of k blocks] = latest eligible request with len == k + 1
    by_length: dict[int, dict[int, int]] = {}
    for i in range(n):
        start, end = bounds[i], bounds[i + 1]
        parent = _best_parent(ids, bounds, hashes, by_length, start, end)
        parents[i] = parent
        own = session[parent] if parent >= 0 else i
        session[i] = own
        for block in ids[start:end]:
            first_session.setdefault(block, own)
        matchable = end - start - 1
        if matchable >= MIN_MATCH_BLOCKS and any(
            first_session[block] == own for block in ids[start : end - 1]
        ):
            by_length.setdefault(matchable, {})[hashes[end - 2]] = i
    return np.asarray(parents, dtype=np.int64)


def _best_parent(
    ids: list[int],
    bounds: list[int],
    hashes: list[int],
    by_length: dict[int, dict[int, int]],
    start: int,
    end: int,
) -> int:
    """The eligible earlier request whose ``ids[:-1]`` is the longest prefix of this one."""
    for k in range(end - start, MIN_MATCH_BLOCKS - 1, -1):
        table = by_length.get(k)
        if table is None:
            continue
        candidate = table.get(hashes[start + k - 1])
        if candidate is None:
            continue
        other = bounds[candidate]
        if ids[other : other + k] == ids[start : start + k]:
            return candidate
    return -1


def _flatten(block_ids: Sequence[np.ndarray] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(b) for b in block_ids), dtype=np.int64, count=len(block_ids))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    arrays = [np.asarray(b, dtype=np.int64) for b in block_ids]
    flat = np.concatenate(arrays) if offsets[-1] else np.empty(0, np.int64)
    return flat, offsets


def _prefix_hashes(flat: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``out[offsets[i] + k - 1]`` hashes the first ``k`` ids of request ``i``."""
    lengths = np.diff(offsets)
    starts = np.repeat(offsets[:-1], lengths)
    position = np.arange(len(flat), dtype=np.int64) - starts
    longest = int(lengths.max(initial=0))
    weights = np.random.default_rng(_HASH_SEED).integers(
        0, np.iinfo(np.uint64).max, size=longest, dtype=np.uint64, endpoint=True
    )
    weights |= np.uint64(1)
    terms = (flat.view(np.uint64) + np.uint64(1)) * weights[position]
    running = np.concatenate([np.zeros(1, np.uint64), np.cumsum(terms, dtype=np.uint64)])
    return running[1:] - running[starts]


def chain_roots(parents: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Root index and depth (0 for a root) of every request, following ``parents``.

    Parents may come after their children in the array, so chains are walked rather than
    assumed to be in order; a loop raises ``ParentCycleError``.
    """
    parent_of = np.asarray(parents, dtype=np.int64).tolist()
    n = len(parent_of)
    roots = [-1] * n
    depths = [-1] * n
    for i in range(n):
        path: list[int] = []
        on_path: set[int] = set()
        node = i
        while roots[node] < 0:
            if parent_of[node] < 0:
                roots[node], depths[node] = node, 0
                break
            if node in on_path:
                raise ParentCycleError(node)
            path.append(node)
            on_path.add(node)
            node = parent_of[node]
        root, depth = roots[node], depths[node]
        for node in reversed(path):
            depth += 1
            roots[node], depths[node] = root, depth
    return np.asarray(roots, dtype=np.int64), np.asarray(depths, dtype=np.int64)
