"""A chat body read as an envelope: the same facts as the whole-body analysis, for any
body, and a follow-up that renders only what it adds."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_block_memo import TOKENIZER, CountingTokenizer, same

from smetric.core.block_memo import BlockMemo
from smetric.core.conversation import RequestError, analyze_request
from smetric.core.envelope import SegmentCache, analyze_envelope, read_envelope

texts = st.text(max_size=20)
# Values the parsers meet, well-formed or not: strings, part lists, blocks, odd types.
parts = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, texts),
    st.builds(lambda t: {"type": "thinking", "thinking": t}, texts),
    st.builds(lambda n: {"type": "tool_use", "name": n, "input": {"q": n}}, texts),
    st.builds(lambda t: {"type": "tool_result", "content": t}, texts),
    st.builds(lambda t: {"type": "image_url", "image_url": {"url": t}}, texts),
    st.just({"type": 3}),
    st.just("not a part"),
)
contents = st.one_of(texts, st.lists(parts, max_size=3), st.none(), st.integers())
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), st.none())


@st.composite
def messages(draw: st.DrawFn) -> Any:
    message: dict[str, Any] = {"content": draw(contents)}
    role = draw(roles)
    if role is not None:
        message["role"] = role
    if draw(st.booleans()) and role == "assistant":
        message["tool_calls"] = draw(
            st.one_of(
                st.lists(st.builds(lambda n: {"function": {"name": n}}, texts), max_size=2),
                st.just("calls"),
            )
        )
    return message if draw(st.integers(0, 20)) else draw(st.sampled_from([[], "m", 7]))


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """The successive bodies of one conversation: each resends the last and adds more."""
    head: dict[str, Any] = {}
    if draw(st.booleans()):
        head["tools"] = draw(st.one_of(st.lists(st.just({"name": "ls"}), max_size=2), st.just({})))
    if draw(st.booleans()):
        head["system"] = draw(st.one_of(texts, st.lists(parts, max_size=2), st.none()))
    if draw(st.booleans()):
        head["chat_template_kwargs"] = draw(st.one_of(st.just({"x": 1}), st.just([1])))
    history = draw(st.lists(messages(), max_size=4))
    bodies = []
    for added in draw(st.lists(st.lists(messages(), min_size=1, max_size=3), max_size=3)):
        history = [*history, *added]
        bodies.append({**head, "messages": history, "stream": True})
    return bodies


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    api=st.sampled_from(["chat", "messages"]),
    sessions=st.lists(conversations(), min_size=1, max_size=3),
    block_size=st.integers(1, 16),
    cache_bytes=st.sampled_from([0, 2000, 1 << 20]),
)
def test_the_envelope_finds_the_whole_body_s_facts_for_any_body(
    api: str, sessions: list[list[dict[str, Any]]], block_size: int, cache_bytes: int
) -> None:
    """The envelope analysis finds what the whole-body analysis finds, and declines (for
    the whole-body analysis to word the error) exactly the bodies that one refuses."""
    memo = BlockMemo(TOKENIZER, block_size)
    cache = SegmentCache(cache_bytes)
    bodies = [body for session in sessions for body in session]
    for body in [*bodies, *bodies]:  # the second pass hits whatever the cache kept
        raw = json.dumps(body).encode()
        envelope = read_envelope(raw)
        assert envelope is not None
        try:
            fast = analyze_envelope(envelope, api, TOKENIZER, block_size, memo, cache)  # type: ignore[arg-type]
        except RequestError:
            fast = None
        try:
            whole = analyze_request(json.loads(raw), api, TOKENIZER, block_size)  # type: ignore[arg-type]
        except RequestError:
            assert fast is None
            continue
        assert fast is not None and same(fast, whole)
        assert cache.nbytes <= cache_bytes


def agent_turn(k: int) -> list[dict[str, Any]]:
    return [
        {"role": "assistant", "content": [{"type": "tool_use", "name": "read", "input": {"k": k}}]},
        {"role": "user", "content": [{"type": "tool_result", "content": f"file {k} " * 200}]},
    ]


def test_a_follow_up_is_rendered_and_tokenised_only_where_it_adds() -> None:
    tokenizer = CountingTokenizer()
    memo, cache = BlockMemo(tokenizer, 16), SegmentCache(1 << 20)
    head = {"system": "be brief " * 300, "tools": [{"name": "read"}]}
    history = [{"role": "user", "content": "fix the bug"}, *agent_turn(0)]
    body = {**head, "messages": history}
    first = read_envelope(json.dumps(body).encode())
    assert first is not None
    analyze_envelope(first, "messages", tokenizer, 16, memo, cache)
    assert len(cache) == 5  # tools, system and three messages
    tokenizer.encoded = 0
    follow_up = {**head, "messages": [*history, *agent_turn(1)]}
    second = read_envelope(json.dumps(follow_up).encode())
    assert second is not None
    facts = analyze_envelope(second, "messages", tokenizer, 16, memo, cache)
    assert len(cache) == 7  # two more messages rendered, nothing else
    whole = analyze_request(follow_up, "messages", TOKENIZER, 16)
    assert same(facts, whole) and facts.est_hit_tokens > 0 and facts.turn == 2
    added = facts.prompt_tokens - analyze_request(body, "messages", TOKENIZER, 16).prompt_tokens
    # Only the new messages and the generation prompt were tokenised again.
    assert tokenizer.encoded == added + len("<|assistant|>\n")


@pytest.mark.parametrize(
    "raw",
    [b"[1]", b"{", b'{"messages": "hi"}', b'{"messages": [1], "tools": 3}', b'{"x": "\\ud800"}'],
)
def test_a_body_the_envelope_cannot_take_is_left_to_the_whole_body_path(raw: bytes) -> None:
    envelope = read_envelope(raw)
    if envelope is not None:  # taken as JSON: the analysis declines it instead
        with pytest.raises(RequestError):
            analyze_envelope(envelope, "chat", TOKENIZER, 16, None, SegmentCache(1 << 20))
