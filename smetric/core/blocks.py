"""Prompt tokens into chained block ids, and the tokenizers that produce the tokens.

The live router looks a request up in per-engine prefix indexes (``core/prefix_cache``),
which compare int64 block ids. An id must name a whole prefix, not just one block's tokens,
or two prompts sharing a block in different places would look alike; so each full block's
id hashes its predecessor's id together with its own tokens, as vLLM does. The hash must
also agree across processes and machines (several router replicas, a restarted router, a
trace written by one and replayed by another), which rules out Python's salted ``hash()``:
BLAKE2b cut to 8 bytes is in the standard library, stable, and fast enough that a
128k-token prompt costs milliseconds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np

_EMPTY = np.empty(0, dtype=np.int64)
_UINT32_LIMIT = 1 << 32


class Tokenizer(Protocol):
    """What the router needs of a tokenizer: text in, token ids out.

    ``encode`` must not add special tokens (no BOS): the rendered chat template already
    carries them, and the router encodes the history and the fresh part of a prompt
    separately, so a BOS added per call would land in the middle of the prompt.
    """

    name: str

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids: the fallback when no model tokenizer is configured.

    It needs no model files and keeps prefix structure exactly (a text prefix is a token
    prefix), which is all routing needs; counts run about four times a BPE tokenizer's, so
    the load and hit numbers it yields are in byte units, consistently for every request.
    """

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        # JSON may carry lone surrogates ("\ud800"), which strict UTF-8 refuses; passing
        # them through keeps distinct texts distinct instead of failing the request.
        return list(text.encode("utf-8", "surrogatepass"))


def chain_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, parent: int | None = None
) -> np.ndarray:
    """One int64 id per full block: ``h_i = BLAKE2b-64(h_{i-1} bytes || block tokens)``.

    The trailing partial block gets no id because an engine cannot reuse it either. The
    first block hashes its tokens alone, unless ``parent`` (the id of the block before
    ``token_ids``) is given, so that a prompt can be hashed in pieces:
    ``chain_hashes(t[k*b:], b, parent=h[k-1])`` equals ``h[k:]`` for ``h = chain_hashes(t, b)``.
    Tokens are hashed as little-endian uint32, the same bytes on every machine.
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
    data = memoryview(tokens.astype("<u4").tobytes())
    previous = b"" if parent is None else int(parent).to_bytes(8, "little", signed=True)
    stride = 4 * block_size
    digests = bytearray()
    blake2b = hashlib.blake2b
    for start in range(0, count * stride, stride):
        digest = blake2b(previous, digest_size=8)
        digest.update(data[start : start + stride])
        previous = digest.digest()
        digests += previous
    return np.frombuffer(digests, dtype="<i8").astype(np.int64)
