"""A chat body read as an envelope: the same facts as the whole-body analysis, for any
body, and a follow-up that renders only what it adds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_block_memo import TOKENIZER, CountingTokenizer, same

from smetric.core.block_memo import BlockMemo
from smetric.core.blocks import Tokenizer
from smetric.core.conversation import ChatTemplate, RequestError, analyze_request
from smetric.core.envelope import ChatReader, read_envelope

texts = st.text(max_size=20)
good_parts = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, texts),
    st.builds(lambda t: {"type": "thinking", "thinking": t}, texts),
    st.builds(lambda n: {"type": "tool_use", "name": n, "input": {"q": n}}, texts),
    st.builds(lambda t: {"type": "tool_result", "content": t}, texts),
    st.builds(lambda t: {"type": "image_url", "image_url": {"url": t}}, texts),
)
# Values the parsers meet, well-formed or not: strings, part lists, blocks, odd types.
parts = st.one_of(good_parts, st.just({"type": 3}), st.just("not a part"))
contents = st.one_of(texts, st.lists(parts, max_size=3), st.none(), st.integers())
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), st.none())
calls = st.lists(st.builds(lambda n: {"function": {"name": n}}, texts), min_size=1, max_size=2)


@st.composite
def messages(draw: st.DrawFn) -> Any:
    """Mostly well-formed messages (so that conversations go on), sometimes anything."""
    if draw(st.integers(0, 15)):
        role: str | None = draw(
            st.sampled_from(["system", "user", "assistant", "tool", "developer"])
        )
        message = {"role": role, "content": draw(st.one_of(texts, st.lists(good_parts)))}
        if role == "assistant" and draw(st.booleans()):
            message["tool_calls"] = draw(calls)
        return message
    message = {"content": draw(contents)}
    if (role := draw(roles)) is not None:
        message["role"] = role
    if draw(st.booleans()):
        message["tool_calls"] = draw(st.one_of(calls, st.just("calls")))
    return message if draw(st.booleans()) else draw(st.sampled_from([[], "m", 7]))


def analyze(
    reader: ChatReader,
    raw: bytes,
    api: Any,
    block_size: int,
    memo: BlockMemo | None,
    session: str | None = None,
    tokenizer: Tokenizer = TOKENIZER,
) -> Any:
    read = reader.read(raw, api, session)
    if read is None:
        raise RequestError("not an envelope")
    return reader.facts(read, api, tokenizer, block_size, memo)


@st.composite
def conversations(draw: st.DrawFn) -> list[bytes]:
    """The successive bodies of one conversation: each resends the last and adds more,
    written as a client might (fields before or after the messages, any spacing), some
    long enough for their prefix to be kept."""
    head: dict[str, Any] = {}
    if draw(st.booleans()):
        head["tools"] = draw(st.one_of(st.lists(st.just({"name": "ls"}), max_size=2), st.just({})))
    if draw(st.booleans()):
        head["system"] = draw(st.one_of(texts, st.lists(parts, max_size=2), st.none()))
    if draw(st.booleans()):
        head["chat_template_kwargs"] = draw(st.one_of(st.just({"x": 1}), st.just([1])))
    history = draw(st.lists(messages(), max_size=4))
    if draw(st.booleans()):
        history.insert(0, {"role": "user", "content": "read " * draw(st.integers(800, 1200))})
    first = draw(st.booleans())
    spacing: dict[str, Any] = draw(st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 1}]))
    bodies = []
    for added in draw(st.lists(st.lists(messages(), min_size=1, max_size=3), max_size=3)):
        history = [*history, *added]
        body = {"model": "m", "messages": history, **head, "stream": True}
        if first:
            body = {**head, **body}
        bodies.append(json.dumps(body, **spacing).encode())
    return bodies


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    api=st.sampled_from(["chat", "messages"]),
    sessions=st.lists(conversations(), min_size=1, max_size=3),
    block_size=st.integers(1, 16),
    cache_bytes=st.sampled_from([0, 2000, 1 << 20]),
    hint=st.sampled_from([None, "s"]),
)
def test_the_envelope_finds_the_whole_body_s_facts_for_any_body(
    api: str, sessions: list[list[bytes]], block_size: int, cache_bytes: int, hint: str | None
) -> None:
    """The envelope analysis finds what the whole-body analysis finds, and declines (for
    the whole-body analysis to word the error) exactly the bodies that one refuses;
    through kept prefixes or not, whatever hint names the sender."""
    memo = BlockMemo(TOKENIZER, block_size)
    reader = ChatReader(cache_bytes)
    bodies = [body for session in sessions for body in session]
    for raw in [*bodies, *bodies]:  # the second pass hits whatever was kept
        try:
            fast = analyze(reader, raw, api, block_size, memo, hint)
        except RequestError:
            fast = None
        try:
            whole = analyze_request(json.loads(raw), api, TOKENIZER, block_size)  # type: ignore[arg-type]
        except RequestError:
            assert fast is None
            continue
        assert fast is not None and same(fast, whole)
        assert reader.segments.nbytes <= cache_bytes and reader.prefixes.nbytes <= cache_bytes


TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


def chat_template(name: str, keep_bytes: int = 1 << 20) -> ChatTemplate:
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>", keep_bytes=keep_bytes)


@pytest.mark.parametrize("name", ["smollm2", "qwen3", "llama3.1"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    api=st.sampled_from(["chat", "messages"]),
    sessions=st.lists(conversations(), min_size=1, max_size=2),
)
def test_with_a_model_s_template_the_envelope_finds_the_whole_render_s_facts(
    name: str, api: str, sessions: list[list[bytes]]
) -> None:
    """The same with a model's chat template: read from the envelope and kept prefixes,
    spliced onto kept renderings where the template allows, against a template that keeps
    nothing and renders every body whole."""
    spliced, rendered_whole = chat_template(name), chat_template(name, keep_bytes=0)
    memo, reader = BlockMemo(TOKENIZER, 4), ChatReader(1 << 20, spliced)
    bodies = [body for session in sessions for body in session]
    for raw in [*bodies, *bodies]:
        try:
            fast = analyze(reader, raw, api, 4, memo)
        except RequestError:
            fast = None
        try:
            body = json.loads(raw)
            whole = analyze_request(body, api, TOKENIZER, 4, rendered_whole)  # type: ignore[arg-type]
        except RequestError:
            assert fast is None
            continue
        assert fast is not None and same(fast, whole)


def agent_turn(k: int) -> list[dict[str, Any]]:
    return [
        {"role": "assistant", "content": [{"type": "tool_use", "name": "read", "input": {"k": k}}]},
        {"role": "user", "content": [{"type": "tool_result", "content": f"file {k} " * 200}]},
    ]


def test_a_follow_up_is_rendered_and_tokenised_only_where_it_adds() -> None:
    tokenizer = CountingTokenizer()
    memo, reader = BlockMemo(tokenizer, 16), ChatReader(1 << 20)
    head = {"system": "be brief " * 600, "tools": [{"name": "read"}]}
    history = [{"role": "user", "content": "fix the bug"}, *agent_turn(0)]
    body = {**head, "messages": history}
    analyze(reader, json.dumps(body).encode(), "messages", 16, memo, tokenizer=tokenizer)
    assert len(reader.segments) == 5  # tools, system and three messages
    tokenizer.encoded = 0
    follow_up = {**head, "messages": [*history, *agent_turn(1)]}
    read = reader.read(json.dumps(follow_up).encode(), "messages", None)
    # Read from the first body's kept prefix: only the tail was decoded.
    assert read is not None and read.known is not None
    facts = reader.facts(read, "messages", tokenizer, 16, memo)
    assert len(reader.segments) == 7  # two more messages rendered, nothing else
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
    if read_envelope(raw) is not None:  # taken as JSON: the analysis declines it instead
        with pytest.raises(RequestError):
            analyze(ChatReader(1 << 20), raw, "chat", 16, None)


def test_a_second_messages_key_after_a_kept_prefix_replaces_the_list_as_in_json() -> None:
    history = [{"role": "user", "content": "read " * 1000}, *agent_turn(0)]
    first = json.dumps({"model": "m", "messages": history}).encode()
    reader = ChatReader(1 << 20)
    analyze(reader, first, "chat", 16, None)
    again = first[:-2] + b', {"role": "user", "content": "x"}], "messages": [{"role": "user"'
    again += b', "content": "only"}]}'
    facts = analyze(reader, again, "chat", 16, None)
    assert same(facts, analyze_request(json.loads(again), "chat", TOKENIZER, 16))
    assert facts.turn == 0
