"""A chat body read only as far as routing needs, and a follow-up analysed from what it adds.

An agent's follow-up resends every earlier message byte for byte, and decoding all of it
into Python objects, flattening and rendering each message again was most of the router's
own work per request. So the top level is decoded with each message left as its raw JSON
(``msgspec.Raw``: checked to be JSON, nothing built), and ``SegmentCache`` maps a message's
raw JSON to its rendered segment. A message seen before costs a hash of its bytes and one
comparison, and hands back the very string the block memo keyed its entry with, so the
memo does not hash the text again either (a string keeps its hash). Only new messages are
decoded and rendered.

This covers the generic rendering of OpenAI chat and Anthropic Messages bodies, where a
message renders alone; a model's template renders the whole conversation at once, and the
Responses API groups items into messages, so those bodies are analysed whole
(``conversation.analyze_request``). The facts are equal either way by construction: each
piece is rendered by the functions ``render_chat`` uses, which the tests check on arbitrary
conversations. A body the envelope cannot take, or one with an error, is left to the
whole-body analysis, which also words every error.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import xxhash

from smetric.core.anthropic_api import anthropic_message, anthropic_system
from smetric.core.block_memo import BlockMemo
from smetric.core.blocks import Tokenizer
from smetric.core.conversation import (
    RequestFacts,
    checked_tools,
    facts_of,
    message_segment,
    rendering_of,
    session_key,
    system_segments,
    tools_segments,
)
from smetric.core.openai_api import chat_message
from smetric.core.parsing import Message, RequestError

ChatApi = Literal["chat", "messages"]
_PARSERS: dict[ChatApi, Callable[[object, int], Message]] = {
    "chat": chat_message,
    "messages": anthropic_message,
}
_ABSENT = msgspec.Raw()
# Beside the raw JSON and the text, what an entry costs: the entry, its key, the dict slot.
_ENTRY_OVERHEAD = 300


class Envelope(msgspec.Struct):
    """The top-level fields the router reads; everything else is skipped (still checked
    to be JSON) and reaches the engine as it came. A field the client left out is an
    empty ``Raw`` (or ``None``)."""

    messages: list[msgspec.Raw] | None = None
    system: msgspec.Raw = _ABSENT
    tools: msgspec.Raw = _ABSENT
    chat_template_kwargs: Any = None
    stream: Any = None
    prompt_cache_key: Any = None
    previous_response_id: Any = None
    kv_transfer_params: msgspec.Raw = _ABSENT


_DECODER = msgspec.json.Decoder(Envelope)


def read_envelope(raw: bytes) -> Envelope | None:
    """The envelope of a JSON object body; None where msgspec cannot take it as one (not
    JSON, not an object, a field of another shape, text it refuses): the whole-body path
    decides what that body is."""
    try:
        return _DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError):  # ValidationError is a DecodeError
        return None


def decoded(raw: msgspec.Raw) -> Any:
    """A raw field's value (None for an absent one)."""
    return msgspec.json.decode(raw) if raw else None


@dataclass(frozen=True, slots=True)
class _Rendered:
    """What one raw JSON value renders to: its role (messages only), its segments, and the
    text a session key digests (the system prompt's)."""

    raw: msgspec.Raw
    role: str
    segments: tuple[str, ...]
    text: str | None
    nbytes: int


_NONE = _Rendered(_ABSENT, "", (), None, 0)


def _rendered(raw: msgspec.Raw, role: str, segments: list[str], text: str | None) -> _Rendered:
    size = len(raw) + sum(map(sys.getsizeof, segments)) + _ENTRY_OVERHEAD
    return _Rendered(raw.copy(), role, tuple(segments), text, size)


class SegmentCache:
    """Bounded LRU from (what a value is, its raw JSON) to what it renders to; safe across
    threads. Keyed by a hash of the bytes and checked against them, so a match is exact;
    a lost entry only costs rendering again."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[str, int], _Rendered] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(
        self, kind: str, raw: msgspec.Raw, render: Callable[[msgspec.Raw], _Rendered]
    ) -> _Rendered:
        key = (kind, xxhash.xxh3_64_intdigest(raw))
        with self._lock:
            found = self._entries.get(key)
            if found is not None and found.raw == raw:
                self._entries.move_to_end(key)
                return found
        made = render(raw)
        if made.nbytes <= self.max_bytes:
            with self._lock:
                previous = self._entries.pop(key, None)
                self.nbytes -= previous.nbytes if previous is not None else 0
                self._entries[key] = made
                self.nbytes += made.nbytes
                while self.nbytes > self.max_bytes:
                    _, evicted = self._entries.popitem(last=False)
                    self.nbytes -= evicted.nbytes
        return made


def analyze_envelope(
    envelope: Envelope,
    api: ChatApi,
    tokenizer: Tokenizer,
    block_size: int,
    memo: BlockMemo | None,
    cache: SegmentCache,
) -> RequestFacts:
    """The facts ``analyze_request`` finds in the whole body, for the generic rendering.

    Raises ``RequestError`` on anything the whole-body analysis may word otherwise (the
    caller then runs it)."""
    if not envelope.messages:
        raise RequestError("the request has no messages")
    if envelope.chat_template_kwargs is not None and not isinstance(
        envelope.chat_template_kwargs, dict
    ):
        raise RequestError("chat_template_kwargs must be an object")
    tools = cache.get("tools", envelope.tools, _render_tools)
    # An OpenAI body's system messages sit in ``messages``; a top-level one is not read.
    system = cache.get("system", envelope.system, _render_system) if api == "messages" else _NONE
    parse = _PARSERS[api]

    def render_message(raw: msgspec.Raw) -> _Rendered:
        message = parse(msgspec.json.decode(raw), 0)
        return _rendered(raw, message["role"], [message_segment(message)], None)

    rendered = [cache.get(api, raw, render_message) for raw in envelope.messages]
    rendering = rendering_of(
        [*tools.segments, *system.segments], [(r.role, r.segments[0]) for r in rendered]
    )
    turn = sum(r.role == "assistant" for r in rendered)
    session = _session(envelope, parse, rendered, system.text)
    return facts_of(rendering, turn, session, tokenizer, block_size, memo)


def _session(
    envelope: Envelope,
    parse: Callable[[object, int], Message],
    rendered: list[_Rendered],
    system: str | None,
) -> str:
    """The session key, from the messages through the first user one, decoded again (an
    opening is a message or two)."""
    assert envelope.messages is not None
    opening = []
    for i, (raw, entry) in enumerate(zip(envelope.messages, rendered, strict=True)):
        opening.append(parse(msgspec.json.decode(raw), i))
        if entry.role == "user":
            break
    return session_key(opening, system)


def _render_tools(raw: msgspec.Raw) -> _Rendered:
    return _rendered(raw, "", tools_segments(checked_tools(decoded(raw))), None)


def _render_system(raw: msgspec.Raw) -> _Rendered:
    """An Anthropic top-level system prompt."""
    text = anthropic_system(decoded(raw))
    return _rendered(raw, "", system_segments(text), text)
