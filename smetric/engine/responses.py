"""OpenAI Responses shapes for the mock engine (``/v1/responses``), and its response store.

Codex speaks only this API. A response is one output item, the reply plan's (``engine/agent``)
assistant ``message`` or ``function_call``; streamed, it is the event sequence the OpenAI
SDK and Codex parse (``response.created`` ... deltas ... ``response.completed``), each
event with its ``event:`` line and a ``sequence_number``.
Cached prompt tokens are reported as ``usage.input_tokens_details.cached_tokens``.

With ``store`` (the API's default) the engine keeps a response and the conversation that
led to it, so a request naming it as ``previous_response_id`` continues the conversation
here: its prompt is the stored conversation plus its own input, whose prefix this engine
has cached. As vLLM's store, it lives in the engine's memory; it is bounded, oldest out.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from smetric.core.parsing import RequestError, kind
from smetric.engine.agent import ReplyPlan
from smetric.engine.scheduler import filler_token

# Responses an engine keeps for ``previous_response_id`` and ``GET``; the oldest go first.
STORE_LIMIT = 4096


@dataclass(frozen=True)
class Stored:
    """A stored response and the input items it continues from (its input and output)."""

    response: dict[str, Any]
    conversation: list[Any]


class ResponseStore:
    """Stored responses by id, least recently stored out first past ``limit``."""

    def __init__(self, limit: int = STORE_LIMIT) -> None:
        self.limit = limit
        self._responses: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        return self._responses.get(response_id)

    def put(self, stored: Stored) -> None:
        self._responses[stored.response["id"]] = stored
        while len(self._responses) > self.limit:
            self._responses.popitem(last=False)

    def pop(self, response_id: str) -> Stored | None:
        return self._responses.pop(response_id, None)


def input_items(body: dict[str, Any]) -> list[Any]:
    """``input`` as a list of items (a string is one user message)."""
    if "input" not in body:
        raise RequestError("the request has no 'input'")
    value = body["input"]
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise RequestError(f"input must be a string or a list of items, got {kind(value)}")
    return value


class ResponsesReply:
    """One response's ids, envelope and events, for its reply plan: one output item, an
    assistant ``message`` or a ``function_call``.

    The response is ``completed`` when the reply ended by itself or in its call, and
    ``incomplete`` when it was cut at ``max_output_tokens``.
    """

    def __init__(self, model: str, body: dict[str, Any], plan: ReplyPlan) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}" if plan.call is None else f"fc_{plan.call.id}"
        self.created_at = int(time.time())
        self.model = model
        self.body = body
        self.plan = plan
        self.sequence = 0

    @property
    def final_status(self) -> str:
        return "incomplete" if self.plan.finish == "length" else "completed"

    def response(self, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object: finished, its output whole, once it has ``usage``."""
        body = self.body
        status = "in_progress" if usage is None else self.final_status
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": self.model,
            "output": [] if usage is None else [self.item(complete=True)],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True) is not False,
            "temperature": body.get("temperature", 1.0),
            "text": body.get("text", {"format": {"type": "text"}}),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools", []),
            "top_p": body.get("top_p", 1.0),
            "truncation": body.get("truncation", "disabled"),
            "usage": usage,
            "metadata": body.get("metadata") or {},
        }

    def item(self, *, complete: bool) -> dict[str, Any]:
        """The output item: whole, or as it opens (no text, no arguments yet)."""
        status = self.final_status if complete else "in_progress"
        call = self.plan.call
        if call is not None:
            return {
                "id": self.item_id,
                "type": "function_call",
                "status": status,
                "call_id": f"call_{call.id}",
                "name": call.name,
                "arguments": call.arguments_json if complete else "",
            }
        text = "".join(filler_token(i) for i in range(self.plan.text_tokens))
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [self.part(text)] if complete else [],
        }

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def opening(self) -> Iterable[bytes]:
        yield self.event("response.created", response=self.response())
        yield self.event("response.in_progress", response=self.response())
        opened = self.item(complete=False)
        yield self.event("response.output_item.added", output_index=0, item=opened)
        if self.plan.call is None:
            yield self.event("response.content_part.added", **self._at(), part=self.part(""))

    def token(self, index: int) -> bytes:
        """Token ``index``'s delta: a word of text, or a piece of the call's arguments."""
        call = self.plan.call
        if call is not None:
            piece = call.pieces[index]
            return self.event(
                "response.function_call_arguments.delta",
                item_id=self.item_id,
                output_index=0,
                delta=piece,
            )
        text = filler_token(index)
        return self.event("response.output_text.delta", **self._at(), delta=text, logprobs=[])

    def closing(self, response: dict[str, Any]) -> Iterable[bytes]:
        """The events that close ``response``, the finished response object."""
        (item,) = response["output"]
        if item["type"] == "function_call":
            yield self.event(
                "response.function_call_arguments.done",
                item_id=self.item_id,
                output_index=0,
                name=item["name"],
                arguments=item["arguments"],
            )
        else:
            (part,) = item["content"]
            yield self.event(
                "response.output_text.done", **self._at(), text=part["text"], logprobs=[]
            )
            yield self.event("response.content_part.done", **self._at(), part=part)
        yield self.event("response.output_item.done", output_index=0, item=item)
        yield self.event(f"response.{response['status']}", response=response)

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def event(self, name: str, /, **fields: Any) -> bytes:
        data = {"type": name, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def responses_usage(prompt_tokens: int, cached_tokens: int, generated: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + generated,
    }
