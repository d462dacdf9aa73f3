"""A follow-up's chat-template rendering spliced onto the previous turn's equals the whole
render, on real templates (tests/data/chat_templates: SmolLM2's ChatML, Qwen3, Llama 3.1
with tools, Mistral with tools and Mistral's strict alternation), turn by turn; templates the
checks reject render whole and stay exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smetric.core import conversation, template_splice
from smetric.core.block_memo import BlockMemo
from smetric.core.blocks import ByteTokenizer
from smetric.core.conversation import ChatTemplate, RequestError, RequestFacts, analyze_request
from smetric.core.envelope import ChatReader

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
TOKENIZER = ByteTokenizer()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]


def template(name: str, **kwargs: Any) -> ChatTemplate:
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>", **kwargs)


def call(i: int) -> dict[str, Any]:
    arguments = json.dumps({"cmd": f"cat src/file{i}.py"})
    return {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": arguments}}


def agent_session(turns: int, reasoning: bool = True) -> list[dict[str, Any]]:
    """System, task, tool turns, a final answer, a second task, more tool turns."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Work in the repository."},
        {"role": "user", "content": "The tests fail; fix them."},
    ]
    for i in range(turns):
        if i == turns // 2:
            messages += [
                {"role": "assistant", "content": "Fixed the first part."},
                {"role": "user", "content": "Good. Now the second part."},
            ]
        assistant: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call(i)]}
        if reasoning:
            assistant["reasoning_content"] = f"I should read file {i}."
        output = "\n".join(f"def f{i}_{j}(x):\n    return x + {j}" for j in range(i + 3))
        messages += [assistant, {"role": "tool", "tool_call_id": f"c{i}", "content": output}]
    return messages


def requests(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Each request of the session: the messages up to each tool result or user message."""
    return [
        messages[:n] for n in range(2, len(messages) + 1) if messages[n - 1]["role"] != "assistant"
    ]


def same(a: RequestFacts, b: RequestFacts) -> None:
    assert (a.turn, a.prompt_tokens, a.est_hit_tokens, a.session_key) == (
        b.turn,
        b.prompt_tokens,
        b.est_hit_tokens,
        b.session_key,
    )
    assert np.array_equal(a.blocks, b.blocks)
    assert np.array_equal(a.token_ids, b.token_ids)


def whole(name: str, body: dict[str, Any]) -> RequestFacts:
    """The facts from a template that has rendered nothing before: a whole render."""
    return analyze_request(body, "chat", TOKENIZER, 4, template(name))


CASES = [
    # name, tools, verdict (which kinds of extension the probe lets splice), and how many
    # of the session's 10 requests splice at least (the first are too short for a window)
    ("smollm2", None, {"tools": True, "any": True}, 6),
    ("qwen3", TOOLS, {"tools": True, "any": False}, 5),
    ("llama3.1", TOOLS, {"tools": True, "any": True}, 6),
    # Tools go before every user message equal to the last one, wherever it is; an
    # assistant message without content leaves the window's check no content to start
    # from, and the anchor's closing markup is not a tool result's.
    ("mistral_tools", TOOLS, {"tools": True, "any": False}, 2),
]


@pytest.mark.parametrize(("name", "tools", "verdict", "spliced"), CASES)
def test_agent_sessions_splice_turn_by_turn_as_the_whole_render(
    name: str, tools: list[Any] | None, verdict: dict[str, bool], spliced: int
) -> None:
    chat = template(name)
    memo = BlockMemo(TOKENIZER, 4)
    for messages in requests(agent_session(8)):
        body = {"messages": messages, "tools": tools}
        same(analyze_request(body, "chat", TOKENIZER, 4, chat, memo), whole(name, body))
        # A retry of the same request is the kept rendering itself.
        same(analyze_request(body, "chat", TOKENIZER, 4, chat, memo), whole(name, body))
    assert chat.splicer._allowed == verdict
    assert chat.splicer.spliced >= spliced
    assert chat.splicer.mismatches == 0


@pytest.mark.parametrize(("name", "tools", "verdict", "spliced"), CASES)
def test_agent_bodies_read_from_their_kept_prefixes_splice_as_the_whole_render(
    name: str, tools: list[Any] | None, verdict: dict[str, bool], spliced: int
) -> None:
    """As ``smetric serve`` reads them: each follow-up's earlier messages come from the
    previous body's kept bytes (only its tail is decoded), and its rendering from the
    previous turn's."""
    chat = template(name)
    memo, reader = BlockMemo(TOKENIZER, 4), ChatReader(1 << 20, chat)
    session = agent_session(8)
    session[0] = {"role": "system", "content": "You are a coding agent. " * 200}  # kept
    extended = 0
    for messages in requests(session):
        body = {"model": "m", "messages": messages, "tools": tools}
        read = reader.read(json.dumps(body).encode(), "chat", None)
        assert read is not None
        extended += read.known is not None
        same(reader.facts(read, "chat", TOKENIZER, 4, memo), whole(name, body))
    assert extended == len(requests(session)) - 1
    assert chat.splicer.spliced >= spliced and chat.splicer.mismatches == 0


def test_a_system_prompt_kwargs_and_anthropic_bodies_splice_exactly() -> None:
    spliced = template("qwen3")
    for messages in requests(agent_session(6, reasoning=False)):
        body = {
            "system": messages[0]["content"],
            "messages": [
                {"role": m["role"], "content": m["content"] or "..."} for m in messages[1:]
            ],
        }
        facts = analyze_request(body, "messages", TOKENIZER, 4, spliced)
        same(facts, analyze_request(body, "messages", TOKENIZER, 4, template("qwen3")))
    for messages in requests(agent_session(6)):
        body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
        same(analyze_request(body, "chat", TOKENIZER, 4, spliced), whole("qwen3", body))
    assert spliced.splicer.spliced > 0


def test_strict_alternation_keeps_its_parity_and_its_refusals() -> None:
    spliced = template("mistral_v01")
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(15)
    ]
    for n in range(1, len(messages) + 1, 2):
        body = {"messages": messages[:n]}
        same(analyze_request(body, "chat", TOKENIZER, 4, spliced), whole("mistral_v01", body))
    assert spliced.splicer.spliced > 0
    # Two user messages in a row: the whole render refuses, so the request does.
    with pytest.raises(RequestError, match="alternate"):
        analyze_request(
            {"messages": [*messages, {"role": "user", "content": "again"}]},
            "chat",
            TOKENIZER,
            4,
            spliced,
        )


def test_a_template_rendering_earlier_turns_anew_is_caught_by_the_probe() -> None:
    # Reasoning shown only after the last user message, as Qwen3 does: a new user message
    # changes turns before any window, so user turns render whole; tool turns splice.
    dropping = (
        "{%- set ns = namespace(last=-1) %}"
        "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
        "{% endif %}{% endfor %}"
        "{%- for m in messages %}<{{ m.role }}>"
        "{%- if m.role == 'assistant' and loop.index0 > ns.last %}"
        "[{{ m.reasoning_content }}]{% endif %}{{ m.content }}<end>{% endfor %}"
        "{%- if add_generation_prompt %}<assistant>{% endif %}"
    )
    spliced = ChatTemplate(dropping)
    for messages in requests(agent_session(8)):
        body = {"messages": messages}
        same(
            analyze_request(body, "chat", TOKENIZER, 4, spliced),
            analyze_request(body, "chat", TOKENIZER, 4, ChatTemplate(dropping)),
        )
    assert spliced.splicer._allowed == {"tools": True, "any": False}
    assert spliced.splicer.spliced > 0


def test_a_template_whose_window_is_not_the_kept_texts_end_renders_whole() -> None:
    # The count heads the text, so no window's text ends the kept one: nothing splices.
    counting = (
        "{{ messages | length }} messages\n"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}<end>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    spliced = ChatTemplate(counting)
    for messages in requests(agent_session(5)):
        body = {"messages": messages}
        same(
            analyze_request(body, "chat", TOKENIZER, 4, spliced),
            analyze_request(body, "chat", TOKENIZER, 4, ChatTemplate(counting)),
        )
    assert spliced.splicer.spliced == 0


def test_a_sampled_mismatch_turns_splicing_off_for_good(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Every user tag starred once the conversation is longer than any probe's and than
    # any window: neither the probe nor the windows' checks can see it when the
    # conversation crosses the line, the sampled comparison does.
    late = (
        "{% set long = messages | length > 90 %}"
        "{% for m in messages %}<{{ m.role }}{{ '*' if long and m.role == 'user' else '' }}>"
        "{{ m.content }}<end>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    monkeypatch.setattr(template_splice, "SAMPLE", 1)
    spliced = ChatTemplate(late)
    for messages in requests(agent_session(48)):
        body = {"messages": messages}
        same(
            analyze_request(body, "chat", TOKENIZER, 4, spliced),
            analyze_request(body, "chat", TOKENIZER, 4, ChatTemplate(late)),
        )
    assert spliced.splicer.spliced > 0
    assert spliced.splicer.mismatches == 1
    assert spliced.splicer._allowed == {"tools": False, "any": False}
    assert "differed from the whole render" in caplog.text


def test_kept_renderings_stay_within_their_budget() -> None:
    spliced = template("smollm2", keep_bytes=64 << 10)
    for seed in range(6):
        for messages in requests(agent_session(4)):
            tagged = [{**m, "content": f"{seed} {m['content']}"} for m in messages]
            analyze_request({"messages": tagged}, "chat", TOKENIZER, 4, spliced)
            assert spliced.splicer.nbytes <= 64 << 10
    assert spliced.splicer.spliced > 0


def test_equal_numbers_of_another_type_or_key_order_are_another_conversation() -> None:
    # ``True == 1`` and dicts compare without order, but tojson tells them apart.
    source = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}|{{ m.meta | tojson }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    spliced = ChatTemplate(source)
    first = [
        {"role": "user", "content": "a", "meta": {"x": 1, "y": 2}},
        {"role": "assistant", "content": "b", "meta": True},
        {"role": "user", "content": "c", "meta": None},
    ]
    analyze_request({"messages": first}, "chat", TOKENIZER, 4, spliced)
    changed = [
        {"role": "user", "content": "a", "meta": {"y": 2, "x": 1}},
        {"role": "assistant", "content": "b", "meta": 1},
        {"role": "user", "content": "c", "meta": None},
        {"role": "assistant", "content": "d", "meta": 1.0},
        {"role": "user", "content": "e", "meta": None},
    ]
    body = {"messages": changed}
    same(
        analyze_request(body, "chat", TOKENIZER, 4, spliced),
        analyze_request(body, "chat", TOKENIZER, 4, ChatTemplate(source)),
    )


# Texts that collide with markup and with each other, to trip the content search.
TEXTS = st.one_of(
    st.sampled_from(["", "x", "<|im_end|>", "user", "\n", "<tool_response>a</tool_response>"]),
    st.text(max_size=12),
)


@st.composite
def conversations(draw: st.DrawFn) -> list[list[dict[str, Any]]]:
    """A conversation as the requests of its session: steps of tool turns (one or two
    results), user messages and plain answers, a request after any step."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXTS)})
    messages.append({"role": "user", "content": draw(TEXTS)})
    requests = [list(messages)]
    for i in range(draw(st.integers(1, 14))):
        step = draw(st.sampled_from(["tool", "tool", "tools", "user", "answer"]))
        if step == "user":
            messages.append({"role": "user", "content": draw(TEXTS)})
        elif step == "answer":
            messages.append({"role": "assistant", "content": draw(TEXTS)})
        else:
            calls = [call(i)] if step == "tool" else [call(i), call(100 + i)]
            messages.append({"role": "assistant", "content": draw(TEXTS), "tool_calls": calls})
            messages += [{"role": "tool", "content": draw(TEXTS)} for _ in calls]
        if draw(st.booleans()):
            requests.append(list(messages))
    return requests


SHARED: dict[str, ChatTemplate] = {}


@pytest.mark.parametrize("name", ["smollm2", "qwen3", "llama3.1", "mistral_tools"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(session=conversations())
def test_any_conversation_splices_as_it_renders_whole(
    name: str, session: list[list[dict[str, Any]]]
) -> None:
    # One template across examples, as a router keeps it: what it kept of other
    # conversations must not matter.
    spliced = SHARED.setdefault(name, template(name))
    memo = BlockMemo(TOKENIZER, 4)
    for messages in session:
        body = {"messages": messages, "tools": TOOLS}
        try:
            expected = whole(name, body)
        except RequestError:  # Llama 3.1 refuses parallel tool calls: so must the splice
            with pytest.raises(RequestError):
                analyze_request(body, "chat", TOKENIZER, 4, spliced, memo)
            continue
        same(analyze_request(body, "chat", TOKENIZER, 4, spliced, memo), expected)


SMOLLM2 = Path("~/.cache/smetric/engines/smollm2-135m-instruct").expanduser()


@pytest.mark.skipif(
    not (SMOLLM2 / "tokenizer.json").is_file(), reason="SmolLM2 is installed by the engine setup"
)
def test_smollm2_follow_ups_tokenise_as_the_whole_prompt() -> None:
    from smetric.serve.tokenizers import load_hf_tokenizer

    tokenizer, loaded = load_hf_tokenizer(SMOLLM2)
    assert loaded is not None
    memo = BlockMemo(tokenizer, 16)
    for messages in requests(agent_session(10)):
        body = {"messages": messages, "tools": TOOLS}
        facts = analyze_request(body, "chat", tokenizer, 16, loaded, memo)
        text = loaded.render(messages, tools=TOOLS).text
        assert facts.token_ids.tolist() == tokenizer.encode(text)
        fresh = analyze_request(body, "chat", tokenizer, 16, template("smollm2"))
        same(facts, fresh)
    assert loaded.splicer.spliced > 0


@given(
    shared=st.lists(st.integers(0, 2), max_size=40),
    a=st.lists(st.integers(0, 2), max_size=20),
    b=st.lists(st.integers(0, 2), max_size=20),
)
def test_the_common_prefix_is_found_wherever_two_sequences_part(
    shared: list[int], a: list[int], b: list[int]
) -> None:
    first, second = shared + a, shared + b
    pairs = enumerate(zip(first, second, strict=False))
    expected = next((i for i, (x, y) in pairs if x != y), min(len(first), len(second)))
    assert template_splice.common_prefix_length(first, second) == expected
    as_text = "".join(map(str, first)), "".join(map(str, second))
    assert template_splice.common_prefix_length(*as_text) == expected


def _offsets(data: st.DataObject, low: int, high: int) -> list[int]:
    """A nondecreasing list of offsets in ``[low, high]``, repeats allowed (content ends);
    empty where that range is."""
    if low > high:
        return []
    return sorted(data.draw(st.lists(st.integers(low, high), max_size=8)))


def _cuts(ends: list[int], turns: list[int], history_end: int, length: int) -> set[int]:
    return {*ends, *turns, history_end} - {0, length}


@given(data=st.data())
def test_a_rendering_cut_with_the_previous_one_lent_equals_it_cut_afresh(
    data: st.DataObject,
) -> None:
    """The previous rendering lends the segments that stop by an offset up to which both
    texts and their cuts agree; the result is the rendering cut from nothing."""
    old = data.draw(st.text("ab<|>", min_size=1, max_size=40))
    shared = data.draw(st.integers(0, len(old)))
    new = old[:shared] + data.draw(st.text("ab<|>", max_size=20))
    if not new:
        return
    old_ends, old_turns = _offsets(data, 0, len(old)), sorted(set(_offsets(data, 0, len(old))))
    old_history = data.draw(st.integers(0, len(old)))
    # The new text keeps some of the old offsets, then finds its own after them.
    keep_ends = data.draw(st.integers(0, len(old_ends)))
    ends = [e for e in old_ends[:keep_ends] if e <= shared]
    ends += _offsets(data, ends[-1] if ends else 0, len(new))
    turns = [t for t in old_turns if t <= data.draw(st.integers(0, shared))]
    turns += sorted({t for t in _offsets(data, turns[-1] + 1 if turns else 0, len(new))})
    history = data.draw(st.integers(0, len(new)))
    old_cut, old_stops = conversation._cut(old, old_ends, old_turns, old_history)
    fresh = conversation._cut(new, ends, turns, history)
    # The furthest offset where the texts and their cut sets still agree, found by trying.
    old_cuts, new_cuts = (
        _cuts(old_ends, old_turns, old_history, len(old)),
        _cuts(ends, turns, history, len(new)),
    )
    bound = 0
    for upto in range(min(shared, len(new) - 1, len(old) - 1) + 1):
        if {c for c in old_cuts if c <= upto} != {c for c in new_cuts if c <= upto}:
            break
        bound = upto
    upto = data.draw(st.integers(0, bound))
    lent = conversation.Lent(old_cut, old_stops, upto)
    assert conversation._cut(new, ends, turns, history, lent) == fresh
    assert fresh[1] == [*sorted(new_cuts), len(new)]


@given(
    a=st.lists(st.integers(0, 30), max_size=10).map(sorted),
    b=st.lists(st.integers(0, 30), max_size=10).map(sorted),
)
def test_two_lists_of_offsets_agree_up_to_where_they_are_said_to(
    a: list[int], b: list[int]
) -> None:
    agreed = conversation._agreed(a, b)
    assert {x for x in a if x <= agreed} == {x for x in b if x <= agreed}
