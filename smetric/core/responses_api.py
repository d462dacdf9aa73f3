"""OpenAI Responses: ``instructions`` plus ``input``, a string or a list of items.

An agent such as Codex resends its whole conversation as items: messages, the model's
``reasoning``, ``function_call`` and its ``function_call_output``, and item types this
module has never heard of. They become the chat-shaped messages the renderers take:

- consecutive assistant-side items (an assistant message, ``reasoning``, any ``*_call``)
  are ONE assistant message, since the model produced them in one response; so the turn
  counts responses, and the history ends where the last response does, as in chat;
- a ``*_call_output`` is a ``tool`` message with its call's id;
- any other message is a message of its role (``developer`` becomes ``system``, which
  chat templates know);
- an item of a type not listed joins the message before it (or opens a user message) as a
  placeholder digesting its content, so it counts in the prefix without breaking a turn.

Nothing the client may legitimately send is refused; only what is not JSON-shaped as an
item at all (an item that is not an object, a part without a type) is a ``RequestError``.
"""

from __future__ import annotations

from typing import Any

from smetric.core.parsing import (
    Message,
    RequestError,
    kind,
    part_type,
    placeholder,
)

# Parts whose ``text`` is what the model read or wrote.
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})
_ROLES = {"developer": "system"}


def responses_instructions(body: dict[str, Any]) -> str | None:
    """The system prompt; an empty one counts as none."""
    instructions = body.get("instructions")
    if instructions is None or instructions == "":
        return None
    if isinstance(instructions, str):
        return instructions
    return placeholder("instructions", instructions)


def responses_messages(body: dict[str, Any]) -> list[Message]:
    """``input`` as chat messages, assistant-side items of one response merged."""
    if "input" not in body:
        raise RequestError("the request has no 'input'")
    items = body["input"]
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise RequestError(f"input must be a string or a list of items, got {kind(items)}")
    if not items:
        raise RequestError("input must not be empty")
    builder = _Turns()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object, got {kind(item)}")
        builder.add(item, where)
    return list(builder.messages)


class _Turns:
    """Messages built item by item; the last one stays open for what joins it."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._assistant_open = False

    def add(self, item: dict[str, Any], where: str) -> None:
        item_type = item.get("type", "message")
        if not isinstance(item_type, str):
            raise RequestError(f"{where}.type must be a string, got {kind(item_type)}")
        if item_type == "message":
            role = item.get("role")
            if not isinstance(role, str):
                raise RequestError(f"{where}.role must be a string, got {kind(role)}")
            text = _content(item.get("content"), f"{where}.content")
            if role == "assistant":
                self._assistant(text)
            else:
                self._open({"role": _ROLES.get(role, role), "content": text})
        elif item_type == "reasoning":
            self._assistant(_reasoning(item, where))
        elif item_type.endswith("_call_output"):
            output = _content(item.get("output"), f"{where}.output")
            self._open({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif item_type == "function_call":
            call = {"name": item.get("name"), "arguments": item.get("arguments")}
            self._assistant("", {"id": item.get("call_id"), "type": "function", "function": call})
        elif item_type.endswith("_call"):
            self._assistant(placeholder(item_type, item))
        elif self.messages:
            last = self.messages[-1]
            last["content"] = _joined(last["content"], placeholder(item_type, item))
        else:
            self._open({"role": "user", "content": placeholder(item_type, item)})

    def _open(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self._assistant_open = False

    def _assistant(self, text: str, call: dict[str, Any] | None = None) -> None:
        if not self._assistant_open:
            self._open({"role": "assistant", "content": ""})
            self._assistant_open = True
        message = self.messages[-1]
        message["content"] = _joined(message["content"], text)
        if call is not None:
            message.setdefault("tool_calls", []).append(call)


def _joined(before: str, text: str) -> str:
    return f"{before}\n{text}" if before and text else before or text


def _content(content: object, where: str) -> str:
    """A message's or an output's content: a string, or parts with their text joined by
    newlines; a part without text (an image, a file, a refusal) as its placeholder."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return placeholder("content", content)
    texts = []
    for j, part in enumerate(content):
        name = part_type(part, f"{where}[{j}]")
        text = part.get("text")
        texts.append(
            text if name in _TEXT_PARTS and isinstance(text, str) else placeholder(name, part)
        )
    return "\n".join(texts)


def _reasoning(item: dict[str, Any], where: str) -> str:
    """What the model reasoned, as far as the client has it: the summary and content texts,
    and encrypted content by its digest."""
    texts = [
        _content(item.get(field), f"{where}.{field}")
        for field in ("summary", "content")
        if item.get(field)
    ]
    encrypted = item.get("encrypted_content")
    if encrypted:
        texts.append(placeholder("encrypted_content", encrypted))
    return "\n".join(texts) if texts else placeholder("reasoning", item)


def response_not_found(response_id: str, param: str | None = None) -> dict[str, Any]:
    """The Responses API's 404 body for a stored response nobody holds under this id."""
    message = f"Response with id '{response_id}' not found."
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return {"error": error}
