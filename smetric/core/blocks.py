"""Prompt tokens into chained block ids, and the tokenizers that produce the tokens.

The live router looks a request up in per-engine prefix indexes (``core/prefix_cache``),
which compare int64 block ids. An id must name a whole prefix, not just one block's tokens,
or two prompts sharing a block in different places would look alike; so each full block's
id hashes its predecessor's id together with its own tokens, as vLLM does. The hash must
also agree across processes and machines (several router replicas, a restarted router, a
trace written by one and replayed by another), which rules out Python's salted ``hash()``.
XXH3-64 is stable across machines and fast: the chain takes one C call per block, with the
previous id as the seed, so a 128k-token prompt hashes in about a millisecond and a half
(BLAKE2b took six times that). Nothing here needs a cryptographic hash: a collision only
misroutes one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import xxhash

_EMPTY = np.empty(0, dtype=np.int64)
_UINT32_LIMIT = 1 << 32
_UINT64_MASK = (1 << 64) - 1


class Tokenizer(Protocol):
    """What the router needs of a tokenizer: text in, token ids out.

    ``encode`` must not add special tokens (no BOS): the rendered chat template already
    carries them, and the router encodes the history and the fresh part of a prompt
    separately, so a BOS added per call would land in the middle of the prompt.
    """

    name: str

    def encode(self, text: str) -> Sequence[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids: the fallback when no model tokenizer is configured.

    It needs no model files and keeps prefix structure exactly (a text prefix is a token
    prefix), which is all routing needs; counts run about four times a BPE tokenizer's, so
    the load and hit numbers it yields are in byte units, consistently for every request.
    """

    name = "bytes"

    def encode(self, text: str) -> bytes:
        # JSON may carry lone surrogates ("\ud800"), which strict UTF-8 refuses; passing
        # them through keeps distinct texts distinct instead of failing the request. Bytes
        # are a sequence of ints already, and ``token_array32`` reads them without a loop.
        return text.encode("utf-8", "surrogatepass")


def token_array32(tokens: Sequence[int]) -> np.ndarray:
    """A tokenizer's output as little-endian uint32 ids, the form blocks are hashed in;
    ids outside ``[0, 2**32)`` are refused."""
    if isinstance(tokens, bytes):
        return np.frombuffer(tokens, dtype=np.uint8).astype("<u4")
    try:
        # numpy converts Python ints straight to uint32, refusing those out of its range.
        return np.array(tokens, dtype="<u4")
    except OverflowError as error:
        raise ValueError("token ids must lie in [0, 2**32)") from error


def chain_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, parent: int | None = None
) -> np.ndarray:
    """One int64 id per full block: ``h_i = XXH3-64(block tokens, seed=h_{i-1})``.

    The trailing partial block gets no id because an engine cannot reuse it either. The
    first block is hashed with seed 0, unless ``parent`` (the id of the block before
    ``token_ids``) is given, so that a prompt can be hashed in pieces:
    ``chain_hashes(t[k*b:], b, parent=h[k-1])`` equals ``h[k:]`` for ``h = chain_hashes(t, b)``.
    Tokens are hashed as little-endian uint32, the same bytes on every machine, and ids are
    the 64-bit digests read as signed integers.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {tokens.shape}")
    if len(tokens) == 0:  # np.asarray([]) is float64, so the dtype check must wait
        return _EMPTY.copy()
    if not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got dtype {tokens.dtype}")
    count = len(tokens) // block_size
    if count == 0:
        return _EMPTY.copy()
    tokens = tokens[: count * block_size]
    if int(tokens.min()) < 0 or int(tokens.max()) >= _UINT32_LIMIT:
        raise ValueError("token ids must lie in [0, 2**32)")
    return chained(tokens.astype("<u4"), block_size, parent)


def chained(tokens: np.ndarray, block_size: int, parent: int | None = None) -> np.ndarray:
    """``chain_hashes`` of ``tokens`` already little-endian uint32, unchecked: for the
    router's own arrays, which a tokenizer made, on every request."""
    count = len(tokens) // block_size
    if count == 0:
        return _EMPTY.copy()
    data = tokens[: count * block_size].tobytes()
    seed = 0 if parent is None else int(parent) & _UINT64_MASK
    stride = 4 * block_size
    ids = [0] * count
    xxh3 = xxhash.xxh3_64_intdigest
    for i in range(count):
        seed = xxh3(data[i * stride : (i + 1) * stride], seed)
        ids[i] = seed
    return np.array(ids, dtype=np.uint64).view(np.int64)


def reusable_hit_blocks(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """The leading prompt blocks an instance can take from its cache, given how many it
    holds: never the whole prompt, because vLLM computes at least the last prompt token
    to produce the first output token. The router's prediction, the simulator's view and
    scheduler, and the mock engine all cap a hit this way, so they agree."""
    return min(matched_blocks, max(prompt_tokens - 1, 0) // block_size)


def reusable_hit_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """``reusable_hit_blocks`` in tokens: the hit a policy sees."""
    return reusable_hit_blocks(matched_blocks, prompt_tokens, block_size) * block_size
