"""Anthropic Messages: a top-level ``system`` and ``messages`` of blocks.

Roles other than user and assistant (Claude Code puts ``system`` entries inside ``messages``;
other clients may send anything) render in place as messages of their own, and a message
without content renders empty: the engine, not the router, judges what it can serve, and
prefix matching only needs every turn to render its history the same way.
"""

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
    to_json,
)


def anthropic_system(system: object) -> str | None:
    """The top-level prompt as text; an empty one counts as none."""
    return anthropic_content(system, "system", nested=False) or None


def anthropic_messages(body: dict[str, Any]) -> list[Message]:
    return [anthropic_message(message, i) for i, message in enumerate(message_list(body))]


def anthropic_message(message: object, i: int) -> Message:
    """``messages[i]`` with its blocks as text."""
    message = checked_message(message, i)
    content = anthropic_content(message.get("content"), f"messages[{i}].content", nested=False)
    return {"role": message["role"], "content": content}


def anthropic_content(content: object, where: str, *, nested: bool) -> str:
    """Blocks as text: text and thinking verbatim, a tool call as its JSON, a tool result as
    its own content, no content as none; anything else (images, documents) as a placeholder.

    ``nested`` is set inside a tool result, whose content holds only leaf blocks, so that no
    body can recurse deeper than one level.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of blocks, got {kind(content)}")
    texts = []
    for j, block in enumerate(content):
        here = f"{where}[{j}]"
        block_type = part_type(block, here)
        if block_type == "text":
            texts.append(text_field(block, "text", here))
        elif block_type == "thinking":
            texts.append(text_field(block, "thinking", here))
        elif block_type == "tool_use":
            texts.append(to_json({"name": block.get("name"), "input": block.get("input")}))
        elif block_type == "tool_result" and not nested:
            inner = block.get("content")
            texts.append("" if inner is None else anthropic_content(inner, here, nested=True))
        else:
            texts.append(placeholder(block_type, block))
    return "\n".join(texts)
