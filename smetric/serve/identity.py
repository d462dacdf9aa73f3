"""Who sent a request, as agent harnesses say it: labels for decisions, never routing state.

Agent harnesses name their session and agent in headers: Claude Code sends
``x-claude-code-session-id``, ``x-claude-code-agent-id`` and
``x-claude-code-parent-agent-id`` (a sub-agent's parent); Codex sends ``session-id`` (later
``thread-id``); OpenCode ``x-session-id`` or ``x-session-affinity``; Dynamo reads
``x-dynamo-session-id``; an OpenAI request may carry ``prompt_cache_key`` in its body.

The router stays stateless (docs/concepts/architecture.md): the turn is derived from the
body, and nothing is stored under these ids. They label the decision log, a metric of
bounded cardinality (harness and role, never the ids), and the completion record a
recorder writes; and, with the body's turn, they tell a sub-agent's first call (its
history starts here) from its follow-ups.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# (harness, session header, agent header, parent header), first match wins.
_HARNESSES: tuple[tuple[str, str, str | None, str | None], ...] = (
    (
        "claude-code",
        "x-claude-code-session-id",
        "x-claude-code-agent-id",
        "x-claude-code-parent-agent-id",
    ),
    ("codex", "session-id", None, None),
    ("codex", "thread-id", None, None),
    ("opencode", "x-session-id", None, None),
    ("opencode", "x-session-affinity", None, None),
    ("dynamo", "x-dynamo-session-id", None, None),
)
# Headers an engine or a gateway behind the router may read too: passed on to engines.
IDENTITY_HEADERS: tuple[str, ...] = tuple(
    dict.fromkeys(h for row in _HARNESSES for h in row[1:] if h is not None)
)
# Ids longer than this are cut in logs and records (a header is client-controlled).
_MAX_ID = 128
ROLES = ("main", "subagent", "unknown")


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    """What the request says of its sender; every field None when it says nothing."""

    harness: str | None = None
    session: str | None = None
    agent: str | None = None
    parent: str | None = None

    @property
    def role(self) -> str:
        """``subagent`` when it names a parent agent, ``main`` when it names a session
        but no parent, ``unknown`` when it names nothing."""
        if self.parent:
            return "subagent"
        return "main" if self.session or self.agent else "unknown"

    def call(self, turn: int) -> str:
        """``first`` for the first call of this (sub-)agent's conversation (the body's
        turn is 0: no earlier assistant message), else ``follow_up``."""
        return "first" if turn == 0 else "follow_up"

    def labels(self, turn: int) -> dict[str, Any]:
        return {
            "harness": self.harness,
            "session": self.session,
            "agent": self.agent,
            "parent_agent": self.parent,
            "agent_role": self.role,
            "agent_call": self.call(turn),
        }


ANONYMOUS = AgentIdentity()


def identity_of(headers: Mapping[str, str], prompt_cache_key: object = None) -> AgentIdentity:
    """The sender's identity from ``headers`` (case-insensitive mapping), else from the
    body's ``prompt_cache_key``."""
    named = named_by(headers)
    return named if named.session else keyed_by(prompt_cache_key)


def named_by(headers: Mapping[str, str]) -> AgentIdentity:
    """The identity the headers name, ``ANONYMOUS`` if they name no session."""
    for harness, session_header, agent_header, parent_header in _HARNESSES:
        session = headers.get(session_header)
        if session:
            return AgentIdentity(
                harness,
                _clip(session),
                _clip(headers.get(agent_header)) if agent_header else None,
                _clip(headers.get(parent_header)) if parent_header else None,
            )
    return ANONYMOUS


def keyed_by(prompt_cache_key: object) -> AgentIdentity:
    """The identity a body's ``prompt_cache_key`` names, ``ANONYMOUS`` if none."""
    if isinstance(prompt_cache_key, str) and prompt_cache_key:
        return AgentIdentity("openai", _clip(prompt_cache_key))
    return ANONYMOUS


def _clip(value: str | None) -> str | None:
    return None if not value else value[:_MAX_ID]
