"""Chained block ids: deterministic everywhere, equal exactly on equal prefixes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from smetric.core.blocks import ByteTokenizer, Tokenizer, chain_hashes, token_array32


def reference(tokens: list[int], block_size: int) -> list[int]:
    """The documented construction, written out independently of the implementation."""
    ids, previous = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + block_size])
        previous = xxhash.xxh3_64_intdigest(block, seed=previous)
        ids.append(previous - (1 << 64) if previous >= 1 << 63 else previous)
    return ids


def test_matches_the_documented_construction() -> None:
    tokens = [0, 1, 2, 3, 4, 5, 70000, 2**32 - 1, 9, 10]
    got = chain_hashes(tokens, 4)
    assert got.dtype == np.int64
    assert got.tolist() == reference(tokens, 4)


def test_known_value_pins_the_algorithm() -> None:
    # Changing the hash invalidates ids stored by other processes and traces: fail loudly.
    assert chain_hashes(list(range(16)), 16)[0] == 8773583392624668237


@pytest.mark.subprocess
def test_same_ids_in_a_fresh_process_with_another_hash_seed() -> None:
    code = (
        "from smetric.core.blocks import chain_hashes;"
        "print(chain_hashes(list(range(100)), 16).tolist())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == str(chain_hashes(list(range(100)), 16).tolist())


def test_equal_ids_exactly_on_equal_prefixes() -> None:
    rng = np.random.default_rng(7)
    base = rng.integers(0, 150_000, 160)
    other = base.copy()
    other[85] += 1  # inside block 5 of 16-token blocks
    a, b = chain_hashes(base, 16), chain_hashes(other, 16)
    assert (a[:5] == b[:5]).all()
    # The chain carries the difference into every later block, though their tokens agree.
    assert (a[5:] != b[5:]).all()
    # The same block content after a different prefix gets a different id.
    shifted = np.concatenate([base[16:32], base[16:32]])
    assert chain_hashes(shifted, 16)[1] != chain_hashes(base, 16)[1]


def test_only_full_blocks_and_input_types_agree() -> None:
    tokens = list(range(37))
    ids = chain_hashes(tokens, 16)
    assert len(ids) == 2
    assert (chain_hashes(tokens[:32], 16) == ids).all()
    for dtype in (np.int32, np.uint32, np.int64, np.uint16):
        assert (chain_hashes(np.array(tokens, dtype=dtype), 16) == ids).all()
    assert chain_hashes([], 16).shape == (0,)
    assert chain_hashes(tokens[:15], 16).dtype == np.int64


def test_resuming_from_a_parent_continues_the_chain() -> None:
    tokens = list(range(1000, 1100))
    ids = chain_hashes(tokens, 8)
    for k in (1, 3, 11):
        assert (chain_hashes(tokens[k * 8 :], 8, parent=int(ids[k - 1])) == ids[k:]).all()


@pytest.mark.parametrize(
    ("tokens", "block_size", "error"),
    [
        ([1, 2], 0, ValueError),
        ([-1, 2], 2, ValueError),
        ([2**32, 2], 2, ValueError),
        ([1.5, 2.0], 2, TypeError),
        ([[1, 2]], 1, ValueError),
    ],
)
def test_rejects_what_cannot_be_hashed_stably(
    tokens: list[object], block_size: int, error: type[Exception]
) -> None:
    with pytest.raises(error):
        chain_hashes(tokens, block_size)  # type: ignore[arg-type]


def test_byte_tokenizer_is_utf8_and_keeps_lone_surrogates() -> None:
    tokenizer: Tokenizer = ByteTokenizer()
    assert tokenizer.name == "bytes"
    assert list(tokenizer.encode("hé")) == [104, 0xC3, 0xA9]
    assert token_array32(tokenizer.encode("hé")).tolist() == [104, 0xC3, 0xA9]
    assert tokenizer.encode("a\ud800") != tokenizer.encode("a\ud801")


@pytest.mark.parametrize("tokens", [[-1], [5, 2**32], [2**70]])
def test_a_tokenizer_s_ids_outside_uint32_are_refused(tokens: list[int]) -> None:
    with pytest.raises(ValueError, match="2\\*\\*32"):
        token_array32(tokens)


def test_a_tokenizer_s_ids_become_little_endian_uint32_as_they_are() -> None:
    array = token_array32([0, 7, 2**32 - 1])
    assert array.dtype == np.dtype("<u4")
    assert array.tolist() == [0, 7, 2**32 - 1]
