"""Turn, expected hit, session key and blocks from request bodies alone.

With the byte tokenizer a token is a byte, so the expected numbers below are the lengths
of hand-rendered texts.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jinja2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smetric.core.blocks import ByteTokenizer
from smetric.core.conversation import (
    ChatTemplate,
    RequestError,
    RequestFacts,
    analyze_request,
    render_chat,
)
from smetric.core.policies import RoutingRequest

TOKENIZER = ByteTokenizer()

# A cut-down Qwen2.5 template: system/tools header, tool calls, tool responses folded into
# user turns, and loop controls (``continue``), which the environment must enable.
QWEN = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}{%- continue %}{%- endif %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + message.content }}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n' + (call.function | tojson) + '\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}
{{- '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def analyze(
    body: Any, api: str = "chat", block_size: int = 4, template: ChatTemplate | None = None
) -> RequestFacts:
    return analyze_request(body, api, TOKENIZER, block_size, template)  # type: ignore[arg-type]


def text_of(facts: RequestFacts) -> str:
    return bytes(facts.token_ids.astype(np.uint8)).decode()


def shared_blocks(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


# --- Turn and expected hit, worked by hand ---------------------------------------------------


def test_chat_first_turn_has_no_history() -> None:
    facts = analyze({"messages": [{"role": "system", "content": "S"}, user("hi")]})
    assert facts.turn == 0
    assert facts.est_hit_tokens == 0
    assert text_of(facts) == "<|system|>\nS\n<|user|>\nhi\n<|assistant|>\n"
    assert facts.prompt_tokens == len(text_of(facts)) == len(facts.token_ids)


def test_chat_history_ends_at_the_last_assistant_message() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            user("hi"),
            assistant("yo"),
            user("and?"),
        ]
    }
    facts = analyze(body, block_size=4)
    history = "<|system|>\nYou are terse.\n<|user|>\nhi\n<|assistant|>\nyo\n"
    fresh = "<|user|>\nand?\n<|assistant|>\n"
    assert facts.turn == 1
    assert facts.est_hit_tokens == len(history) == 55
    assert facts.prompt_tokens == len(history + fresh)
    assert text_of(facts) == history + fresh
    assert len(facts.blocks) == facts.prompt_tokens // 4
    assert facts.token_ids.dtype == facts.blocks.dtype == np.int64


def test_chat_tool_calls_and_tool_messages_are_history() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    body = {
        "messages": [
            user("list files"),
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
            assistant("a.txt exists"),
            user("thanks"),
        ]
    }
    facts = analyze(body)
    calls = '[{"id":"c1","type":"function","function":{"name":"ls","arguments":"{}"}}]'
    history = (
        "<|user|>\nlist files\n"
        f"<|assistant|>\n\n{calls}\n"
        "<|tool|>\na.txt\n"
        "<|assistant|>\na.txt exists\n"
    )
    assert facts.turn == 2
    assert facts.est_hit_tokens == len(history)
    assert text_of(facts) == history + "<|user|>\nthanks\n<|assistant|>\n"


def test_chat_content_parts_keep_text_and_name_images_by_content() -> None:
    def body(url: str) -> dict[str, Any]:
        parts = [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "here"},
        ]
        return {"messages": [{"role": "user", "content": parts}]}

    cat, dog = analyze(body("data:image/png;base64,AAAA")), analyze(body("data:,BBBB"))
    assert re.fullmatch(
        r"<\|user\|>\nlook\n<\|image_url:[0-9a-f]{16}\|>\nhere\n<\|assistant\|>\n", text_of(cat)
    )
    assert text_of(analyze(body("data:image/png;base64,AAAA"))) == text_of(cat)
    assert text_of(dog) != text_of(cat)
    assert dog.prompt_tokens == cat.prompt_tokens


def test_messages_api_turn_and_history_with_tool_blocks() -> None:
    body = {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            user("read a"),
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "A!"}],
                    }
                ],
            },
            assistant("A says A!"),
            user("ok"),
        ],
    }
    facts = analyze(body, "messages")
    history = (
        "<|system|>\nBe brief.\n"
        "<|user|>\nread a\n"
        '<|assistant|>\nReading.\n{"name":"read","input":{"path":"a"}}\n'
        "<|user|>\nA!\n"
        "<|assistant|>\nA says A!\n"
    )
    assert facts.turn == 2
    assert facts.est_hit_tokens == len(history)
    assert text_of(facts) == history + "<|user|>\nok\n<|assistant|>\n"
    assert analyze({"messages": [user("hi")]}, "messages").turn == 0


def test_messages_api_renders_any_role_in_place() -> None:
    # Claude Code sends system entries inside messages; other roles and a message without
    # content render as messages of their own rather than being refused.
    body = {
        "system": "S",
        "messages": [
            user("hi"),
            assistant("hello"),
            {"role": "system", "content": [{"type": "text", "text": "mid"}]},
            {"role": "developer", "content": "dev"},
            {"role": "tool"},
            {"role": "future", "content": [{"type": "hologram", "data": "x"}]},
            user("go"),
        ],
    }
    facts = analyze(body, "messages")
    history = "<|system|>\nS\n<|user|>\nhi\n<|assistant|>\nhello\n"
    assert re.fullmatch(
        re.escape(history + "<|system|>\nmid\n<|developer|>\ndev\n<|tool|>\n\n<|future|>\n")
        + r"<\|hologram:[0-9a-f]{16}\|>"
        + re.escape("\n<|user|>\ngo\n<|assistant|>\n"),
        text_of(facts),
    )
    assert facts.turn == 1
    assert facts.est_hit_tokens == len(history)
    # The same opening as without the mid-conversation entries: one session either way.
    plain = {"system": "S", "messages": [user("hi"), assistant("hello"), user("go")]}
    assert facts.session_key == analyze(plain, "messages").session_key


def test_completions_have_no_structure() -> None:
    facts = analyze({"prompt": "hello world"}, "completions")
    assert (facts.turn, facts.est_hit_tokens, facts.prompt_tokens) == (0, 0, 11)
    assert len(facts.blocks) == 2
    ids = analyze({"prompt": [5, 6, 7, 8, 9]}, "completions")
    assert ids.token_ids.tolist() == [5, 6, 7, 8, 9]
    assert (ids.turn, ids.est_hit_tokens, ids.prompt_tokens) == (0, 0, 5)
    batch_of_one = analyze({"prompt": [[5, 6, 7, 8, 9]]}, "completions")
    assert batch_of_one.token_ids.tolist() == ids.token_ids.tolist()
    assert analyze({"prompt": ["hello world"]}, "completions").session_key == facts.session_key
    assert analyze({"prompt": "hello there"}, "completions").session_key != facts.session_key


def test_routing_request_carries_the_policy_fields() -> None:
    facts = analyze({"messages": [user("hi"), assistant("yo"), user("q")]})
    assert facts.routing_request() == RoutingRequest(
        turn=1,
        prompt_tokens=facts.prompt_tokens,
        est_hit_tokens=facts.est_hit_tokens,
        session_key=facts.session_key,
    )


# --- Blocks across turns and conversations ----------------------------------------------------


def conversation(api: str, system: str, turns: list[tuple[str, str]], last: str) -> dict:
    """A body of ``turns`` (user, assistant) exchanges followed by the user message ``last``."""
    messages = [m for u, a in turns for m in (user(u), assistant(a))] + [user(last)]
    if api == "messages":
        return {"system": system, "messages": messages}
    return {"messages": [{"role": "system", "content": system}, *messages]}


@pytest.mark.parametrize("api", ["chat", "messages"])
@pytest.mark.parametrize("template", [None, ChatTemplate(QWEN)], ids=["generic", "qwen"])
def test_follow_up_starts_with_every_full_block_of_the_previous_request(
    api: str, template: ChatTemplate | None
) -> None:
    first = analyze(conversation(api, "Sys", [], "Write a poem."), api, 16, template)
    second = analyze(
        conversation(api, "Sys", [("Write a poem.", "Roses are red.")], "Another."),
        api,
        16,
        template,
    )
    assert len(first.blocks) > 0
    assert (second.blocks[: len(first.blocks)] == first.blocks).all()
    # The previous prompt plus the reply it produced is the new request's history.
    assert second.est_hit_tokens > first.prompt_tokens
    assert second.session_key == first.session_key


texts = st.text(min_size=0, max_size=40)


@given(
    api=st.sampled_from(["chat", "messages"]),
    system=texts,
    turns=st.lists(st.tuples(texts, texts), min_size=1, max_size=4),
    block_size=st.integers(1, 16),
)
def test_every_turn_extends_the_previous_blocks(
    api: str, system: str, turns: list[tuple[str, str]], block_size: int
) -> None:
    previous = None
    for k in range(len(turns)):
        facts = analyze(conversation(api, system, turns[:k], turns[k][0]), api, block_size)
        assert facts.turn == k
        if previous is not None:
            assert (facts.blocks[: len(previous.blocks)] == previous.blocks).all()
            assert facts.est_hit_tokens >= previous.prompt_tokens
            assert facts.session_key == previous.session_key
        previous = facts


def test_conversations_sharing_a_system_prompt_share_exactly_its_blocks() -> None:
    system = "You are a careful coding agent. Follow the repository's style guide."
    a = analyze({"messages": [{"role": "system", "content": system}, user("apples")]}, "chat", 8)
    b = analyze({"messages": [{"role": "system", "content": system}, user("bananas")]}, "chat", 8)
    # The texts agree up to the first user message's first character.
    common = f"<|system|>\n{system}\n<|user|>\n"
    assert shared_blocks(a.blocks, b.blocks) == len(common) // 8 > 0


def test_session_key_is_the_opening_of_the_conversation() -> None:
    def key(system: str, first: str, api: str = "chat", turns: int = 0) -> str:
        exchanges = [(first, "ok")] + [(f"more {i}", "sure") for i in range(turns - 1)]
        body = conversation(api, system, exchanges[:turns], first if not turns else "next")
        return analyze(body, api).session_key

    base = key("S", "task one")
    assert re.fullmatch(r"[0-9a-f]{16}", base)
    assert key("S", "task one", turns=1) == key("S", "task one", turns=3) == base
    assert key("S", "task two") != base
    assert key("T", "task one") != base
    # An Anthropic top-level prompt is the same opening as an OpenAI system message.
    assert key("S", "task one", api="messages", turns=2) == base


# --- Bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "api", "message"),
    [
        ([], "chat", "must be a JSON object"),
        ({}, "chat", "no 'messages'"),
        ({"messages": "hi"}, "chat", "messages must be a list"),
        ({"messages": []}, "chat", "must not be empty"),
        ({"messages": ["hi"]}, "chat", r"messages\[0\] must be an object"),
        ({"messages": [{"content": "hi"}]}, "chat", r"messages\[0\] has no role"),
        ({"messages": [{"role": 1, "content": "hi"}]}, "chat", "role must be a string"),
        ({"messages": [{"role": "user", "content": 3}]}, "chat", "content must be a string"),
        ({"messages": [{"role": "user", "content": [{"text": "a"}]}]}, "chat", "type must be"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
            "chat",
            r"content\[0\]\.text must be a string",
        ),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": {"id": 1}}]},
            "chat",
            "tool_calls must be a list of objects",
        ),
        ({"messages": [user("hi")], "tools": {}}, "chat", "tools must be a list"),
        (
            {"messages": [user("hi")], "chat_template_kwargs": []},
            "chat",
            "chat_template_kwargs must be an object",
        ),
        ({"messages": [{"content": "x"}]}, "messages", r"messages\[0\] has no role"),
        ({"messages": [user("hi")], "system": 5}, "messages", "system must be a string"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages", "string or a list of blocks"),
        ({}, "completions", "no 'prompt'"),
        ({"prompt": []}, "completions", "non-empty list"),
        ({"prompt": [1, -2]}, "completions", r"\[0, 2\*\*32\)"),
        ({"prompt": [1, 2**40]}, "completions", r"\[0, 2\*\*32\)"),
        ({"prompt": [1, True]}, "completions", "integer token ids"),
        ({"prompt": [1.0, 2.0]}, "completions", "integer token ids"),
        ({"prompt": ["a", "b"]}, "completions", "batched prompts"),
        ({"prompt": None}, "completions", "must be a string"),
    ],
)
def test_bad_bodies_raise_request_error(body: Any, api: str, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        analyze(body, api)


def test_an_unknown_api_is_a_programming_error_not_a_bad_request() -> None:
    with pytest.raises(ValueError, match="unknown api") as caught:
        analyze({"messages": [user("hi")]}, "embeddings")
    assert not isinstance(caught.value, RequestError)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=10)
    | st.just("lone \ud800 surrogate"),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)


def mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually a well-formed value, sometimes any JSON: bodies must get past the first check
    often enough to reach the deeper parsing and the template."""
    return st.integers(1, 8).flatmap(lambda roll: json_values if roll == 8 else valid)


short_text = st.text(max_size=10)
parts: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
    {"type": mostly(st.sampled_from(["text", "image_url", "tool_use", "tool_result", "thinking"]))},
    optional={
        "text": mostly(short_text),
        "thinking": mostly(short_text),
        "input": json_values,
        "content": mostly(short_text | st.lists(st.deferred(lambda: parts), max_size=2)),
    },
)
content = mostly(short_text | st.lists(mostly(parts), max_size=3))
messages = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "assistant", "system", "tool"]))},
    optional={
        "content": content,
        "tool_calls": mostly(
            st.lists(st.dictionaries(st.sampled_from(["id", "function"]), json_values), max_size=2)
        ),
    },
)
bodies = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {"messages": mostly(st.lists(mostly(messages), min_size=1, max_size=5))},
        optional={
            "system": mostly(short_text | st.lists(parts, max_size=2)),
            "tools": mostly(st.lists(json_values, max_size=2)),
            "chat_template_kwargs": mostly(st.dictionaries(st.text(max_size=6), json_values)),
        },
    ),
    st.fixed_dictionaries(
        {"prompt": mostly(short_text | st.lists(st.integers(-3, 2**33)) | st.lists(texts))}
    ),
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=bodies,
    api=st.sampled_from(["chat", "messages", "completions"]),
    template=st.sampled_from([None, ChatTemplate(QWEN)]),
)
def test_any_json_body_analyses_or_raises_request_error(
    body: Any, api: str, template: ChatTemplate | None
) -> None:
    try:
        facts = analyze(body, api, 4, template)
    except RequestError:
        return
    assert facts.turn >= 0
    assert 0 <= facts.est_hit_tokens <= facts.prompt_tokens == len(facts.token_ids)
    assert len(facts.blocks) == facts.prompt_tokens // 4


# --- A model's chat template --------------------------------------------------------------------


def test_template_renders_the_prompt_and_its_history_by_hand() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "S"},
            user("hi"),
            assistant("yo"),
            user("q"),
        ]
    }
    facts = analyze(body, template=ChatTemplate(QWEN))
    history = (
        "<|im_start|>system\nS<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nyo<|im_end|>\n"
    )
    fresh = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    assert text_of(facts) == history + fresh
    assert facts.est_hit_tokens == len(history)
    assert facts.turn == 1


def test_template_sees_tools_tool_calls_and_an_anthropic_system() -> None:
    tool = {"type": "function", "function": {"name": "ls", "description": "list <dir> & more"}}
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    body = {
        "tools": [tool],
        "messages": [
            {"role": "system", "content": "S"},
            user("go"),
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        ],
    }
    text = text_of(analyze(body, template=ChatTemplate(QWEN)))
    # Hugging Face's tojson: no HTML escapes of <, > or &.
    assert text.startswith(f"<|im_start|>system\nS\n\n# Tools\n<tools>\n{json.dumps(tool)}")
    assert '<tool_call>\n{"name": "ls", "arguments": "{}"}\n</tool_call>' in text
    assert "<tool_response>\na.txt\n</tool_response>" in text
    anthropic = analyze(
        {"system": "S", "messages": [user("hi")]}, "messages", template=ChatTemplate(QWEN)
    )
    assert text_of(anthropic).startswith("<|im_start|>system\nS<|im_end|>\n")


def test_template_history_ends_where_the_last_assistant_renders_differently() -> None:
    # Like Qwen3 dropping reasoning from all but the latest turn.
    template = ChatTemplate(
        "{%- for m in messages %}<{{ m.role }}>"
        "{%- if m.role == 'assistant' and loop.last %}[thinking]{% endif %}"
        "{{ m.content }}</{{ m.role }}>{%- endfor %}"
        "{%- if add_generation_prompt %}<assistant>{% endif %}"
    )
    facts = analyze({"messages": [user("hi"), assistant("yo"), user("q")]}, template=template)
    assert text_of(facts) == "<user>hi</user><assistant>yo</assistant><user>q</user><assistant>"
    assert facts.est_hit_tokens == len("<user>hi</user><assistant>")


def test_template_special_tokens_and_request_kwargs() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'think' if enable_thinking else 'answer' }}{% endif %}",
        bos_token="<s>",
        eos_token="</s>",
    )
    body: dict[str, Any] = {"messages": [user("hi")]}
    assert text_of(analyze(body, template=template)) == "<s>hi</s>answer"
    body["chat_template_kwargs"] = {"enable_thinking": True, "messages": [], "bos_token": "X"}
    assert text_of(analyze(body, template=template)) == "<s>hi</s>think"


def test_template_failures_are_request_errors() -> None:
    refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(RequestError, match="roles must alternate"):
        analyze({"messages": [user("hi")]}, template=refusing)
    # The sandbox is immutable: a template cannot change the router's data.
    mutating = ChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(RequestError, match="chat template"):
        analyze({"messages": [user("hi")]}, template=mutating)


def test_the_sandbox_refuses_alike_however_often_it_is_asked() -> None:
    """The sandbox's verdicts are remembered per type and attribute: an allowed read stays
    allowed, and an internal or mutating one is refused on every request, not only the first."""
    reading = ChatTemplate(
        "{% for m in messages %}{{ loop.index0 }}{{ m.content.upper() }}{% endfor %}"
    )
    probing = ChatTemplate("{{ messages[0].content.__class__.__mro__ }}")
    internal = ChatTemplate(
        "{% for m in messages %}{{ m.content.upper.__self__.__mro__ }}{% endfor %}"
    )
    mutating = ChatTemplate("{% for m in messages %}{{ m.update(role='x') }}{% endfor %}")
    body: dict[str, Any] = {"messages": [user("hi"), assistant("yo"), user("bye")]}
    for _ in range(3):
        assert text_of(analyze(body, template=reading)) == "0HI1YO2BYE"
        for refused in (probing, internal, mutating):
            with pytest.raises(RequestError, match="chat template"):
                analyze(body, template=refused)
    assert body["messages"][0]["role"] == "user"


def test_a_broken_template_fails_when_loaded() -> None:
    with pytest.raises(jinja2.TemplateSyntaxError):
        ChatTemplate("{% if %}")


def test_render_chat_segments_without_a_request() -> None:
    rendering = render_chat([user("a"), assistant("b"), user("c")], system="s", tools=[1])
    text, end = rendering.text, rendering.history_end()
    assert text[:end] == "<|tools|>\n[1]\n<|system|>\ns\n<|user|>\na\n<|assistant|>\nb\n"
    assert text[end:] == "<|user|>\nc\n<|assistant|>\n"
    assert rendering.segments[2:4] == ["<|user|>\na\n", "<|assistant|>\nb\n"]
    first = render_chat([user("a")])
    assert (first.text, first.history_end()) == ("<|user|>\na\n<|assistant|>\n", 0)
