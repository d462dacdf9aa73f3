"""KV-event decoding, the exact index built from events, and sequence checking."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import numpy as np
import pytest

from smetric.core.blocks import chain_hashes
from smetric.core.kv_events import (
    REPLAY_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventIndex,
    KVEventError,
    SequenceCheck,
    SequenceTracker,
    decode_batch,
    in_slices,
    parse_sequence,
)

from conftest import block_stored

BS = 4
TOKENS = list(range(100, 124))  # six blocks of four


def stored_map(hashes: list[Any], parent: Any, tokens: list[int], medium: Any = "GPU") -> dict:
    return block_stored(hashes, parent, tokens, BS, medium)


def stored_array(hashes: list[Any], parent: Any, tokens: list[int], medium: Any = "GPU") -> list:
    """A BlockStored as array_like releases encode it: tag, then fields in order."""
    return ["BlockStored", hashes, parent, tokens, BS, None, medium]


def removed_map(hashes: list[Any], medium: Any = "GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def removed_array(hashes: list[Any], medium: Any = "GPU") -> list:
    return ["BlockRemoved", hashes, medium]


FORMS = {
    "map": (stored_map, removed_map, {"type": "AllBlocksCleared"}),
    "array": (stored_array, removed_array, ["AllBlocksCleared"]),
}


def payload(events: list[Any], form: str, ts: float = 1.5, dp_rank: int | None = 0) -> bytes:
    if form == "map":
        batch: Any = {"ts": ts, "events": events, "data_parallel_rank": dp_rank}
    else:
        batch = [ts, events, dp_rank]
    return msgspec.msgpack.encode(batch)


def feed(index: EventIndex, events: list[Any], form: str) -> None:
    index.apply(decode_batch(payload(events, form)).events)


def request(tokens: list[int]) -> np.ndarray:
    return chain_hashes(tokens, BS)


@pytest.mark.parametrize("form", FORMS)
def test_decode_both_forms(form: str) -> None:
    stored, removed, cleared = FORMS[form]
    batch = decode_batch(
        payload(
            [stored([b"\x01", b"\x02"], None, TOKENS[:8]), removed([7], "CPU"), cleared],
            form,
            dp_rank=3,
        )
    )
    assert batch.timestamp == 1.5
    assert batch.dp_rank == 3
    assert batch.skipped == 0
    assert batch.events == (
        BlockStored((b"\x01", b"\x02"), None, tuple(TOKENS[:8]), BS, "GPU"),
        BlockRemoved((7,), "CPU"),
        AllBlocksCleared(),
    )


def test_decode_accepts_old_short_forms() -> None:
    """Releases before ``medium`` existed, and a batch without a dp rank."""
    old = ["BlockStored", [1], None, TOKENS[:4], BS, None]
    batch = decode_batch(msgspec.msgpack.encode([2.0, [old, ["BlockRemoved", [1]]]]))
    assert batch.dp_rank is None
    assert batch.events == (
        BlockStored((1,), None, tuple(TOKENS[:4]), BS, None),
        BlockRemoved((1,), None),
    )


@pytest.mark.parametrize("form", FORMS)
def test_stored_blocks_match_request_keys(form: str) -> None:
    stored, _, _ = FORMS[form]
    index = EventIndex(BS)
    feed(index, [stored([b"a1", b"a2", b"a3"], None, TOKENS[:12])], form)
    assert index.match(request(TOKENS)) == 3
    assert index.size() == 3
    # A second batch continues the chain from the first batch's last block.
    feed(index, [stored([b"a4", b"a5"], b"a3", TOKENS[12:20])], form)
    assert index.match(request(TOKENS)) == 5
    # A prompt diverging inside block 2 shares only the first two blocks.
    other = [*TOKENS[:9], 0, *TOKENS[10:]]
    assert index.match(request(other)) == 2


@pytest.mark.parametrize("form", FORMS)
def test_removed_tail_block_shortens_match(form: str) -> None:
    stored, removed, _ = FORMS[form]
    index = EventIndex(BS)
    feed(index, [stored([1, 2, 3, 4], None, TOKENS[:16])], form)
    feed(index, [removed([4])], form)
    assert index.match(request(TOKENS)) == 3
    # A hole in the middle ends the match there, as it ends the engine's lookup.
    feed(index, [removed([2])], form)
    assert index.match(request(TOKENS)) == 1
    assert index.size() == 2


@pytest.mark.parametrize("form", FORMS)
def test_all_blocks_cleared(form: str) -> None:
    stored, _, cleared = FORMS[form]
    index = EventIndex(BS)
    feed(index, [stored([1, 2], None, TOKENS[:8]), cleared], form)
    assert index.match(request(TOKENS)) == 0
    assert index.size() == 0


@pytest.mark.parametrize("form", FORMS)
def test_cpu_medium_is_not_gpu(form: str) -> None:
    stored, removed, _ = FORMS[form]
    index = EventIndex(BS)
    feed(index, [stored([1, 2], None, TOKENS[:8], medium="CPU")], form)
    assert index.match(request(TOKENS)) == 0
    assert index.match(request(TOKENS), medium="CPU") == 2
    # No medium means GPU; a CPU chain may continue a prefix only the GPU holds.
    feed(index, [stored([10], None, TOKENS[:4], medium=None)], form)
    feed(index, [stored([11], 10, TOKENS[4:8], medium="CPU")], form)
    assert index.match(request(TOKENS)) == 1
    feed(index, [removed([1, 2], medium="CPU")], form)
    assert index.match(request(TOKENS), medium="CPU") == 0


def test_shared_router_key_stays_until_last_engine_hash_goes() -> None:
    """Two engine hashes (e.g. two LoRA adapters) for the same tokens share a router key."""
    index = EventIndex(BS)
    feed(index, [stored_map([1], None, TOKENS[:4]), stored_map([2], None, TOKENS[:4])], "map")
    feed(index, [removed_map([1])], "map")
    assert index.match(request(TOKENS)) == 1
    feed(index, [removed_map([2])], "map")
    assert index.match(request(TOKENS)) == 0


def test_events_the_index_cannot_key_are_counted() -> None:
    index = EventIndex(BS)
    wrong_size = {**stored_map([1], None, TOKENS[:8]), "block_size": 8}
    feed(index, [wrong_size, stored_map([2], 999, TOKENS[:4])], "map")
    assert (index.mismatched, index.orphaned, index.size()) == (1, 1, 0)


def offloaded(hashes: list[Any], block_size: int = BS, medium: str = "CPU") -> dict:
    """A BlockStored as vLLM's OffloadingConnector sends it by default: hashes only."""
    return block_stored(hashes, None, [], block_size, medium)


@pytest.mark.parametrize("size", [BS, 0])
def test_hash_only_offload_events_are_keyed_by_the_gpu_stores_of_the_same_hashes(
    size: int,
) -> None:
    """The CPU view outlives the GPU blocks it was keyed from; an offload event naming a
    hash no medium knows cannot be keyed and is counted, not guessed."""
    index = EventIndex(BS)
    feed(index, [stored_map([1, 2, 3], None, TOKENS[:12])], "map")
    feed(index, [offloaded([1, 2], size), offloaded([77], size)], "map")
    assert index.unresolved == 1
    feed(index, [removed_map([1, 2, 3])], "map")
    assert index.match(request(TOKENS)) == 0
    assert index.match(request(TOKENS), medium="CPU") == 2
    assert index.match_offloaded(request(TOKENS)) == 2
    feed(index, [removed_map([2], medium="CPU")], "map")
    assert index.match_offloaded(request(TOKENS)) == 1


def test_an_offloaded_block_larger_than_the_gpu_s_is_named_by_its_last_gpu_block() -> None:
    """vLLM names each offloaded block of k GPU blocks by the hash of the last of them, so
    the CPU tier holds whole runs of k blocks, and a run is there or not as a whole."""
    index = EventIndex(BS)
    feed(index, [stored_map([1, 2, 3, 4, 5, 6], None, TOKENS)], "map")
    feed(index, [offloaded([2, 4], 2 * BS)], "map")
    assert index.match(request(TOKENS), medium="CPU") == 4
    assert index.match(request(TOKENS[:12]), medium="CPU") == 2  # block 4 is half a run
    feed(index, [offloaded([7], 3 * BS)], "map")
    assert (index.unresolved, index.mismatched) == (1, 0)
    feed(index, [offloaded([6], BS + 1)], "map")
    assert index.mismatched == 1


def test_repeated_announcements_of_a_hash_are_counted() -> None:
    """Self-describing offload events re-announce a hash shared by overlapping chunks and
    remove it once per announcement: the block stays until the last removal."""
    index = EventIndex(BS)
    chunk = stored_map([1, 2], None, TOKENS[:8], medium="CPU")
    feed(index, [chunk, chunk], "map")
    feed(index, [removed_map([1, 2], medium="CPU")], "map")
    assert index.match(request(TOKENS), medium="CPU") == 2
    feed(index, [removed_map([1, 2], medium="CPU")], "map")
    assert index.match(request(TOKENS), medium="CPU") == 0


def test_gpu_blocks_do_not_count_as_offloaded() -> None:
    index = EventIndex(BS)
    feed(index, [stored_map([1, 2], None, TOKENS[:8])], "map")
    assert index.match_offloaded(request(TOKENS)) == 0


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (stored_map([1, 2], None, TOKENS[:4]), "2 hashes"),
        (stored_map([1], None, [*TOKENS[:3], 1 << 32]), r"\[0, 2\*\*32\)"),
        (stored_map([1], None, [-1, *TOKENS[:3]]), r"\[0, 2\*\*32\)"),
        (stored_map([1], None, [*TOKENS[:3], (1 << 64) - 1]), r"\[0, 2\*\*32\)"),
        (42, "neither a tagged array"),
        (["BlockStored", [1.5], None, [1, 2, 3, 4], 4], "block hash"),
        (["BlockStored", [1], None, [1, 2], 0], "block_size"),
        ({"type": "BlockRemoved"}, "block_hashes"),
    ],
)
def test_a_malformed_event_is_left_out_and_the_rest_of_its_batch_applied(
    bad: Any, why: str
) -> None:
    """A token id the router cannot hash (vLLM's are uint32) once killed the subscriber;
    now the event is dropped with its reason and its neighbours still count."""
    batch = decode_batch(payload([bad, stored_map([7], None, TOKENS[4:8])], "map"))
    assert len(batch.invalid) == 1
    assert re.search(why, batch.invalid[0])
    index = EventIndex(BS)
    index.apply(batch.events)
    assert index.match(request(TOKENS[4:8])) == 1


@pytest.mark.parametrize("form", FORMS)
def test_unknown_event_type_is_skipped(form: str) -> None:
    stored, _, _ = FORMS[form]
    unknown = {"type": "BlockPinned", "x": 1} if form == "map" else ["BlockPinned", 1]
    batch = decode_batch(payload([unknown, stored([1], None, TOKENS[:4])], form))
    assert batch.skipped == 1
    assert len(batch.events) == 1


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # never valid msgpack
        msgspec.msgpack.encode([1.0, [stored_map([1], None, TOKENS[:4])]])[:-3],
        msgspec.msgpack.encode("hello"),
        msgspec.msgpack.encode([1.0, "events"]),
        msgspec.msgpack.encode(["soon", []]),
    ],
)
def test_corrupt_payload_raises(data: bytes) -> None:
    with pytest.raises(KVEventError):
        decode_batch(data)


def test_parse_sequence() -> None:
    assert parse_sequence((5).to_bytes(8, "big")) == 5
    assert parse_sequence((-1).to_bytes(8, "big", signed=True)) == REPLAY_END
    with pytest.raises(KVEventError):
        parse_sequence(b"\x00\x01")


def test_sequence_tracker() -> None:
    tracker = SequenceTracker()
    assert tracker.feed(7) == SequenceCheck("ok")  # joined late: nothing to ask for
    assert tracker.feed(8) == SequenceCheck("ok")
    assert tracker.feed(11) == SequenceCheck("gap", range(9, 11))
    assert tracker.feed(12) == SequenceCheck("ok")
    assert tracker.feed(2) == SequenceCheck("restart", range(0, 2))
    assert tracker.feed(3) == SequenceCheck("ok")
    assert tracker.feed(3).status == "restart"


def test_events_in_slices_apply_as_the_whole_events_do() -> None:
    """A 6-block chain, a removal of 5 and a clear, cut in slices of at most 2 blocks:
    each piece of the chain continues the one before, and the index ends the same."""
    hashes = list(range(1, 7))
    events: list[Event] = [
        BlockStored(tuple(hashes), None, tuple(TOKENS), BS, None),
        BlockRemoved(tuple(hashes[1:]), None),
        AllBlocksCleared(),
        BlockStored(tuple(hashes), None, tuple(TOKENS), BS, None),
    ]
    slices = list(in_slices(events, 2))
    assert [sum(len(getattr(e, "block_hashes", ())) for e in part) for part in slices] == [
        2,
        2,
        2,
        2,
        2,
        1,
        2,
        2,
        2,
    ]
    whole, sliced = EventIndex(BS), EventIndex(BS)
    whole.apply(events)
    for part in slices:
        sliced.apply(part)
    keys = chain_hashes(TOKENS, BS)
    assert sliced.match(keys) == whole.match(keys) == 6
    assert sliced.blocks == whole.blocks == 6 and sliced.orphaned == 0


def test_the_index_holds_at_most_max_blocks_and_forgets_the_oldest_first() -> None:
    index = EventIndex(BS, max_blocks=4)
    keys = chain_hashes(TOKENS, BS)
    index.apply([BlockStored((1, 2, 3), None, tuple(TOKENS[:12]), BS, None)])
    index.apply([BlockStored((1,), None, tuple(TOKENS[:4]), BS, None)])  # 1 is now newest
    index.apply([BlockStored((4, 5, 6), 3, tuple(TOKENS[12:]), BS, None)])
    assert index.blocks == 4 and index.evicted == 2
    # 2 and 3 went first; the chain now breaks at its second block.
    assert index.match(keys) == 1 and index.size() == 4
    index.apply([BlockRemoved((1, 1, 4, 5, 6), None)])  # 1 was announced twice
    assert index.blocks == 0 and index.size() == 0
