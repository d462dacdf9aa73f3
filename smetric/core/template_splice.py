"""A follow-up's chat-template rendering from the previous turn's, rendering only its end.

An agent resends its whole conversation on every call, and a model's Jinja template renders
all of it at once: at 300 messages that is milliseconds per render, nearly all of it the
sandbox's checks on every attribute the template reads, for text the router rendered one
turn earlier. ``TemplateSplicer`` keeps the last rendering of each conversation it saw
(bounded in bytes, least recently used first out) and renders a follow-up as an edit of it:

- a **window** of the messages is rendered as the previous request had them and as they
  are now: the leading system messages, the last user message before the window's start
  (an anchor: templates such as Qwen3's and Mistral's treat the last user query apart)
  and the messages from one before the last assistant message of either request (and at
  least two of the previous request) onwards, the window's first message at the same
  index parity as in the conversation (templates that check alternation compare
  ``loop.index0 % 2``);
- where the two window texts part, the kept rendering is cut and the new window's
  remainder appended. The history (up to the last assistant message, without the
  generation prompt) is spliced the same way from a window render of its own, so no
  render reads the whole conversation.

**Soundness.** Checked on every request: the kept rendering's messages are, byte for
byte, the first of the request's (as MessagePack, which tells ``true`` from ``1`` and
``1`` from ``1.0`` and keeps key order, as ``tojson`` does and Python's ``==`` does not),
with the same tools and template arguments; and the windows of the previous messages
reproduce the kept renderings, the full prompt's and the history's, from the end of the
window's first message's content on (everything after the context the window replaced),
so a window missing something the template reads of earlier messages shows there (the
user message Qwen3 counts reasoning from, for one). What remains assumed is that the new
messages render in the window as in the whole conversation, and that appending them does
not change how messages before the window render. No check on a pair of texts proves
that of arbitrary template code, so it is established per template and per kind of
extension (tool turns, which add only assistant and tool messages; other extensions,
which add a user message):

1. a **probe**, at start-up, splices every extension by one to three messages of several
   synthetic conversations (system or not, tools or not, tool calls, parallel calls,
   reasoning, consecutive tool results, strict user/assistant alternation, a user
   repeating earlier words, one long conversation) and compares each with the whole
   render; a mismatch turns that kind off (tool turns off, both off);
2. a **sample** of the spliced renderings in use (one in ``SAMPLE``) is compared with the
   whole render; a mismatch turns that kind off for good, is counted and logged once.

What is off renders whole, as before, and so does a request whose window the template
refuses or whose checks fail. Qwen3 (reasoning dropped before the last user query) and
Mistral (tools before every user message equal to the last one) splice tool turns and
render user turns whole; ChatML and Llama 3.1 (tools in the first user message) splice
both. A template that passes the probe yet depends on the whole conversation in a way no
probe conversation and no window shows (a line crossed at some number of messages, say)
splices wrongly until a sample catches it: the checks make that unlikely, not
impossible. A wrong rendering costs routing quality for that request
(its blocks and hit estimate), never a wrong answer: the engine renders the request itself.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import msgspec
import xxhash

from smetric.core.parsing import Message
from smetric.core.rendering import Rendering

__all__ = ["Cuts", "Kept", "Packed", "Spliced", "TemplateSplicer", "identify", "last_of", "packed"]

log = logging.getLogger(__name__)

Kind = Literal["tools", "any"]
_Sliced = TypeVar("_Sliced", str, list[int])
# Render ``messages`` with or without the generation prompt (raises on a refusal).
Render = Callable[[Sequence[Message], bool], str]

# One spliced rendering in this many is checked against the whole render: under 1 %, so a
# check's cost (the whole render) stays out of the 99th percentile.
SAMPLE = 128
# Messages of the previous request the window takes again, so that a template looking a
# few messages back or ahead (Qwen's consecutive tool results) sees them in both windows.
_LOOKBACK = 2
# A window longer than this is not worth it: the conversation renders whole.
_MAX_WINDOW = 64
# Entries per bucket (conversations opening alike), most recent first.
_BUCKET = 8
_ENTRY_OVERHEAD = 500
# The most a string's header costs (a non-ASCII one's; an ASCII one's is 49 bytes).
_STR_HEADER = 80
_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class Cuts:
    """Where a rendering's text was cut, and what found those places, which a follow-up's
    rendering starts from: ``ends`` and ``lost``, where each message's content ends and
    the first one not found (``conversation._content_ends``); ``signature`` and ``turns``,
    the markup around the history end and where else it was found
    (``_like_the_history_end``); ``stops``, where each segment stops."""

    ends: list[int]
    lost: int
    signature: str
    turns: list[int]
    stops: list[int]


@dataclass(frozen=True, slots=True)
class Kept:
    """A conversation's whole rendering, kept for its follow-ups.

    ``request``: its messages and context as the splicer identifies them (``identify``).
    ``cuts``: where ``text`` was cut into ``rendering``'s segments, whose strings a
    follow-up reuses (the block memo finds them by identity). ``last_user``: the index of
    its last user message (-1: none). ``history_tail``: the history's rendering after
    ``history_end``, where it parts from ``text``.
    """

    request: Request
    count: int
    text: str
    cuts: Cuts
    last_user: int
    history_end: int
    history_tail: str
    rendering: Rendering

    @property
    def nbytes(self) -> int:
        """What it costs in memory: the text, and its segments (pieces of it, none wider
        per character, each with a string's header: an upper bound, without a pass over
        the segments), the history's tail, the identity, the offsets."""
        return (
            2 * sys.getsizeof(self.text)
            + _STR_HEADER * len(self.rendering.segments)
            + sys.getsizeof(self.history_tail)
            + self.request.nbytes
            + len(self.request.context)
            + 8 * (len(self.cuts.ends) + len(self.cuts.turns) + len(self.cuts.stops))
            + _ENTRY_OVERHEAD
        )


@dataclass(frozen=True, slots=True)
class Spliced:
    """A follow-up's rendering from a kept one: ``text`` equals ``kept.text`` up to
    ``shared``; ``history_end`` as the whole render would find it, and the history's
    rendering after it."""

    kept: Kept
    text: str
    shared: int
    history_end: int
    history_tail: str


@dataclass(frozen=True, slots=True)
class Request:
    """A request's messages as the splicer identifies them: each packed alone (a follow-up's
    earlier ones the very objects its previous turn packed, so comparing them is mostly
    comparing pointers), and what they take in bytes."""

    context: bytes
    items: tuple[bytes, ...]
    nbytes: int
    bucket: int


def packed(value: object) -> bytes | None:
    """``value`` as MessagePack; None where it does not encode (a client's 2**70 integer)."""
    try:
        return _ENCODER.encode(value)
    except (TypeError, OverflowError, ValueError, RecursionError):
        return None


@dataclass(frozen=True, slots=True)
class Packed:
    """A request's messages (each alone) and tools as MessagePack (``packed``), where the
    caller holds them already: a follow-up's earlier messages were packed when first seen."""

    messages: Sequence[bytes | None]
    tools: bytes | None


def identify(messages: Sequence[bytes | None], context: Sequence[bytes | None]) -> Request | None:
    """A request from its messages and the rest of what the template sees (tools, template
    arguments), each packed alone (``packed``): encodings are prefix free, so the context's
    joined still tell where each part ends. None where a part did not encode: the request
    renders whole."""
    if None in messages or None in context:
        return None
    items = tuple(cast("Sequence[bytes]", messages))
    context_bytes = b"".join(cast("Sequence[bytes]", context))
    first = items[0] if items else b""
    nbytes = sum(map(len, items)) + 8 * len(items)
    return Request(context_bytes, items, nbytes, xxhash.xxh3_64_intdigest(context_bytes + first))


def kind_of(added: Sequence[Message]) -> Kind:
    """The kind of an extension: tool turns add only assistant and tool messages."""
    return "tools" if all(m["role"] in ("assistant", "tool") for m in added) else "any"


def common_prefix_length(a: _Sliced, b: _Sliced) -> int:
    """Length of the longest common prefix, by C-speed slice comparisons: back from the end
    in doubling steps (renderings of one conversation part near their end), then by
    bisection."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    # Invariant: a[:low] == b[:low] and a[:high] != b[:high].
    step = 1
    while high - step > low:
        if a[: high - step] == b[: high - step]:
            low = high - step
            break
        high -= step
        step *= 2
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


def window(
    messages: Sequence[Message], previous: int, start: int, last_user: int
) -> tuple[list[int], int] | None:
    """The indices of the messages the splice renders (see the module's docstring), starting
    at or before ``start``, and how many of them come before it (the system messages and the
    anchor); None where the window would be (nearly) the whole conversation anyway.
    ``last_user``: the last user message among the first ``previous`` (-1: none), the anchor
    unless the window starts before it, found without walking back over an agent's tool
    loop."""
    heads = 0
    while heads < len(messages) and messages[heads]["role"] == "system":
        heads += 1
    start = min(start, previous - _LOOKBACK)
    while start > heads:
        found = last_user if last_user < start else last_of(messages, "user", start)
        anchor = found if found >= 0 else None
        first = heads + (anchor is not None)
        if (start - first) % 2:
            start -= 1
            continue
        if start == first or len(messages) - start + first > _MAX_WINDOW:
            return None  # the whole conversation, or most of a long one
        before = [*range(heads), *([anchor] if anchor is not None else [])]
        return [*before, *range(start, len(messages))], len(before)
    return None


def splice(
    render: Render, messages: Sequence[Message], kept: Kept, last_assistant: int
) -> Spliced | None:
    """The rendering of ``messages`` (which extend ``kept``'s) as an edit of ``kept.text``,
    or None where no window fits or a window does not reproduce the end of the kept
    renderings. ``render``'s refusals propagate.

    Each window of the previous messages must end as the kept rendering does from the end
    of the content of its first message after the context (the system messages and the
    anchor) on: the full
    prompt's window as ``kept.text`` and the history's as the kept history, which is where
    a window missing something the template reads of earlier messages (the user message
    it counts reasoning from, say) shows.
    """
    prior = last_of(messages, "assistant", kept.count)
    # Both histories' last assistant messages lie in the window, after its first message.
    start = min((i for i in (last_assistant, prior) if i >= 0), default=kept.count)
    found = window(messages, kept.count, start - 1, kept.last_user)
    if found is None:
        return None
    indices, before = found
    # The anchor, not the system messages: a long system prompt would cost a search per
    # window, and starting early only makes the checks stricter.
    context = [messages[i] for i in indices[:before] if messages[i]["role"] != "system"]
    first = messages[indices[before]] if indices[before] < kept.count else None
    old = render([messages[i] for i in indices if i < kept.count], True)
    new = render([messages[i] for i in indices], True)
    reach = _reach(old, context, first)
    edit = _edit_at(kept.text, old, new, reach)
    if edit is None:
        return None
    shared, common = edit
    text = kept.text[:shared]
    text += new[common:]  # in place: the slice is this frame's alone, so no second copy
    if prior >= 0:
        old_history = render([messages[i] for i in indices if i <= prior], False)
        if not _ends_history(kept, old_history[_reach(old_history, context, first) :]):
            return None
    history_end, history_tail = 0, ""
    if last_assistant >= 0:
        history = render([messages[i] for i in indices if i <= last_assistant], False)
        edit = _edit_at(kept.text, old, history, reach)
        if edit is None:
            return None
        upto, common = edit
        start = min(shared, upto)
        tail = kept.text[start:upto] + history[common:]
        history_end = start + common_prefix_length(tail, text[start:])
        history_tail = tail[history_end - start :]
    return Spliced(kept, text, shared, history_end, history_tail)


def last_of(messages: Sequence[Message], role: str, count: int | None = None) -> int:
    """The index of the last ``role`` message (among the first ``count``), -1 without one."""
    top = len(messages) if count is None else count
    return next((i for i in range(top - 1, -1, -1) if messages[i]["role"] == role), -1)


def _reach(text: str, context: Sequence[Message], first: Message | None) -> int:
    """Where in a window's ``text`` the content of its ``first`` message after the context
    ends (searched after the contents of ``context``), from which on the window must
    render as the whole conversation does. That message renders as the window's first,
    after the context rather than after its own predecessor, so its opening markup and
    whatever a template puts before the content may differ; what follows may not. Without
    a content to find, where the context's contents end (so that message is checked too)."""
    reach = 0
    for message in context:
        content = message["content"]
        at = text.find(content, reach) if content else -1
        if at >= 0:
            reach = at + len(content)
    content = first["content"] if first is not None else ""
    at = text.find(content, reach) if content else -1
    return at + len(content) if at >= 0 else reach


def _edit_at(text: str, old: str, new: str, reach: int) -> tuple[int, int] | None:
    """Where the edit from window text ``old`` to ``new`` begins in ``text`` and in the
    windows; None where ``text`` does not end with ``old`` from ``reach`` (or from where
    the windows part, if earlier)."""
    common = common_prefix_length(old, new)
    if not text.endswith(old[min(common, reach) :]):
        return None
    return len(text) - (len(old) - common), common


def _ends_history(kept: Kept, suffix: str) -> bool:
    """Whether the kept conversation's history rendering ends with ``suffix``."""
    tail = kept.history_tail
    if len(suffix) <= len(tail):
        return tail.endswith(suffix)
    head = suffix[: len(suffix) - len(tail)]
    return suffix.endswith(tail) and kept.text.startswith(head, kept.history_end - len(head))


class TemplateSplicer:
    """The kept renderings of one template, bounded in bytes, and its verdicts on which
    kinds of extension splice exactly (probed once, refuted by a sampled whole render);
    safe across threads."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.spliced = 0
        self.mismatches = 0
        self._allowed: dict[Kind, bool] | None = None
        self._buckets: OrderedDict[int, list[Kept]] = OrderedDict()
        self._lock = threading.Lock()

    def allowed(self, kind: Kind, probe: Callable[[], dict[Kind, bool]]) -> bool:
        """Whether ``kind`` of extension may be spliced, probing once on first use."""
        if self._allowed is None:
            verdict = probe()
            with self._lock:
                if self._allowed is None:
                    self._allowed = verdict
        return self._allowed[kind]

    def sampled(self) -> bool:
        """Whether this splice is one checked against the whole render (every SAMPLE-th)."""
        with self._lock:
            self.spliced += 1
            return self.spliced % SAMPLE == 0

    def refute(self, kind: Kind) -> None:
        """A spliced rendering differed from the whole one: that kind renders whole for good."""
        with self._lock:
            self.mismatches += 1
            first = self.mismatches == 1
            assert self._allowed is not None
            self._allowed[kind] = False
            if kind == "tools":
                self._allowed["any"] = False
        if first:
            log.warning(
                "the chat template's incremental rendering differed from the whole render; "
                "%s extensions now render whole",
                "all" if kind == "tools" else "user-turn",
            )

    def find(self, request: Request, count: int) -> Kept | None:
        """The longest kept rendering of the same context whose messages lead ``request``'s
        (at most ``count`` of them)."""
        with self._lock:
            bucket = self._buckets.get(request.bucket)
            if bucket is None:
                return None
            self._buckets.move_to_end(request.bucket)
            candidates = list(bucket)
        best = None
        for kept in candidates:
            if (
                kept.count <= count
                and (best is None or kept.count > best.count)
                and kept.request.context == request.context
                and request.items[: kept.count] == kept.request.items
            ):
                best = kept
        return best

    def keep(self, kept: Kept, replacing: Kept | None) -> None:
        """Keep ``kept`` in place of the rendering it extended."""
        if kept.nbytes > self.max_bytes:
            return
        items, key = kept.request.items, kept.request.bucket
        with self._lock:
            bucket = self._buckets.setdefault(key, [])
            self._buckets.move_to_end(key)
            for old in [e for e in bucket if e is replacing or e.request.items == items]:
                bucket.remove(old)
                self.nbytes -= old.nbytes
            bucket.insert(0, kept)
            self.nbytes += kept.nbytes
            while len(bucket) > _BUCKET:
                self.nbytes -= bucket.pop().nbytes
            while self.nbytes > self.max_bytes and self._buckets:
                key, oldest = next(iter(self._buckets.items()))
                if not oldest:
                    del self._buckets[key]
                    continue
                self.nbytes -= oldest.pop().nbytes


def _call(i: int) -> dict[str, Any]:
    arguments = f'{{"path": "src/m{i}.py"}}'
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "read", "arguments": arguments},
    }


def _probe_conversations() -> list[tuple[list[Any] | None, list[dict[str, Any]], int]]:
    """Synthetic conversations in the shapes agents and chats send, with their tools and
    the first length to extend from."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read",
                "description": "Read a file.",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]
    agent: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the failing test."},
    ]
    for i in range(3):
        agent += [
            {
                "role": "assistant",
                "content": "" if i else "Looking.",
                "reasoning_content": f"Step {i}.",
                "tool_calls": [_call(i)],
            },
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"def f{i}(): pass"},
        ]
    agent += [
        {"role": "assistant", "content": "Fixed.", "reasoning_content": "Done."},
        {"role": "user", "content": "Now run the tests."},
        {"role": "assistant", "content": "", "tool_calls": [_call(7)]},
        {"role": "tool", "tool_call_id": "call_7", "content": "<tool_response>ok"},
        {"role": "assistant", "content": "All pass."},
        {"role": "user", "content": "Thanks."},
    ]
    parallel: list[dict[str, Any]] = [
        {"role": "user", "content": "Read both files."},
        {"role": "assistant", "content": "", "tool_calls": [_call(1), _call(2)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
        {"role": "assistant", "content": "Both read."},
        {"role": "user", "content": "Good."},
        {"role": "assistant", "content": "", "tool_calls": [_call(3)]},
        {"role": "tool", "tool_call_id": "call_3", "content": "three"},
    ]
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "<think>\nGreet.\n</think>\n\nHello."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6."},
        {"role": "user", "content": "Bye."},
    ]
    # A user repeating earlier words: templates that find the last user message by
    # equality (Mistral's) mark every message equal to it, out of any window.
    said = ["Go on.", "Why?", "Stop.", "Again."]
    plain = [
        {"role": "user", "content": said[i // 2 % 4]}
        if i % 2 == 0
        else {"role": "assistant", "content": f"Message {i}."}
        for i in range(17)
    ]
    # Longer than a window many times over, extended only at its end: templates that
    # change with the conversation's length show here.
    long = agent[:2] + [dict(m) for _ in range(12) for m in agent[2:8]] + agent[8:]
    return [
        (tools, agent, 1),
        (tools, parallel, 1),
        (None, chat, 1),
        (tools, plain, 1),
        (tools, long, len(long) - 6),
    ]


def probe(
    check: Callable[[list[Any] | None, list[dict[str, Any]], int], bool | None],
) -> dict[Kind, bool]:
    """The verdict per kind of extension: ``check(tools, messages, previous)`` splices the
    first ``previous`` of ``messages`` to all of them and says whether that equals the whole
    render (None: no evidence, as where either render is refused or no window fits)."""
    allowed: dict[Kind, bool] = {"tools": True, "any": True}
    for tools, messages, first in _probe_conversations():
        for previous in range(first, len(messages)):
            for added in (1, 2, 3):
                if previous + added > len(messages):
                    break
                kind = kind_of(messages[previous : previous + added])
                if check(tools, messages[: previous + added], previous) is False:
                    allowed[kind] = False
                    if kind == "tools":
                        allowed["any"] = False
    return allowed
