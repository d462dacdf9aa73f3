"""A rendered prompt's tokens and block ids, segment by segment, memoised by content.

Agents resend their whole conversation on every call, so nearly all of a follow-up's prompt
was rendered, tokenised and hashed when the previous turn passed through the router. A
prompt is therefore handled as a sequence of segments (the rendered messages, cut where
tokenisation restarts) and ``BlockMemo`` remembers what each distinct run of leading
segments adds: its tokens and the block ids completed by them. A follow-up then costs a
lookup per earlier message and real work only for the new ones.

The memo is keyed by content, not by session: an entry's key is the exact text of its
segment and the entry for the segments before it, so two conversations share entries
exactly as far as their texts agree, any replica builds the same entries from the same
bodies, and nothing is ever looked up by a session id. It is bounded in bytes and evicts
least recently used entries; a lost entry only costs recomputation.

Each segment is encoded on its own with or without the memo, so memoised and uncached
results are equal by construction, which the tests check on arbitrary conversations.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, overload

import numpy as np

from smetric.core.blocks import Tokenizer, chained, token_array32

_EMPTY_TOKENS = np.empty(0, dtype=np.uint32)
_EMPTY_BLOCKS = np.empty(0, dtype=np.int64)
# Beside its arrays and text, what an entry costs: the node, the key tuple, the dict slot.
_ENTRY_OVERHEAD = 400
_ids = itertools.count(1)


class _Node(NamedTuple):
    """What a run of leading segments ends with: its last segment's tokens and new blocks,
    the running token count, and the chain state the next segment continues from."""

    # Unique for the process and never reused, so a key naming an evicted parent can never
    # be matched by a new entry.
    id: int
    tokens: np.ndarray
    blocks: np.ndarray
    end: int
    last: int | None  # id of the last full block so far, None before the first
    tail: np.ndarray  # tokens after the last full block, fewer than a block
    nbytes: int
    held: int  # the bytes of this node and of every node before it in its run

    def extend(self, text: str, tokenizer: Tokenizer, block_size: int) -> _Node:
        """The node for this node's segments followed by ``text``."""
        tokens = token_array32(tokenizer.encode(text))
        data = np.concatenate((self.tail, tokens)) if len(self.tail) else tokens
        blocks = chained(data, block_size, parent=self.last)
        last = int(blocks[-1]) if len(blocks) else self.last
        tail = data[len(blocks) * block_size :].copy()
        end = self.end + len(tokens)
        return _node(tokens, blocks, end, last, tail, sys.getsizeof(text), self.held)


def _node(
    tokens: np.ndarray,
    blocks: np.ndarray,
    end: int,
    last: int | None,
    tail: np.ndarray,
    text_bytes: int,
    before: int,
) -> _Node:
    nbytes = tokens.nbytes + blocks.nbytes + tail.nbytes + text_bytes + _ENTRY_OVERHEAD
    return _Node(next(_ids), tokens, blocks, end, last, tail, nbytes, before + nbytes)


_ROOT = _node(_EMPTY_TOKENS, _EMPTY_BLOCKS, 0, None, _EMPTY_TOKENS, 0, 0)


@dataclass(frozen=True, slots=True)
class Run:
    """Leading segments as hashed, to continue from without looking them up again: the
    segments (the very strings), their nodes, and their blocks joined."""

    segments: tuple[str, ...]
    nodes: tuple[_Node, ...]
    blocks: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + (self.nodes[-1].held - _ROOT.held if self.nodes else 0)

    def leading(self, segments: Sequence[str], block_size: int) -> Run:
        """The part of this run that ``segments`` start with (compared by identity first):
        a follow-up's rendering shares the previous one's segments up to where it parts."""
        count = 0
        for mine, theirs in zip(self.segments, segments, strict=False):
            if mine is not theirs and mine != theirs:
                break
            count += 1
        if count == len(self.segments):
            return self
        if count == 0:
            return _EMPTY_RUN
        # A node's tokens so far, less its tail, are whole blocks.
        last = self.nodes[count - 1]
        blocks = (last.end - len(last.tail)) // block_size
        return Run(self.segments[:count], self.nodes[:count], self.blocks[:blocks])


_EMPTY_RUN = Run((), (), _EMPTY_BLOCKS)


class TokenParts(Sequence[np.ndarray]):
    """A prompt's tokens per segment (uint32), read off its nodes when asked: only an engine
    asks, so a routed request never gathers them."""

    __slots__ = ("_nodes",)

    def __init__(self, nodes: Sequence[_Node]) -> None:
        self._nodes = nodes

    def __len__(self) -> int:
        return len(self._nodes)

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(index, slice):
            return [node.tokens for node in self._nodes[index]]
        return self._nodes[index].tokens


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt's block ids, and the nodes its segments hashed to: their tokens, the token
    count so far, and a ``Run`` of its leading segments."""

    blocks: np.ndarray
    nodes: list[_Node]

    @property
    def token_parts(self) -> TokenParts:
        return TokenParts(self.nodes)

    def tokens_in(self, segments: int) -> int:
        """The tokens of the first ``segments`` segments."""
        return self.nodes[segments - 1].end if segments else 0

    @property
    def tokens(self) -> int:
        return self.tokens_in(len(self.nodes))

    def run(self, segments: Sequence[str]) -> Run:
        """The run of ``segments``, which this prompt hashed."""
        return Run(tuple(segments), tuple(self.nodes), self.blocks)


class BlockMemo:
    """Bounded LRU of segment runs for one tokenizer and block size; safe across threads.

    A run's entries are touched from its last segment back to its first, so an entry is
    never older than the entries after it and eviction takes the ends of runs first.
    """

    def __init__(self, tokenizer: Tokenizer, block_size: int, max_bytes: int = 256 << 20) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, not {max_bytes}")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[int, str], _Node] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def held(self, segments: Sequence[str]) -> int:
        """How many leading ``segments`` the memo holds (they need no encoding)."""
        return len(self._known(segments))

    def _known(self, segments: Sequence[str], after: _Node = _ROOT) -> list[_Node]:
        """The entries of the longest run of leading segments held, after ``after``."""
        found: list[_Node] = []
        parent = after.id
        with self._lock:
            for text in segments:
                node = self._entries.get((parent, text))
                if node is None:
                    break
                found.append(node)
                parent = node.id
        return found

    def _keep(
        self, segments: Sequence[str], nodes: list[_Node], known: int, after: _Node = _ROOT
    ) -> None:
        """Add the new entries of a run (after ``after``), touch the whole run, evict
        down to the bound."""
        keys = [(parent.id, text) for parent, text in zip([after, *nodes], segments, strict=False)]
        entries = self._entries
        with self._lock:
            self.hits += known
            self.misses += len(nodes) - known
            for key, node in zip(keys[known:], nodes[known:], strict=True):
                if key not in entries and node.nbytes <= self.max_bytes:
                    entries[key] = node
                    self.nbytes += node.nbytes
            for key in reversed(keys):
                if key in entries:
                    entries.move_to_end(key)
            while self.nbytes > self.max_bytes:
                _, node = entries.popitem(last=False)
                self.nbytes -= node.nbytes


def hash_segments(
    segments: Sequence[str],
    tokenizer: Tokenizer,
    block_size: int,
    memo: BlockMemo | None = None,
    known: Run | None = None,
) -> PromptBlocks:
    """Tokens and chained block ids of ``"".join(segments)``, each segment encoded alone.

    With ``memo`` (made for the same tokenizer and block size) the leading segments it holds
    are not encoded or hashed again, and the new ones are remembered; the result is the same.
    ``known``, a run hashed before (with the same tokenizer and block size), lends the part
    these segments start with as it is (neither looked up nor touched in the memo): a
    follow-up's history costs nothing then.
    """
    if memo is not None and (memo.tokenizer is not tokenizer or memo.block_size != block_size):
        raise ValueError("the memo was made for another tokenizer or block size")
    run = known.leading(segments, block_size) if known is not None else _EMPTY_RUN
    rest = segments[len(run.segments) :]
    nodes = [] if memo is None else memo._known(rest, run.nodes[-1] if run.nodes else _ROOT)
    held = len(nodes)
    node = nodes[-1] if nodes else run.nodes[-1] if run.nodes else _ROOT
    for text in rest[held:]:
        node = node.extend(text, tokenizer, block_size)
        nodes.append(node)
    if memo is not None:
        memo._keep(rest, nodes, held, run.nodes[-1] if run.nodes else _ROOT)
    blocks = np.concatenate([run.blocks] + [n.blocks for n in nodes])
    return PromptBlocks(blocks, [*run.nodes, *nodes])
