"""Anthropic Messages response shapes for the mock engine (``POST /v1/messages``).

vLLM serves this API too; agents such as Claude Code speak it. Cached prompt tokens are
reported as ``usage.cache_read_input_tokens``, the field Anthropic's clients read.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

from smetric.engine.agent import ReplyPlan
from smetric.engine.scheduler import filler_token

# How each end of a plan reads as the Messages API's ``stop_reason``.
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesReply:
    """One request's message id, model and event shapes, for its reply plan."""

    def __init__(self, model: str, plan: ReplyPlan) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.plan = plan

    def _message(
        self, content: list[dict[str, Any]], usage: dict[str, int], stop: str | None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }

    def _block(self, *, complete: bool) -> dict[str, Any]:
        """The reply's one content block: its text, or its tool call (its input empty
        until streamed)."""
        call = self.plan.call
        if call is None:
            text = "".join(filler_token(i) for i in range(self.plan.text_tokens))
            return {"type": "text", "text": text if complete else ""}
        arguments = call.arguments if complete else {}
        return {"type": "tool_use", "id": f"toolu_{call.id}", "name": call.name, "input": arguments}

    def full(self, usage: dict[str, int]) -> dict[str, Any]:
        return self._message([self._block(complete=True)], usage, _STOP_REASONS[self.plan.finish])

    def opening(self, usage: dict[str, int]) -> Iterable[bytes]:
        yield event(
            "message_start", {"type": "message_start", "message": self._message([], usage, None)}
        )
        yield event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": self._block(complete=False),
            },
        )

    def token(self, index: int) -> bytes:
        """Token ``index``'s delta: a word of text, or a piece of the call's input JSON."""
        call = self.plan.call
        if call is None:
            delta = {"type": "text_delta", "text": filler_token(index)}
        else:
            delta = {"type": "input_json_delta", "partial_json": call.pieces[index]}
        return event(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
        )

    def closing(self, usage: dict[str, int]) -> Iterable[bytes]:
        yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
        delta = {"stop_reason": _STOP_REASONS[self.plan.finish], "stop_sequence": None}
        yield event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        yield event("message_stop", {"type": "message_stop"})


def messages_usage(prompt_tokens: int, cached_tokens: int, generated: int) -> dict[str, int]:
    """Anthropic counts cached tokens apart from ``input_tokens``."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": generated,
    }


def event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
