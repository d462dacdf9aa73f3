"""A chat body read only as far as routing needs, and a follow-up analysed from what it adds.

An agent's follow-up resends every earlier message byte for byte, and decoding all of it
into Python objects, flattening and rendering each message again was most of the router's
own work per request. Two memories spare it:

- ``Prefixes`` keeps each body's bytes through its last message with what they held,
  what a rendering reads of those messages gathered (``Conversation``). A follow-up that
  starts with those bytes is a comparison of them (``memcmp``) and a decode of its tail
  alone: the new messages and the fields after them.
- ``SegmentCache`` maps a message's raw JSON to its rendered segment, for a body whose
  prefix is not held (another replica served the turn before, or it was evicted): the top
  level is decoded with each message left raw (``msgspec.Raw``: checked, nothing built),
  and a message seen before costs a hash of its bytes and one comparison.

Either way a message's segment is the string the block memo keyed its entry with, so the
memo's lookup does not hash the text again (a string keeps its hash). Everything is found
by content: a prefix is looked up in a bucket named by the body's first bytes and the
sender's session (a hint only: a candidate counts only if the body starts with its bytes).

This covers OpenAI chat and Anthropic Messages bodies; the Responses API groups items into
messages, so its bodies are analysed whole (``conversation.analyze_request``). With the
generic rendering a message renders alone, so what is kept per message is its segment;
a model's template renders the whole conversation at once, so what is kept is the message
as the template reads it, and the template splices a follow-up onto the previous turn's
rendering (``core.template_splice``). The facts are equal either way: every piece is made
by the functions the whole-body analysis uses, which the tests check on arbitrary
conversations and real templates. A body the envelope cannot take, or one with a fault,
is left to the whole-body analysis, which also words every error.
"""

from __future__ import annotations

import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import xxhash

from smetric.core.anthropic_api import anthropic_message, anthropic_system
from smetric.core.block_memo import BlockMemo, Run, hash_segments
from smetric.core.blocks import Tokenizer
from smetric.core.conversation import (
    ChatTemplate,
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
from smetric.core.rendering import Rendering
from smetric.core.template_splice import Packed, packed

ChatApi = Literal["chat", "messages"]
_PARSERS: dict[ChatApi, Callable[[object, int], Message]] = {
    "chat": chat_message,
    "messages": anthropic_message,
}
_ABSENT = msgspec.Raw()
# Beside the raw JSON and the text, what an entry costs: the entry, its key, the dict slot.
_ENTRY_OVERHEAD = 300
# A prefix is filed under a hash of the body's first bytes; a shorter one is not kept
# (a short conversation costs little to read again).
_HEAD_BYTES = 4096
# Prefixes kept per bucket, most recent first: the turns of sessions that open alike.
_BUCKET = 8
# What may lie between a JSON array's items, and before a kept prefix's tail: skipped at
# C speed, since a client may send megabytes of it.
_BETWEEN = re.compile(rb"[ \t\r\n,]*")
_SPACE = re.compile(rb"[ \t\r\n]*")


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
_FIELDS = tuple(f for f in Envelope.__struct_fields__ if f != "messages")


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
class Rendered:
    """What one raw JSON value renders to: its role (messages only), its segments, and the
    text a session key digests (the system prompt's). For a model's template, which
    renders the conversation at once: the value as the template reads it (a message, the
    tools), and that as the splicer identifies it (``template_splice.packed``)."""

    raw: msgspec.Raw
    role: str
    segments: tuple[str, ...]
    text: str | None
    value: Any
    packed: bytes | None
    nbytes: int


def _rendered(
    raw: msgspec.Raw,
    role: str,
    segments: list[str],
    text: str | None,
    value: Any = None,
    encoded: bytes | None = None,
) -> Rendered:
    # An encoding counts twice: itself and the value it encodes, about as large.
    size = len(raw) + sum(map(sys.getsizeof, segments)) + 2 * len(encoded or b"")
    return Rendered(raw.copy(), role, tuple(segments), text, value, encoded, size + _ENTRY_OVERHEAD)


_NONE = Rendered(_ABSENT, "", (), None, None, packed(None), 0)


class SegmentCache:
    """Bounded LRU from (what a value is, its raw JSON) to what it renders to; safe across
    threads. Keyed by a hash of the bytes and checked against them, so a match is exact;
    a lost entry only costs rendering again."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[str, int], Rendered] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(
        self, kind: str, raw: msgspec.Raw, render: Callable[[msgspec.Raw], Rendered]
    ) -> Rendered:
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


@dataclass(frozen=True, slots=True)
class Conversation:
    """A body's messages rendered, with what a rendering reads of every one of them
    gathered: a follow-up's extends its kept prefix's, so gathering reads only what it adds
    (the tuples are copied, a pointer per message). ``values`` and ``packs``: as a model's
    template reads them and as its splicer identifies them (None each with the generic
    rendering); ``turns``: the assistant messages among them."""

    messages: tuple[Rendered, ...] = ()
    values: tuple[Any, ...] = ()
    packs: tuple[bytes | None, ...] = ()
    turns: int = 0

    def extended(self, added: Sequence[Rendered]) -> Conversation:
        return Conversation(
            self.messages + tuple(added),
            self.values + tuple(m.value for m in added),
            self.packs + tuple(m.packed for m in added),
            self.turns + sum(m.role == "assistant" for m in added),
        )

    def without_last(self) -> Conversation:
        last = self.messages[-1]
        turns = self.turns - (last.role == "assistant")
        return Conversation(self.messages[:-1], self.values[:-1], self.packs[:-1], turns)


_EMPTY = Conversation()


@dataclass(frozen=True, slots=True)
class _Prefix:
    """A body kept for its bytes through all its messages but the last (the first
    ``length``; kept whole, as slicing it would copy it), the top-level fields before its
    messages, those messages rendered, and the run its segments hashed to (its tools and
    system headers first)."""

    body: bytes
    length: int
    head: Envelope
    conversation: Conversation
    run: Run
    bucket: _Bucket
    # The session key under the system prompt it was digested with, once a user message
    # is among these messages: the opening then ends here, for every body that extends it.
    session: tuple[str | None, str] | None
    # Its bytes, the run's (whose nodes the block memo may hold too) and the rest.
    nbytes: int

    def starts(self, body: bytes) -> bool:
        """Whether ``body`` begins with this prefix's bytes (a ``memcmp``, no copy)."""
        return body.startswith(memoryview(self.body)[: self.length])


def _prefix(
    body: bytes,
    length: int,
    head: Envelope,
    conversation: Conversation,
    run: Run,
    bucket: _Bucket,
    session: tuple[str | None, str] | None,
) -> _Prefix:
    size = len(body) + 24 * len(conversation.messages) + run.nbytes + _ENTRY_OVERHEAD
    return _Prefix(body, length, head, conversation, run, bucket, session, size)


class Prefixes:
    """Bounded LRU of body prefixes, in buckets by their first bytes and the sender's
    session; safe across threads. A prefix a follow-up extends is replaced by the
    follow-up's."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._buckets: OrderedDict[_Bucket, list[_Prefix]] = OrderedDict()
        self._lock = threading.Lock()

    def find(self, body: bytes, bucket: _Bucket) -> _Prefix | None:
        """A kept prefix of ``body`` (in ``bucket``), the most recent."""
        if len(body) <= _HEAD_BYTES:
            return None
        with self._lock:
            candidates = list(self._buckets.get(bucket, ()))
        return next((c for c in candidates if c.starts(body)), None)

    def keep(self, prefix: _Prefix, replacing: _Prefix | None) -> None:
        if prefix.nbytes > self.max_bytes:
            return
        with self._lock:
            bucket = self._buckets.pop(prefix.bucket, [])
            others = [p for p in bucket if p is not replacing and not _same(p, prefix)]
            kept = [prefix, *others][:_BUCKET]
            self.nbytes += sum(p.nbytes for p in kept) - sum(p.nbytes for p in bucket)
            self._buckets[prefix.bucket] = kept
            while self.nbytes > self.max_bytes:
                _, evicted = self._buckets.popitem(last=False)
                self.nbytes -= sum(p.nbytes for p in evicted)


_Bucket = tuple[str, str | None, int]


def _same(a: _Prefix, b: _Prefix) -> bool:
    return a.length == b.length and a.starts(b.body)


def _bucket(body: bytes, api: ChatApi, session: str | None) -> _Bucket:
    return api, session, xxhash.xxh3_64_intdigest(memoryview(body)[:_HEAD_BYTES])


@dataclass(frozen=True, slots=True)
class ChatBody:
    """A chat or Messages body as read: its bytes, its top-level fields, its messages
    rendered, the kept prefix it extends, and what to keep of it: the fields before its
    messages, where all its messages but the last end in its bytes (0: nothing to keep),
    its bucket.

    The last message is left out of what is kept for later bodies: they resend it, but a
    sibling (a retry, a fork) replaces it, and clients mark it for their prompt caches
    (``cache_control``), a mark that moves on with the conversation."""

    body: bytes
    envelope: Envelope
    conversation: Conversation
    known: _Prefix | None
    head: Envelope | None
    cut: int
    bucket: _Bucket

    def last_message(self) -> Any:
        return decoded(self.conversation.messages[-1].raw)


class ChatReader:
    """Reads chat and Messages bodies, remembering what their messages render to, with
    the generic rendering or ``template``.

    With a model's template a message's segment depends on the whole conversation, so
    what is remembered is each message as the template reads it, and the rendering is the
    template's (spliced onto the previous turn's, ``core.template_splice``); a follow-up
    still decodes only its tail, and hashes only what its rendering does not share with
    the previous turn's."""

    def __init__(self, max_bytes: int, template: ChatTemplate | None = None) -> None:
        self.segments = SegmentCache(max_bytes)
        self.prefixes = Prefixes(max_bytes)
        self.template = template

    def read(self, body: bytes, api: ChatApi, session: str | None) -> ChatBody | None:
        """The body read; None where the envelope cannot take it (the whole-body path
        then does). Raises ``RequestError`` for a fault the whole-body path words."""
        parse = _PARSERS[api]
        bucket = _bucket(body, api, session)
        known = self.prefixes.find(body, bucket)
        if known is not None and (tail := _tail(body, known.length)) is not None:
            conversation = known.conversation.extended(self._render(api, parse, tail.added))
            cut = _ends(body, known.length, tail.added[:-1])
            return ChatBody(
                body, _merged(known.head, tail), conversation, known, known.head, cut, bucket
            )
        envelope = read_envelope(body)
        if envelope is None:
            return None
        if not envelope.messages:
            raise RequestError("the request has no messages")
        conversation = _EMPTY.extended(self._render(api, parse, envelope.messages))
        first = body.find(envelope.messages[0])
        head = _head(body, first)
        cut = _ends(body, first, envelope.messages[:-1]) if head is not None else 0
        return ChatBody(body, envelope, conversation, None, head, cut, bucket)

    def _render(
        self, api: ChatApi, parse: Callable[[object, int], Message], raws: Sequence[msgspec.Raw]
    ) -> list[Rendered]:
        def render(raw: msgspec.Raw) -> Rendered:
            message = parse(msgspec.json.decode(raw), 0)
            if self.template is not None:
                return _rendered(raw, message["role"], [], None, message, packed(message))
            return _rendered(raw, message["role"], [message_segment(message)], None)

        return [self.segments.get(api, raw, render) for raw in raws]

    def facts(
        self,
        read: ChatBody,
        api: ChatApi,
        tokenizer: Tokenizer,
        block_size: int,
        memo: BlockMemo | None,
    ) -> RequestFacts:
        """The facts ``analyze_request`` finds in the whole body (with this reader's
        template, if any); the body's prefix is kept for the bodies that extend it."""
        envelope = read.envelope
        extra = envelope.chat_template_kwargs
        if extra is not None and not isinstance(extra, dict):
            raise RequestError("chat_template_kwargs must be an object")
        tools = self.segments.get("tools", envelope.tools, _render_tools)
        # An OpenAI body's system messages sit in ``messages``; a top-level one is not read.
        system = _NONE
        if api == "messages":
            system = self.segments.get("system", envelope.system, _render_system)
        conversation = read.conversation
        rendering = self._rendering(conversation, tools, system, extra)
        known = read.known.run if read.known is not None else None
        prompt = hash_segments(rendering.segments, tokenizer, block_size, memo, known)
        opened = read.known.session if read.known is not None else None
        if opened is not None and opened[0] == system.text:
            session = opened[1]
        else:
            session = _session(_PARSERS[api], conversation.messages, system.text)
        facts = facts_of(rendering, conversation.turns, session, prompt)
        grown = read.known is None or read.cut > read.known.length
        if read.head is not None and read.cut > _HEAD_BYTES and grown:
            kept = conversation.without_last()
            # All of it: the next turn's rendering shares as much of it as it can.
            run = prompt.run(rendering.segments)
            users = (m.role == "user" for m in kept.messages)
            opening = (system.text, session) if any(users) else None
            prefix = _prefix(read.body, read.cut, read.head, kept, run, read.bucket, opening)
            self.prefixes.keep(prefix, read.known)
        return facts

    def _rendering(
        self, conversation: Conversation, tools: Rendered, system: Rendered, extra: Any
    ) -> Rendering:
        """The prompt: each message's kept segment after the tools' and the system
        prompt's, or the model's template over the messages it reads (spliced onto the
        previous turn's rendering where it allows)."""
        if self.template is None:
            head = [*tools.segments, *system.segments]
            parts = [(m.role, m.segments[0]) for m in conversation.messages]
            return rendering_of(head, parts)
        identity = Packed(conversation.packs, tools.packed)
        return self.template.render(conversation.values, system.text, tools.value, extra, identity)


_ADDED = "smetric.added"


class _Tail(Envelope):
    """What follows a kept prefix, its new messages under a key of the router's: a
    ``messages`` key here would be a second one, which replaces the whole list (the
    whole-body path reads it)."""

    added: list[msgspec.Raw] = msgspec.field(default_factory=list, name=_ADDED)


_TAIL_DECODER = msgspec.json.Decoder(_Tail)
_OPENED = b'{"' + _ADDED.encode() + b'":['  # the tail's messages, the list left open


def _tail(body: bytes, start: int) -> _Tail | None:
    """What follows a kept prefix (which ends with a message): the new messages and the
    fields after them."""
    at = _skip(_SPACE, body, start)
    if at == len(body) or body[at] not in b",]":
        return None
    rest = memoryview(body)[at + 1 if body[at] == ord(",") else at :]
    opened = _OPENED + rest
    try:
        tail = _TAIL_DECODER.decode(opened)
    except (msgspec.DecodeError, RecursionError):
        return None
    return tail if tail.messages is None else None


def _merged(head: Envelope, tail: _Tail) -> Envelope:
    """The fields before the messages (the prefix's) and after them (the tail's); a field
    sent twice takes its last value, as JSON parsers do."""

    def last(name: str) -> Any:
        value = getattr(tail, name)
        absent = value is None or (isinstance(value, msgspec.Raw) and not value)
        return getattr(head, name) if absent else value

    return Envelope(**{name: last(name) for name in _FIELDS})


def _ends(body: bytes, start: int, raws: Sequence[msgspec.Raw]) -> int:
    """Where the last of ``raws`` ends in ``body``, they being there one after another
    from ``start`` with only separators between them; 0 if they are not."""
    at = start
    for raw in raws:
        at = _skip(_BETWEEN, body, at)
        if not body.startswith(raw, at):
            return 0
        at += len(raw)
    return at


def _skip(pattern: re.Pattern[bytes], body: bytes, at: int) -> int:
    """Past what ``pattern`` (which matches the empty string too) matches at ``at``."""
    match = pattern.match(body, at)
    assert match is not None
    return match.end()


def _head(body: bytes, first: int) -> Envelope | None:
    """The top-level fields before the messages, ``first`` being where the first starts:
    the body up to it with the array and the object closed; None if that is not how the
    body reads."""
    head = read_envelope(body[:first] + b"]}") if first > 0 else None
    return head if head is not None and head.messages == [] else None


def _session(
    parse: Callable[[object, int], Message], messages: Sequence[Rendered], system: str | None
) -> str:
    """The session key, from the messages through the first user one: as the template
    read them, else decoded again (an opening is a message or two)."""
    opening = []
    for i, message in enumerate(messages):
        value = message.value
        opening.append(value if value is not None else parse(msgspec.json.decode(message.raw), i))
        if message.role == "user":
            break
    return session_key(opening, system)


def _render_tools(raw: msgspec.Raw) -> Rendered:
    tools = checked_tools(decoded(raw))
    return _rendered(raw, "", tools_segments(tools), None, tools, packed(tools))


def _render_system(raw: msgspec.Raw) -> Rendered:
    """An Anthropic top-level system prompt."""
    text = anthropic_system(decoded(raw))
    return _rendered(raw, "", system_segments(text), text)
