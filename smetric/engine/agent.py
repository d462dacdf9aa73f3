"""What the mock engine's replies hold, in every API: filler text, or in agent mode a short
reply that ends its turn or one call to a read-only tool the request offers.

A harness such as Claude Code treats a reply cut at ``max_tokens`` as a failure, and one
that never calls a tool exercises only half of an agent's loop. So in agent mode each
request gets a plan drawn from its content and a seed: the same request always gets the
same reply, in any process. The plan only says what to generate; each API's endpoint
renders it in its own shapes, and its token count is what the scheduler generates, so
timing and KV stay modelled. ``plan_reply`` is the one place a reply's length and end are
decided, for every API and either mode.

Two rules keep any harness terminating and harmless: a call is only ever to a tool on the
read-only allow-list (never one that writes, runs commands or reaches the network), and
never right after a tool result, so each user turn ends after at most one call.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from smetric.core.conversation import RequestFacts
from smetric.engine.scheduler import EngineConfig

# Read-only tools, by name as Claude Code, OpenCode, Codex (``view_image``; some versions
# ``list_dir``, ``read_file``, ``grep_files``) and others offer them, most preferred first:
# listing and globbing succeed in any directory, reading needs a file to exist
# (``view_image`` an image: where there is none, the harness hands back an error, which
# ends the turn as any result does).
READ_ONLY_TOOLS = (
    "LS",
    "list",
    "list_dir",
    "Glob",
    "glob",
    "Read",
    "read",
    "read_file",
    "view",
    "Grep",
    "grep",
    "grep_files",
    "view_image",
)

# Values for required arguments by name, then by JSON type: a listing of the working
# directory, a README, a pattern that is a valid glob and a valid regex alike.
_ARGUMENTS: Mapping[str, Any] = {
    "path": ".",
    "pattern": "README*",
    "file_path": "README.md",
    "filePath": "README.md",
    "filename": "README.md",
}
_BY_TYPE: Mapping[str, Any] = {
    "string": ".",
    "integer": 1,
    "number": 1,
    "boolean": False,
}

# Reply lengths in tokens, drawn uniformly; the share of replies that call a tool when one
# may be called.
SHORTEST_REPLY = 4
LONGEST_REPLY = 48
CALL_SHARE = 0.5
# Characters of a call's arguments per generated token.
_PIECE = 4


@dataclass(frozen=True)
class ToolCall:
    """One call to a tool the request offered; ``id`` is hex, each API adds its prefix."""

    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, separators=(",", ":"), sort_keys=True)

    @property
    def pieces(self) -> list[str]:
        """The arguments' JSON as generated: one piece per token, streamed as deltas."""
        text = self.arguments_json
        return [text[i : i + _PIECE] for i in range(0, len(text), _PIECE)]


@dataclass(frozen=True)
class ReplyPlan:
    """What one reply holds: ``text_tokens`` of text, or one tool call; and how it ends.

    ``finish`` is OpenAI's ``finish_reason``: ``stop`` (a natural end of turn), ``length``
    (cut at ``max_tokens``) or ``tool_calls``.
    """

    text_tokens: int
    call: ToolCall | None = None
    natural_stop: bool = False

    @classmethod
    def filler(cls, max_tokens: int) -> ReplyPlan:
        """Text cut at ``max_tokens``, as a benchmark wants."""
        return cls(max_tokens)

    @property
    def tokens(self) -> int:
        """Tokens the engine generates for this reply."""
        return len(self.call.pieces) if self.call is not None else self.text_tokens

    @property
    def finish(self) -> str:
        if self.call is not None:
            return "tool_calls"
        return "stop" if self.natural_stop else "length"


def plan_reply(
    config: EngineConfig,
    body: Mapping[str, Any],
    facts: RequestFacts,
    bound: int | None,
    *,
    may_call: bool,
) -> ReplyPlan:
    """The reply to a request ``body`` (chat, completions, messages or responses shape, its
    conversation whole) whose prompt is ``facts``; ``bound`` is the client's limit on output
    tokens (``max_tokens``, ``max_output_tokens``), None where it set none.

    Outside agent mode the text is filler, which has no end of its own: a bound is run to,
    as a benchmark wants; without one the reply is ``default_max_tokens`` long and ends by
    itself, so a harness that waits for a finished reply (Codex sets no bound) finishes.
    In agent mode the drawn reply is cut at the bound, or without one where the context
    is full, as a model's would be.
    """
    if not config.agent:
        if bound is None:
            return ReplyPlan(config.default_max_tokens, natural_stop=True)
        return ReplyPlan.filler(bound)
    limit = config.context_len - facts.prompt_tokens if bound is None else bound
    content = facts.token_ids.tobytes()
    return draw_reply(body, content, limit, config.agent_seed, may_call=may_call)


def draw_reply(
    body: Mapping[str, Any], content: bytes, max_tokens: int, seed: int, *, may_call: bool = True
) -> ReplyPlan:
    """The agent-mode reply to a request ``body`` (chat, messages or responses shape).

    ``content`` identifies the request's content (its prompt tokens, say): with ``seed``
    (``[0, 2**64)``) it decides every draw. ``may_call`` is false where the API has no tool
    calls (completions). A reply that would not fit ``max_tokens`` is cut there, as a
    model's would be; ``ignore_eos`` asks for exactly that.
    """
    if body.get("ignore_eos") is True:
        return ReplyPlan.filler(max_tokens)
    rng = random.Random(hashlib.blake2b(content, key=seed.to_bytes(8, "big")).digest())
    length = rng.randint(SHORTEST_REPLY, LONGEST_REPLY)
    tool = _read_only_tool(body.get("tools")) if may_call else None
    if tool is not None and not _after_tool_result(body) and rng.random() < CALL_SHARE:
        name, schema = tool
        call = ToolCall(f"{rng.getrandbits(96):024x}", name, _arguments(schema))
        if len(call.pieces) <= max_tokens:
            return ReplyPlan(0, call)
    if length >= max_tokens:
        return ReplyPlan.filler(max_tokens)
    return ReplyPlan(length, natural_stop=True)


def _read_only_tool(tools: object) -> tuple[str, Mapping[str, Any]] | None:
    """The most preferred read-only tool offered, with its parameters' schema.

    Tools come as OpenAI chat (``{"type": "function", "function": {...}}``), Responses
    (``{"type": "function", "name": ..., "parameters": ...}``) or Anthropic
    (``{"name": ..., "input_schema": ...}``) declare them; anything else is not offered.
    """
    if not isinstance(tools, list):
        return None
    offered: dict[str, Mapping[str, Any]] = {}
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        function = tool.get("function")
        spec = function if isinstance(function, dict) else tool
        name = spec.get("name")
        schema = spec.get("parameters", spec.get("input_schema"))
        if isinstance(name, str):
            offered.setdefault(name, schema if isinstance(schema, dict) else {})
    for name in READ_ONLY_TOOLS:
        if name in offered:
            return name, offered[name]
    return None


def _arguments(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A value for each required argument, by its name or else its JSON type."""
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = schema.get("required")
    arguments: dict[str, Any] = {}
    for name in required if isinstance(required, list) else ():
        if not isinstance(name, str):
            continue
        spec = properties.get(name)
        kind = spec.get("type") if isinstance(spec, dict) else None
        default = _BY_TYPE.get(kind, ".") if isinstance(kind, str) else "."
        arguments[name] = _ARGUMENTS.get(name, default)
    return arguments


def _after_tool_result(body: Mapping[str, Any]) -> bool:
    """Whether the request's last message or item hands back a tool's result: an OpenAI
    ``tool`` message, a Responses ``function_call_output`` item or an Anthropic message
    holding a ``tool_result`` block."""
    items = body.get("messages", body.get("input"))
    if not isinstance(items, Sequence) or isinstance(items, str) or not items:
        return False
    last = items[-1]
    if not isinstance(last, dict):
        return False
    if last.get("role") == "tool" or last.get("type") == "function_call_output":
        return True
    content = last.get("content")
    return isinstance(content, list) and any(
        isinstance(block, dict) and block.get("type") == "tool_result" for block in content
    )
