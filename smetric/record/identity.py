"""Who sent a request and why, as far as one request shows it: harness headers and the body.

Agent harnesses name their session in a header (Claude Code also names the agent and the
agent that spawned it), and OpenAI requests may carry ``prompt_cache_key``. Where none is
present, the conversation's opening (``RequestFacts.session_key``) stands for both session
and agent, as it does for session hashing. Nothing here is stored: each request is read on
its own, as the router reads everything.

The trigger follows the analyzer's rules for Claude Code traces (``trace.weka``): a request
whose fresh part carries a tool result was sent by the agent loop, one with only text was
typed by a user. Compaction needs the parent's blocks, so the trace loader decides it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from smetric.trace.schema import Trigger

# Session headers, the first present wins: Claude Code, Codex (session-id, later
# thread-id), OpenCode, NVIDIA Dynamo.
SESSION_HEADERS = (
    "x-claude-code-session-id",
    "session-id",
    "thread-id",
    "x-session-id",
    "x-session-affinity",
    "x-dynamo-session-id",
)
AGENT_HEADER = "x-claude-code-agent-id"
PARENT_AGENT_HEADER = "x-claude-code-parent-agent-id"


@dataclass(frozen=True, slots=True)
class Identity:
    """What the harness said about a request; None where it said nothing."""

    session: str | None = None
    agent: str | None = None
    parent_agent: str | None = None


def harness_identity(headers: Mapping[str, str], body: Mapping[str, Any]) -> Identity:
    """The session, agent and spawning agent a harness names (``headers`` is case-blind,
    as aiohttp's are)."""
    session = next((headers[h] for h in SESSION_HEADERS if h in headers), None)
    if session is None and isinstance(body.get("prompt_cache_key"), str):
        session = body["prompt_cache_key"]
    return Identity(session, headers.get(AGENT_HEADER), headers.get(PARENT_AGENT_HEADER))


def body_trigger(body: Mapping[str, Any]) -> Trigger:
    """User or agent, from the last message: a tool result (OpenAI ``role: tool``,
    Anthropic ``tool_result`` blocks) means the agent loop sent it."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return Trigger.UNKNOWN
    last = messages[-1]
    if last.get("role") == "tool":
        return Trigger.AGENT
    content = last.get("content")
    if isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") == "tool_result" for part in content
    ):
        return Trigger.AGENT
    return Trigger.USER if last.get("role") == "user" else Trigger.UNKNOWN
