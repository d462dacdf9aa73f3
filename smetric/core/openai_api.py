"""OpenAI request shapes: chat ``messages`` and completions ``prompt``."""

from __future__ import annotations

from typing import Any

from smetric.core.parsing import (
    Message,
    RequestError,
    checked_message,
    kind,
    message_list,
    part_type,
    placeholder,
    text_field,
)

_TOKEN_LIMIT = 1 << 32


def chat_messages(body: dict[str, Any]) -> list[Message]:
    """OpenAI chat messages with content flattened to text; other keys kept for templates."""
    return [chat_message(message, i) for i, message in enumerate(message_list(body))]


def chat_message(message: object, i: int) -> Message:
    """``messages[i]`` with its content flattened to text."""
    message = checked_message(message, i)
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not (
        isinstance(tool_calls, list) and all(isinstance(call, dict) for call in tool_calls)
    ):
        raise RequestError(f"messages[{i}].tool_calls must be a list of objects")
    content = message.get("content")
    if isinstance(content, str):  # text is already what renderers take: no copy
        return message
    return {**message, "content": openai_content(content, f"messages[{i}].content")}


def openai_content(content: object, where: str) -> str:
    """Text parts joined by newlines (as vLLM joins them); other parts become placeholders."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(
            f"{where} must be a string, a list of parts or null, got {kind(content)}"
        )
    texts = []
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        name = part_type(part, here)
        texts.append(text_field(part, "text", here) if name == "text" else placeholder(name, part))
    return "\n".join(texts)


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    """A completion's prompt: text, or token ids in ``[0, 2**32)``; a batch of one unwrapped."""
    if "prompt" not in body:
        raise RequestError("the request has no 'prompt'")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if min(prompt) < 0 or max(prompt) >= _TOKEN_LIMIT:
            raise RequestError("prompt token ids must lie in [0, 2**32)")
        return prompt
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str | list) for p in prompt)
    ):
        raise RequestError("batched prompts are not supported: send one prompt per request")
    raise RequestError("prompt must be a string or a non-empty list of integer token ids")
