"""Responses API bodies: turn, history and prefix from ``instructions`` and ``input`` items.

With the byte tokenizer a token is a byte, so the expected numbers are lengths of
hand-rendered texts.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smetric.core.blocks import ByteTokenizer
from smetric.core.conversation import RequestError, RequestFacts, analyze_request
from smetric.core.parsing import placeholder

TOKENIZER = ByteTokenizer()


def analyze(body: Any, api: str = "responses") -> RequestFacts:
    return analyze_request(body, api, TOKENIZER, 4)  # type: ignore[arg-type]


def text_of(facts: RequestFacts) -> str:
    return bytes(facts.token_ids.astype(np.uint8)).decode()


def message(role: str, text: str, part: str = "input_text") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


REASONING = {
    "type": "reasoning",
    "id": "rs_1",
    "summary": [{"type": "summary_text", "text": "think"}],
}
CALL = {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": '{"d":"."}'}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "a.py"}


def codex_turns() -> list[list[dict[str, Any]]]:
    """The input lists of three successive requests of one agent session."""
    first = [message("developer", "be brief"), message("user", "list files")]
    second = [*first, REASONING, message("assistant", "looking", "output_text"), CALL, OUTPUT]
    third = [*second, message("assistant", "a.py is there", "output_text"), message("user", "ok")]
    return [first, second, third]


def test_a_string_input_is_one_user_message_under_the_instructions() -> None:
    facts = analyze({"model": "m", "instructions": "sys", "input": "hi"})
    assert text_of(facts) == "<|system|>\nsys\n<|user|>\nhi\n<|assistant|>\n"
    assert (facts.turn, facts.est_hit_tokens) == (0, 0)
    # The same conversation as chat, with the instructions as its system message.
    chat = analyze(
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]},
        "chat",
    )
    assert np.array_equal(chat.blocks, facts.blocks)
    assert chat.session_key == facts.session_key


def test_one_response_s_items_are_one_assistant_turn() -> None:
    _, second, third = codex_turns()
    facts = analyze({"input": second})
    assert facts.turn == 1  # reasoning + message + function_call: one response
    call = (
        '[{"id":"c1","type":"function","function":{"name":"ls","arguments":"{\\"d\\":\\".\\"}"}}]'
    )
    history = f"<|system|>\nbe brief\n<|user|>\nlist files\n<|assistant|>\nthink\nlooking\n{call}\n"
    assert text_of(facts) == history + "<|tool|>\na.py\n<|assistant|>\n"
    assert facts.est_hit_tokens == len(history)
    assert analyze({"input": third}).turn == 2


def test_each_request_s_prompt_is_a_prefix_of_the_next() -> None:
    facts = [analyze({"instructions": "x", "input": turn}) for turn in codex_turns()]
    for earlier, later in itertools.pairwise(facts):
        assert text_of(later).startswith(text_of(earlier))
        assert np.array_equal(later.blocks[: len(earlier.blocks)], earlier.blocks)
        assert later.est_hit_tokens >= earlier.prompt_tokens


def test_unknown_items_parts_and_roles_are_kept_in_place() -> None:
    odd = {"type": "compaction_summary", "encrypted_content": "zzz"}
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    body = {
        "input": [
            odd,
            {"role": "critic", "content": [{"type": "input_text", "text": "hm"}, image]},
            {"type": "web_search_call", "id": "ws", "status": "completed"},
            {
                "type": "custom_tool_call_output",
                "call_id": "x",
                "output": [{"type": "input_text", "text": "out"}],
            },
        ]
    }
    text = text_of(analyze(body))
    assert text == (
        f"<|user|>\n{placeholder('compaction_summary', odd)}\n"
        f"<|critic|>\nhm\n{placeholder('input_image', image)}\n"
        f"<|assistant|>\n{placeholder('web_search_call', body['input'][2])}\n"
        "<|tool|>\nout\n<|assistant|>\n"
    )
    # A different image, or different opaque content, is a different prompt.
    other = {**body, "input": [{**odd, "encrypted_content": "yyy"}, *body["input"][1:]]}
    assert text_of(analyze(other)) != text


def test_an_unknown_item_after_a_response_stays_in_its_turn() -> None:
    _, second, _ = codex_turns()
    items = [*second[:4], {"type": "item_reference", "id": "x"}, *second[4:]]
    assert analyze({"input": items}).turn == 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "m"}, "no 'input'"),
        ({"input": []}, "must not be empty"),
        ({"input": 3}, "must be a string or a list"),
        ({"input": ["hi"]}, r"input\[0\] must be an object"),
        ({"input": [{"role": 1, "content": "x"}]}, r"input\[0\].role must be a string"),
        ({"input": [{"role": "user", "content": ["x"]}]}, r"content\[0\] must be an object"),
    ],
)
def test_bodies_no_engine_could_serve_raise_request_error(body: Any, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        analyze(body)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
item_types = st.sampled_from(
    ["message", "reasoning", "function_call", "function_call_output", "web_search_call", "x"]
)
parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal"])},
    optional={"text": st.text(max_size=8) | json_values},
)
items = st.fixed_dictionaries(
    {},
    optional={
        "type": item_types | json_values,
        "role": st.sampled_from(["user", "assistant", "developer", "critic"]) | json_values,
        "content": st.text(max_size=8) | st.lists(parts | json_values, max_size=2) | json_values,
        "output": st.text(max_size=8) | st.lists(parts, max_size=2) | json_values,
        "summary": st.lists(parts, max_size=2) | json_values,
        "encrypted_content": st.text(max_size=8),
        "call_id": json_values,
        "name": json_values,
        "arguments": json_values,
    },
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "input": st.text(max_size=8) | st.lists(items | json_values, max_size=5) | json_values,
        "instructions": st.text(max_size=8) | json_values,
        "tools": st.lists(json_values, max_size=2) | json_values,
    },
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies)
def test_any_json_body_analyses_or_raises_request_error(body: Any) -> None:
    try:
        facts = analyze(body)
    except RequestError:
        return
    assert facts.turn >= 0
    assert 0 <= facts.est_hit_tokens <= facts.prompt_tokens == len(facts.token_ids)
    assert len(facts.blocks) == facts.prompt_tokens // 4
