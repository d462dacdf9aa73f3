"""Salting: a keyed pseudo-random function over block ids and names, so that a recorded id
cannot be tested against guessed content without the deployment's salt.

Block ids go through SipHash-2-4 (Aumasson and Bernstein's keyed hash for short inputs,
the PRF behind Python's own string hashing), computed here over whole numpy arrays: a
request can carry thousands of new blocks, and a per-id call into ``hashlib`` costs about
a microsecond and a half of the interpreter's time each, which the router's event loop
would wait for. No library offers the function over arrays. Names (a session header, a
conversation's opening digest) are few per request and go through keyed BLAKE2b.
"""

from __future__ import annotations

import hashlib

import numpy as np

_INIT = (0x736F6D6570736575, 0x646F72616E646F6D, 0x6C7967656E657261, 0x7465646279746573)
# The final SipHash block of an 8-byte message: its length in the top byte.
_LENGTH_8 = np.uint64(8 << 56)


def _rotl(x: np.ndarray, bits: int) -> np.ndarray:
    return (x << np.uint64(bits)) | (x >> np.uint64(64 - bits))


def _rounds(v: list[np.ndarray], count: int) -> None:
    for _ in range(count):
        v[0] += v[1]
        v[1] = _rotl(v[1], 13) ^ v[0]
        v[0] = _rotl(v[0], 32)
        v[2] += v[3]
        v[3] = _rotl(v[3], 16) ^ v[2]
        v[0] += v[3]
        v[3] = _rotl(v[3], 21) ^ v[0]
        v[2] += v[1]
        v[1] = _rotl(v[1], 17) ^ v[2]
        v[2] = _rotl(v[2], 32)


def siphash24(key: bytes, words: np.ndarray) -> np.ndarray:
    """SipHash-2-4 under a 16-byte ``key`` of each element of ``words`` (int64, hashed as
    its 8 little-endian bytes), as int64."""
    if len(key) != 16:
        raise ValueError("SipHash takes a 16-byte key")
    k0 = np.uint64(int.from_bytes(key[:8], "little"))
    k1 = np.uint64(int.from_bytes(key[8:], "little"))
    m = np.ascontiguousarray(words, dtype="<i8").view(np.uint64)
    keys = (k0, k1, k0, k1)
    v = [np.full(m.shape, np.uint64(c) ^ k) for c, k in zip(_INIT, keys, strict=True)]
    v[3] ^= m
    _rounds(v, 2)
    v[0] ^= m
    v[3] ^= _LENGTH_8
    _rounds(v, 2)
    v[0] ^= _LENGTH_8
    v[2] ^= np.uint64(0xFF)
    _rounds(v, 4)
    return (v[0] ^ v[1] ^ v[2] ^ v[3]).view(np.int64)


class Salter:
    """The deployment's salt as two keys: SipHash for block ids, BLAKE2b for names."""

    def __init__(self, salt: bytes) -> None:
        self._block_key = hashlib.blake2b(salt, digest_size=16, person=b"smetric-blocks").digest()
        name_key = hashlib.blake2b(salt, digest_size=32, person=b"smetric-names").digest()
        self._names = hashlib.blake2b(key=name_key, digest_size=8)
        # Names this salt without revealing it: segments salted otherwise do not mix.
        self.salt_id = self.name("smetric-recording-salt-id").to_bytes(8, "big", signed=True).hex()

    def name(self, text: str) -> int:
        h = self._names.copy()
        h.update(text.encode("utf-8", "surrogatepass"))
        return int.from_bytes(h.digest(), "little", signed=True)

    def block_ids(self, ids: np.ndarray) -> np.ndarray:
        return siphash24(self._block_key, ids)
