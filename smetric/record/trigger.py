"""Why a request was sent, as far as its body shows it.

The analyzer's rules for Claude Code traces (``trace.weka``): a request whose last message
carries a tool result was sent by the agent loop, one ending in a user's text was typed by
a user. Compaction needs the parent's blocks, so the trace loader decides it; a sub-agent's
first call is known from its harness's headers (``serve.identity``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smetric.trace.schema import Trigger


def body_trigger(body: Mapping[str, Any]) -> Trigger:
    """User or agent, from the last message: a tool result (OpenAI ``role: tool``,
    Anthropic ``tool_result`` blocks, a Responses ``*_call_output`` item) means the agent
    loop sent it."""
    if "messages" not in body and "input" in body:
        return _input_trigger(body["input"])
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return Trigger.UNKNOWN
    return message_trigger(messages[-1])


def message_trigger(last: object) -> Trigger:
    """User or agent, from a chat or Messages body's last message."""
    if not isinstance(last, dict):
        return Trigger.UNKNOWN
    if last.get("role") == "tool":
        return Trigger.AGENT
    content = last.get("content")
    if isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") == "tool_result" for part in content
    ):
        return Trigger.AGENT
    return Trigger.USER if last.get("role") == "user" else Trigger.UNKNOWN


def _input_trigger(items: object) -> Trigger:
    """The Responses API's ``input``: text is a user's, else its last item says."""
    if isinstance(items, str):
        return Trigger.USER
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return Trigger.UNKNOWN
    last = items[-1]
    kind = last.get("type", "message")
    if isinstance(kind, str) and kind.endswith("_call_output"):
        return Trigger.AGENT
    return Trigger.USER if kind == "message" and last.get("role") == "user" else Trigger.UNKNOWN
