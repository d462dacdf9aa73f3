"""Anthropic Messages response shapes for the mock engine (``POST /v1/messages``).

vLLM serves this API too; agents such as Claude Code speak it. Cached prompt tokens are
reported as ``usage.cache_read_input_tokens``, the field Anthropic's clients read.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any


class MessagesReply:
    """One request's message id, model and event shapes."""

    def __init__(self, model: str) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model

    def _message(self, text: str, usage: dict[str, int], stop: str | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [{"type": "text", "text": text}] if text else [],
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }

    def full(self, text: str, usage: dict[str, int]) -> dict[str, Any]:
        return self._message(text, usage, "max_tokens")

    def opening(self, usage: dict[str, int]) -> Iterable[bytes]:
        yield event(
            "message_start", {"type": "message_start", "message": self._message("", usage, None)}
        )
        block = {"type": "text", "text": ""}
        yield event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        )

    def token(self, text: str) -> bytes:
        delta = {"type": "text_delta", "text": text}
        return event(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
        )

    def closing(self, usage: dict[str, int]) -> Iterable[bytes]:
        yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
        delta = {"stop_reason": "max_tokens", "stop_sequence": None}
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
