"""The mock engine's agent mode: seeded replies that stop naturally or call a read-only tool,
through the real OpenAI and Anthropic SDKs on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai
import pytest
from aiohttp.test_utils import TestServer

from smetric.core.blocks import ByteTokenizer
from smetric.core.conversation import analyze_request
from smetric.engine import EngineConfig, create_app
from smetric.engine.agent import LONGEST_REPLY, READ_ONLY_TOOLS, ReplyPlan, draw_reply, plan_reply

pytestmark = [pytest.mark.server, pytest.mark.subprocess]

AGENT = EngineConfig(speed=0.001, agent=True)

# Tools as each API declares them: a read-only one among others, and none read-only.
GLOB_SCHEMA = {
    "type": "object",
    "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
    "required": ["pattern"],
}
OPENAI_TOOLS: Any = [
    {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "glob", "parameters": GLOB_SCHEMA}},
]
ANTHROPIC_TOOLS: Any = [
    {"name": "Bash", "input_schema": {"type": "object"}},
    {"name": "Glob", "input_schema": GLOB_SCHEMA},
]
WRITERS = [{"name": "Write", "input_schema": {"type": "object"}}, {"name": "Bash"}]
# As Codex declares its tools: functions at the top level, and tools of other types.
IMAGE_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
RESPONSES_TOOLS: Any = [
    {"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
    {"type": "function", "name": "view_image", "parameters": IMAGE_SCHEMA},
    {"type": "web_search", "external_web_access": False},
]


def user(text: str) -> Any:
    return {"role": "user", "content": text}


def plans(bodies: list[dict[str, Any]], max_tokens: int = 1000, seed: int = 0) -> list[ReplyPlan]:
    return [draw_reply(b, json.dumps(b).encode(), max_tokens, seed) for b in bodies]


PROMPTS = [{"messages": [user(f"task {i}")], "tools": ANTHROPIC_TOOLS} for i in range(40)]


def test_plans_are_deterministic_and_seeded() -> None:
    assert plans(PROMPTS) == plans(PROMPTS)
    assert plans(PROMPTS) != plans(PROMPTS, seed=1)


def test_replies_stop_naturally_or_call_the_read_only_tool() -> None:
    drawn = plans(PROMPTS)
    calls = [p.call for p in drawn if p.call is not None]
    stops = [p for p in drawn if p.call is None]
    assert calls and stops  # both happen among forty prompts
    assert all(p.natural_stop and p.finish == "stop" and p.tokens <= LONGEST_REPLY for p in stops)
    for call in calls:
        assert call.name == "Glob"
        assert call.arguments == {"pattern": "README*"}  # the required argument only
        assert "".join(call.pieces) == call.arguments_json
    assert all(p.finish == "tool_calls" and p.tokens == len(p.call.pieces) for p in drawn if p.call)


@pytest.mark.parametrize(
    "tools",
    [None, [], WRITERS, "Glob", [{"name": "glob_everything"}], [{"function": "Glob"}]],
)
def test_no_call_without_an_offered_read_only_tool(tools: Any) -> None:
    bodies = [{"messages": [user(f"task {i}")], "tools": tools} for i in range(40)]
    assert all(p.call is None and p.finish == "stop" for p in plans(bodies))


@pytest.mark.parametrize(
    "last",
    [
        {"role": "tool", "tool_call_id": "c1", "content": "README.md"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]},
    ],
)
def test_never_a_call_right_after_a_tool_result(last: dict[str, Any]) -> None:
    bodies = [{"messages": [user(f"task {i}"), last], "tools": ANTHROPIC_TOOLS} for i in range(40)]
    assert all(p.call is None for p in plans(bodies))
    items = [{"type": "function_call_output", "call_id": "c", "output": "x"}]
    bodies = [{"input": [user(f"t{i}"), *items], "tools": OPENAI_TOOLS} for i in range(40)]
    assert all(p.call is None for p in plans(bodies))


def test_a_short_max_tokens_cuts_the_reply_and_ignore_eos_runs_to_it() -> None:
    short = plans(PROMPTS, max_tokens=3)
    assert all(p == ReplyPlan.filler(3) and p.finish == "length" for p in short)
    ignoring = [{**body, "ignore_eos": True} for body in PROMPTS]
    assert all(p == ReplyPlan.filler(1000) for p in plans(ignoring))


def test_one_plan_decides_every_reply_length() -> None:
    """Outside agent mode filler runs to the client's bound, or without one ends by itself
    after ``default_max_tokens``; in agent mode only the context cuts an unbounded reply."""
    off = EngineConfig(default_max_tokens=8)
    body: Any = {"input": "hi"}
    facts = analyze_request(body, "responses", ByteTokenizer(), off.block_size)
    assert plan_reply(off, body, facts, None, may_call=True) == ReplyPlan(8, natural_stop=True)
    assert plan_reply(off, body, facts, 5, may_call=True) == ReplyPlan.filler(5)
    on = EngineConfig(default_max_tokens=8, agent=True)
    drawn = [
        plan_reply(on, b, analyze_request(b, "messages", ByteTokenizer(), 16), None, may_call=True)
        for b in PROMPTS
    ]
    assert all(p.finish != "length" for p in drawn)
    assert max(p.tokens for p in drawn) > on.default_max_tokens


def test_the_allow_list_holds_only_reading_tools() -> None:
    assert {name.lower() for name in READ_ONLY_TOOLS} == {
        "ls",
        "list",
        "glob",
        "read",
        "view",
        "grep",
        "list_dir",
        "read_file",
        "grep_files",
        "view_image",
    }


# --- Through the SDKs ---------------------------------------------------------------------


def serving(scenario: Callable[[str], Awaitable[None]]) -> None:
    async def main() -> None:
        async with TestServer(create_app(AGENT), host="127.0.0.1") as server:
            await scenario(str(server.make_url("")).rstrip("/"))

    asyncio.run(main())


def openai_client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)


def anthropic_client(base: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0)


def test_openai_sdk_sees_natural_stops_and_read_only_tool_calls() -> None:
    async def scenario(base: str) -> None:
        client = openai_client(base)
        finishes = set()
        for i in range(12):
            messages: Any = [user(f"list the files, take {i}")]
            reply = await client.chat.completions.create(
                model="m", messages=messages, tools=OPENAI_TOOLS, max_tokens=500
            )
            again = await client.chat.completions.create(
                model="m", messages=messages, tools=OPENAI_TOOLS, max_tokens=500
            )
            (choice,) = reply.choices
            assert choice.model_dump() == again.choices[0].model_dump()  # deterministic
            finishes.add(choice.finish_reason)
            assert reply.usage is not None and reply.usage.completion_tokens < 500
            if choice.finish_reason == "stop":
                assert choice.message.content and not choice.message.tool_calls
                continue
            assert choice.finish_reason == "tool_calls"
            (call,) = choice.message.tool_calls or []
            assert call.type == "function" and call.function.name == "glob"
            assert json.loads(call.function.arguments) == {"pattern": "README*"}
            # The stream carries the same call, its arguments in pieces.
            chunks: Any = await client.chat.completions.create(
                model="m", messages=messages, tools=OPENAI_TOOLS, max_tokens=500, stream=True
            )
            pieces, names, ids, reasons = [], [], [], []
            async for chunk in chunks:
                for part in chunk.choices:
                    reasons.append(part.finish_reason)
                    for delta in part.delta.tool_calls or []:
                        assert delta.index == 0 and delta.function is not None
                        pieces.append(delta.function.arguments or "")
                        names += [delta.function.name] if delta.function.name else []
                        ids += [delta.id] if delta.id else []
            assert names == ["glob"] and ids == [call.id] and len(pieces) > 1
            assert "".join(pieces) == call.function.arguments
            assert [r for r in reasons if r] == ["tool_calls"]
            # Answering the call ends the turn.
            result: Any = [
                *messages,
                choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "README.md"},
            ]
            after = await client.chat.completions.create(
                model="m", messages=result, tools=OPENAI_TOOLS, max_tokens=500
            )
            assert after.choices[0].finish_reason == "stop"
        assert finishes == {"stop", "tool_calls"}

    serving(scenario)


def test_anthropic_sdk_sees_end_turn_and_tool_use() -> None:
    async def scenario(base: str) -> None:
        client = anthropic_client(base)
        reasons = set()
        for i in range(12):
            messages: Any = [
                user(f"list the files, take {i}"),
                {"role": "system", "content": "a reminder in the middle"},
            ]
            reply = await client.messages.create(
                model="m", messages=messages, tools=ANTHROPIC_TOOLS, max_tokens=500
            )
            reasons.add(reply.stop_reason)
            (block,) = reply.content
            if reply.stop_reason == "end_turn":
                assert block.type == "text" and block.text
                continue
            assert reply.stop_reason == "tool_use"
            assert block.type == "tool_use" and block.name == "Glob"
            assert block.input == {"pattern": "README*"}
            async with client.messages.stream(
                model="m", messages=messages, tools=ANTHROPIC_TOOLS, max_tokens=500
            ) as stream:
                kinds = [event.type async for event in stream]
                streamed = await stream.get_final_message()
            assert "input_json" in kinds
            assert streamed.stop_reason == "tool_use"
            assert streamed.content[0].model_dump() == block.model_dump()
            result: Any = [
                *messages,
                {"role": "assistant", "content": [block.model_dump()]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "x"}],
                },
            ]
            after = await client.messages.create(
                model="m", messages=result, tools=ANTHROPIC_TOOLS, max_tokens=500
            )
            assert after.stop_reason == "end_turn"
        assert reasons == {"end_turn", "tool_use"}

    serving(scenario)


def test_openai_sdk_sees_completed_responses_and_function_calls() -> None:
    async def scenario(base: str) -> None:
        client = openai_client(base)
        statuses = set()
        for i in range(12):
            items: Any = [
                {"type": "message", "role": "developer", "content": "You are a coding agent."},
                {"type": "message", "role": "user", "content": f"list the files, take {i}"},
            ]
            reply = await client.responses.create(model="m", input=items, tools=RESPONSES_TOOLS)
            assert reply.status == "completed" and reply.incomplete_details is None
            assert reply.usage is not None and reply.usage.output_tokens <= LONGEST_REPLY
            (item,) = reply.output
            stored = await client.responses.retrieve(reply.id)
            assert stored.output[0].model_dump() == item.model_dump()
            statuses.add(item.type)
            if item.type == "message":
                assert reply.output_text
                continue
            assert item.type == "function_call" and item.status == "completed"
            assert item.name == "view_image" and json.loads(item.arguments) == {"path": "."}
            # The stream opens the same call, sends its arguments in pieces and closes it.
            async with client.responses.stream(
                model="m", input=items, tools=RESPONSES_TOOLS
            ) as stream:
                events = [event async for event in stream]
                streamed = await stream.get_final_response()
            kinds = [event.type for event in events]
            assert kinds[:3] == [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
            ]
            assert kinds[-3:] == [
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
            added = events[2]
            assert added.type == "response.output_item.added"
            assert added.item.type == "function_call" and added.item.name == "view_image"
            pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
            assert len(pieces) > 1 and "".join(pieces) == item.arguments
            assert "response.output_text.delta" not in kinds
            (call,) = streamed.output
            assert call.type == "function_call" and call.status == "completed"
            assert (call.name, call.arguments) == (item.name, item.arguments)
            # Handing back the call's output, after the stored response, ends the turn.
            output: Any = [{"type": "function_call_output", "call_id": item.call_id, "output": "x"}]
            after = await client.responses.create(
                model="m", input=output, tools=RESPONSES_TOOLS, previous_response_id=reply.id
            )
            assert after.status == "completed" and after.output[0].type == "message"
            assert after.usage is not None
            assert after.usage.input_tokens_details.cached_tokens > 0
        assert statuses == {"message", "function_call"}
        # A bound the reply does not fit cuts it, as max_tokens does.
        cut = await client.responses.create(model="m", input="hi", max_output_tokens=2)
        assert cut.status == "incomplete" and cut.usage is not None
        assert cut.usage.output_tokens == 2

    serving(scenario)


def test_agent_mode_off_runs_every_reply_to_max_tokens() -> None:
    async def scenario() -> None:
        async with TestServer(create_app(EngineConfig(speed=0.001)), host="127.0.0.1") as server:
            client = anthropic_client(str(server.make_url("")).rstrip("/"))
            reply = await client.messages.create(
                model="m",
                messages=[user("hi")],
                tools=ANTHROPIC_TOOLS,
                max_tokens=9,
            )
            assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 9

    asyncio.run(scenario())


def test_bodies_over_a_mebibyte_and_max_model_len() -> None:
    config = EngineConfig(speed=0.001, agent=True, kv_blocks=16384, max_model_len=200_000)

    async def scenario() -> None:
        async with TestServer(create_app(config), host="127.0.0.1") as server:
            client = openai_client(str(server.make_url("")).rstrip("/"))
            # A long conversation and a screenshot: 1.6 MB of body, 150 k prompt tokens.
            image = {"url": "data:image/png;base64," + "A" * 1_500_000}
            big: Any = [
                user("x" * 150_000),
                {"role": "user", "content": [{"type": "image_url", "image_url": image}]},
            ]
            reply = await client.chat.completions.create(model="m", messages=big, max_tokens=32)
            assert reply.usage is not None and 150_000 < reply.usage.prompt_tokens < 151_000
            with pytest.raises(openai.BadRequestError, match="maximum context length is 200000"):
                await client.chat.completions.create(
                    model="m", messages=[user("z" * 199_990)], max_tokens=32
                )
            models = await client.models.list()
            assert models.data[0].model_dump()["max_model_len"] == 200_000

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="raise kv_blocks"):
        EngineConfig(max_model_len=100_000)
