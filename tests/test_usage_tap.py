"""The relay's usage tap: bounded memory, work per chunk proportional to the chunk, and
the usages of a tail found as a plain reading of every line finds them."""

from __future__ import annotations

import json

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from smetric.serve.forwarding import UsageTap


def test_keeps_a_bounded_tail_and_finds_usage_split_across_chunks() -> None:
    tap = UsageTap()
    for i in range(2000):
        tap.feed(f'data: {{"choices": [{{"delta": {{"content": "token {i}"}}}}]}}\n\n'.encode())
        assert tap.kept - len(tap.chunks[0]) < tap.KEEP  # only what the tail needs
    usage = {"usage": {"prompt_tokens": 90, "prompt_tokens_details": {"cached_tokens": 64}}}
    line = f"data: {json.dumps(usage)}\n\n".encode()
    tap.feed(line[:20])
    tap.feed(line[20:])
    tap.feed(b"data: [DONE]\n\n")
    assert tap.cached_tokens() == 64


def test_anthropic_usage_in_a_plain_json_body() -> None:
    tap = UsageTap()
    tap.feed(json.dumps({"usage": {"input_tokens": 9, "cache_read_input_tokens": 7}}).encode())
    assert tap.cached_tokens() == 7


def lines_naming_usage(tail: bytes) -> list[bytes]:
    """The plain reading the tap must agree with: every line (an SSE ``data:`` field
    starts one) that names a usage, last first."""
    pieces = tail.replace(b"data: ", b"\n").split(b"\n")
    return [piece for piece in reversed(pieces) if b'"usage"' in piece]


USAGE_EVENT = st.builds(
    lambda cached, nested: json.dumps(
        {"response": {"usage": {"input_tokens_details": {"cached_tokens": cached}}}}
        if nested
        else {"usage": {"prompt_tokens_details": {"cached_tokens": cached}}}
    ).encode(),
    st.integers(0, 10**6),
    st.booleans(),
)
# Pieces of a tail: data lines with and without a usage, a whole body, a usage cut in two,
# JSON that is no object, and bytes that are no JSON at all.
PIECE = st.one_of(
    USAGE_EVENT.map(lambda event: b"data: " + event + b"\n\n"),
    USAGE_EVENT,  # a whole body, as a reply that is no stream comes
    USAGE_EVENT.map(lambda event: event[: len(event) // 2]),
    st.just(b'data: {"choices": [{"delta": {"content": "ok"}}]}\n\n'),
    st.just(b"data: [DONE]\n\n"),
    st.just(b'["usage"]\n'),
    st.just(b'"usage" is not json\n'),
    st.binary(max_size=40),
)


@given(st.lists(PIECE, max_size=30))
def test_the_usages_found_from_the_end_are_those_of_every_line_read_in_turn(
    pieces: list[bytes],
) -> None:
    tap = UsageTap()
    for piece in pieces:
        tap.feed(piece)
    tail = b"".join(pieces)[-UsageTap.KEEP :]
    expected = []
    for line in lines_naming_usage(tail):
        try:
            data = msgspec.json.decode(line)
            usage = data.get("usage") or (data.get("response") or {}).get("usage")
        except (msgspec.DecodeError, AttributeError):
            continue
        if isinstance(usage, dict):
            expected.append(usage)
    assert tap._usages() == expected
