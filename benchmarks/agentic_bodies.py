"""Request bodies shaped like a coding agent's (for the router benchmarks).

An agent's call carries a long system prompt, a list of tool schemas, and a history that
alternates assistant tool calls with tool output (file contents, command logs), and every
call resends all of it plus the newest exchange. ``agent_messages`` builds such a history
deterministically from a seed; prefixes of it ending at a tool result are the successive
requests of one session.
"""

from __future__ import annotations

import json
import random
from typing import Any

WORDS = [
    "the",
    "file",
    "function",
    "returns",
    "value",
    "error",
    "test",
    "patch",
    "build",
    "import",
    "class",
    "self",
    "config",
    "request",
    "router",
    "engine",
    "block",
    "cache",
    "token",
    "prompt",
    "session",
    "turn",
    "load",
    "tool",
    "result",
    "path",
    "def",
    "return",
    "if",
    "else",
    "for",
    "while",
    "with",
    "async",
    "await",
    "raise",
    "None",
    "True",
    "False",
    "list",
    "dict",
    "str",
]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')}: " + " ".join(WORDS[i : i + 30]),
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "pattern": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
    for i, name in enumerate(("read_file", "write_file", "grep", "run_command", "list_dir"))
]


def prose(rng: random.Random, chars: int) -> str:
    """Words and code-like lines, about ``chars`` characters."""
    lines, size = [], 0
    while size < chars:
        indent = " " * (4 * rng.randrange(3))
        line = indent + " ".join(rng.choices(WORDS, k=rng.randrange(4, 14)))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)[:chars]


def agent_messages(chars: int, seed: int = 0) -> list[dict[str, Any]]:
    """A system prompt, a task, then tool call / tool result pairs, about ``chars`` long."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": prose(rng, min(12_000, chars // 4))},
        {"role": "user", "content": prose(rng, 400)},
    ]
    size = sum(len(m["content"]) for m in messages)
    call = 0
    while size < chars:
        call += 1
        arguments = json.dumps({"path": f"src/module_{rng.randrange(100)}.py"})
        output = prose(rng, rng.randrange(500, 6000))
        messages.append(
            {
                "role": "assistant",
                "content": prose(rng, rng.randrange(50, 300)),
                "tool_calls": [
                    {
                        "id": f"call_{call}",
                        "type": "function",
                        "function": {
                            "name": rng.choice(TOOLS)["function"]["name"],
                            "arguments": arguments,
                        },
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": f"call_{call}", "content": output})
        size += len(output) + 300
    return messages


def chat_body(messages: list[dict[str, Any]], max_tokens: int = 16) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": max_tokens}


def session_turns(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The requests of one session: every prefix that ends with a tool result."""
    return [messages[: i + 1] for i, m in enumerate(messages) if m["role"] == "tool"]
