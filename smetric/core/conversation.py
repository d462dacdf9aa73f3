"""What the live router learns from one request body alone: turn, expected hit, blocks.

The router keeps no session table (docs/concepts/architecture.md), so everything a policy
needs must come from the body of each request:

- **turn**: the number of assistant messages in it. An agent resends its whole conversation
  on every call, so the count says how many earlier calls this session made; 0 means a
  session's first request.
- **history**: every message up to and including the last assistant message. The engine
  that served the previous turn prefilled all of it (that turn's prompt) and produced the
  last assistant message itself, so this prefix is what a follow-up should find cached
  there. ``est_hit_tokens`` is the token count of the rendered history, and
  ``prompt_tokens`` that of the whole rendered prompt. A request without an assistant
  message has no history: ``est_hit_tokens`` is 0.
- **session_key**: a digest of the conversation's opening (system prompt and first user
  message), which every later turn repeats verbatim, so session hashing keeps a session on
  one instance without any table. It is computed from the text, not the tokens, so router
  replicas configured with different tokenizers still agree.
- **blocks**: the chained block ids of the rendered prompt (``core/blocks``), to look the
  request up in per-engine prefix indexes.

Four request shapes are understood, each parsed in its own module: OpenAI chat
(``core/openai_api``: ``messages`` with roles, string or part-list content, ``tool_calls``,
``role: tool``), Anthropic Messages (``core/anthropic_api``: ``system`` plus ``messages`` of
any role whose content may hold ``text``, ``tool_use``, ``tool_result`` and other
blocks), OpenAI Responses (``core/responses_api``: ``instructions`` plus ``input`` items,
one response's items counting as one assistant message) and OpenAI completions
(``prompt`` as text or token ids; no structure, so turn 0 and no expected hit). Any
malformed body raises ``RequestError`` (``core/parsing``) and nothing else, so the router
can answer 400 without guarding against surprises.

Rendering matters because blocks are only comparable when every turn of a session renders
its shared prefix identically. The default ``render_chat`` template is generic, but it has
the property the router needs: a request's full prompt (ending in the generation prompt) is
a text prefix of the next turn's history, so a follow-up's blocks start with all of the
previous request's full blocks. ``ChatTemplate`` renders a model's own Jinja template
instead, for token counts that match the engine's. Either way the rendering comes cut at
message boundaries into segments tokenised one by one, which is what lets the router's
memo (``core/block_memo``) skip the history a follow-up re-sends.
"""

from __future__ import annotations

import bisect
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import jinja2.ext
import numpy as np
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from smetric.core.anthropic_api import anthropic_messages, anthropic_system
from smetric.core.block_memo import BlockMemo, PromptBlocks, hash_segments
from smetric.core.blocks import Tokenizer, chain_hashes
from smetric.core.openai_api import chat_messages, completion_prompt
from smetric.core.parsing import Message, RequestError, digest, kind, to_json
from smetric.core.policies import RoutingRequest
from smetric.core.rendering import Rendering
from smetric.core.responses_api import responses_instructions, responses_messages
from smetric.core.template_splice import (
    Cuts,
    Kept,
    Kind,
    Packed,
    Render,
    Request,
    Spliced,
    TemplateSplicer,
    common_prefix_length,
    identify,
    kind_of,
    last_of,
    packed,
    probe,
    splice,
)

__all__ = ["Api", "ChatTemplate", "RequestError", "RequestFacts", "analyze_request"]

Api = Literal["chat", "messages", "responses", "completions"]

_GENERATION_PROMPT = "<|assistant|>\n"
# How far past a message's content ``ChatTemplate`` looks for the next one: template markup
# between two messages (headers, tool schemas) is far shorter.
_MARKUP_WINDOW = 64 << 10
# How much of the markup on each side of the history end identifies the end of a turn.
_SIGNATURE = 32


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """Everything routing needs from one request, derived from its body alone."""

    turn: int
    prompt_tokens: int
    est_hit_tokens: int
    session_key: str
    # One chained id per full block of ``token_ids``.
    blocks: np.ndarray
    # The prompt's tokens in pieces (one per rendered segment), joined only when asked for:
    # routing needs the blocks, only an engine needs the tokens.
    token_parts: Sequence[np.ndarray]

    @property
    def token_ids(self) -> np.ndarray:
        """The prompt's token ids, int64."""
        parts = self.token_parts
        if len(parts) <= 1:
            return parts[0].astype(np.int64) if parts else np.empty(0, dtype=np.int64)
        return np.concatenate(list(parts)).astype(np.int64)

    def routing_request(self) -> RoutingRequest:
        """The subset a policy sees."""
        return RoutingRequest(
            turn=self.turn,
            prompt_tokens=self.prompt_tokens,
            est_hit_tokens=self.est_hit_tokens,
            session_key=self.session_key,
        )


def analyze_request(
    body: object,
    api: Api,
    tokenizer: Tokenizer,
    block_size: int,
    template: ChatTemplate | None = None,
    memo: BlockMemo | None = None,
) -> RequestFacts:
    """Turn, expected hit, session key, tokens and blocks of one request body.

    ``body`` is the decoded JSON; any JSON value either analyses or raises ``RequestError``.
    ``template`` (chat and messages only) replaces the generic rendering with a model's chat
    template. ``memo`` (for this tokenizer and block size) spares re-encoding and re-hashing
    the segments an earlier request already had; the facts are the same without it. The
    history is a whole number of segments, so ``est_hit_tokens`` is exactly the history's
    share of ``token_ids``. A body that ends in an assistant message (a prefill to continue)
    has all its messages in the history, since nothing follows them.
    """
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {kind(body)}")
    if api == "completions":
        return _completion_facts(body, tokenizer, block_size, memo)
    if api == "chat":
        messages, system = chat_messages(body), None
    elif api == "messages":
        messages, system = anthropic_messages(body), anthropic_system(body.get("system"))
    elif api == "responses":
        messages, system = responses_messages(body), responses_instructions(body)
    else:
        raise ValueError(
            f"unknown api {api!r}; expected 'chat', 'messages', 'responses' or 'completions'"
        )
    tools = checked_tools(body.get("tools"))
    extra = body.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise RequestError(f"chat_template_kwargs must be an object, got {kind(extra)}")
    if template is None:
        rendering = render_chat(messages, system, tools)
    else:
        rendering = template.render(messages, system, tools, extra)
    turn = sum(message["role"] == "assistant" for message in messages)
    prompt = hash_segments(rendering.segments, tokenizer, block_size, memo)
    return facts_of(rendering, turn, session_key(messages, system), prompt)


def facts_of(rendering: Rendering, turn: int, session: str, prompt: PromptBlocks) -> RequestFacts:
    """The facts of a rendered conversation, ``prompt`` its segments hashed."""
    return RequestFacts(
        turn=turn,
        prompt_tokens=prompt.tokens,
        est_hit_tokens=prompt.tokens_in(rendering.history),
        session_key=session,
        blocks=prompt.blocks,
        token_parts=prompt.token_parts,
    )


def checked_tools(tools: object) -> list[Any] | None:
    if tools is not None and not isinstance(tools, list):
        raise RequestError(f"tools must be a list, got {kind(tools)}")
    return tools


def render_chat(
    messages: Sequence[Message], system: str | None = None, tools: list[Any] | None = None
) -> Rendering:
    """The generic rendering, one segment per message (and per tools and system header).

    The format is ``<|role|>\\n{content}\\n`` per message, assistant ``tool_calls`` as JSON
    on the line after the content, preceded by ``<|tools|>\\n{tools JSON}\\n`` and
    ``<|system|>\\n{system}\\n`` when given, and followed by the generation prompt
    ``<|assistant|>\\n``. The generation prompt equals the opening of the assistant message
    that answers it, which is what makes each prompt a prefix of the next turn's history.
    ``system`` is the Anthropic top-level prompt or the Responses ``instructions``; OpenAI
    system messages sit in ``messages``.
    """
    head = [*tools_segments(tools), *system_segments(system)]
    return rendering_of(head, [(m["role"], message_segment(m)) for m in messages])


def tools_segments(tools: list[Any] | None) -> list[str]:
    """The generic rendering's tools header: none for no tools."""
    return [f"<|tools|>\n{to_json(tools)}\n"] if tools else []


def system_segments(system: str | None) -> list[str]:
    """The generic rendering's system header: none for no system prompt."""
    return [] if system is None else [f"<|system|>\n{system}\n"]


def message_segment(message: Message) -> str:
    """One message as the generic rendering writes it."""
    return f"<|{message['role']}|>\n{_message_body(message)}\n"


def rendering_of(head: list[str], messages: Sequence[tuple[str, str]]) -> Rendering:
    """The generic rendering from its header segments and each message's role and segment:
    the history runs through the last assistant message."""
    segments, history = list(head), 0
    for role, segment in messages:
        segments.append(segment)
        if role == "assistant":
            history = len(segments)
    segments.append(_GENERATION_PROMPT)
    return Rendering(segments, history)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox (which Hugging Face and vLLM render chat templates in),
    remembering its verdict on each attribute a template reads.

    The verdict depends on the object's type and the attribute's name alone
    (``is_internal_attribute``, ``modifies_known_mutable``: ``isinstance`` tests and name
    sets), and a template asks the same few for every message it renders (``loop.first``):
    asking again was nearly half of a short render's time. Only attributes an object has
    are asked about, so the types and names seen bound the verdicts; ``_VERDICTS`` bounds
    them anyway."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = super().is_safe_attribute(obj, attr, value)
            if len(self._verdicts) < _VERDICTS:
                self._verdicts[key] = verdict
        return verdict


_VERDICTS = 4096


class ChatTemplate:
    """A model's own chat template (the Jinja string in its ``tokenizer_config.json``).

    The template runs in Jinja's immutable sandbox, configured as Hugging Face's
    ``apply_chat_template`` configures it (trimmed blocks, loop controls, ``raise_exception``,
    a non-escaping ``tojson``), so templates written for engines render the same text here.
    ``strftime_now`` is left out on purpose: a clock would make rendering impure, and the
    templates that use it check that it is defined.

    The full prompt renders with ``add_generation_prompt=True``; the history renders the
    messages up to the last assistant message with ``add_generation_prompt=False``, and the
    history ends where the two texts stop agreeing. Some templates render an assistant
    message differently when it is last (Qwen3 drops earlier turns' reasoning, for example);
    the common prefix then ends early, which is also where the engine's cached prefix stops
    matching. ``est_hit_tokens`` is an estimate either way, and the SMetric policy tolerates
    drift through its ``HIT_RATIO``. Message content reaches the template as plain text
    (part lists flattened), which suits text-only templates.

    The text is cut after each message's content, at the history end, and wherever an
    earlier turn closed as the history end does (``_like_the_history_end``), so a
    follow-up's segments are the previous turn's plus its own. A follow-up of a
    conversation rendered before renders only its last messages, spliced onto the kept
    rendering where this template has been checked to allow it (``core.template_splice``,
    which argues why that equals the whole render); otherwise it renders whole, as above.
    """

    def __init__(
        self, template: str, bos_token: str = "", eos_token: str = "", keep_bytes: int = 64 << 20
    ) -> None:
        environment = _Sandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        # Compiling here makes a broken template fail at start-up, not on every request.
        self._template = environment.from_string(template)
        # Its globals as one dict: Jinja's view over its own and the environment's is
        # flattened again on every render otherwise, and neither changes from here on.
        self._template.globals = dict(self._template.globals)
        self.bos_token = bos_token
        self.eos_token = eos_token
        # The renderings follow-ups are spliced onto, bounded by ``keep_bytes``.
        self.splicer = TemplateSplicer(keep_bytes)

    def prepare(self, keep_bytes: int) -> None:
        """Bound the kept renderings by ``keep_bytes`` and probe the template now (a few
        dozen small renders), at start-up rather than on the first follow-up."""
        self.splicer.max_bytes = keep_bytes
        self.splicer.allowed("tools", self._probe)

    def render(
        self,
        messages: Sequence[Message],
        system: str | None = None,
        tools: list[Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        known: Packed | None = None,
    ) -> Rendering:
        """The rendered prompt cut after each message's content and where the history ends.

        ``extra`` carries the request's ``chat_template_kwargs`` (``enable_thinking``, ...);
        it cannot override the messages, tools or special tokens. A follow-up of a
        conversation rendered before is spliced onto that rendering where the template
        allows it (``core.template_splice``); the result is the same. ``known``: the
        messages and tools already packed, as the splicer identifies them (else they are
        packed here).
        """
        if known is None:
            known = Packed([packed(m) for m in messages], packed(tools))
        items = known.messages
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
            items = [packed(messages[0]), *items]
        context = {
            **(extra or {}),
            "tools": tools,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        last = last_of(messages, "assistant")
        request = identify(items, [known.tools, packed(extra)])
        kept = None if request is None else self.splicer.find(request, len(messages))
        if kept is not None and kept.count == len(messages):
            return kept.rendering  # the same conversation again
        if kept is not None:
            assert request is not None
            spliced = self._splice(messages, context, kept, last, request)
            if spliced is not None:
                self.splicer.keep(spliced[1], kept)
                return spliced[0]
        rendering, made = self._whole(messages, context, last, request)
        if made is not None:  # made only for an identified request
            self.splicer.keep(made, kept)
        return rendering

    def _whole(
        self,
        messages: Sequence[Message],
        context: dict[str, Any],
        last: int,
        request: Request | None = None,
    ) -> tuple[Rendering, Kept | None]:
        """The whole render, and what to keep of it for follow-ups (given ``request``)."""
        full = self._render(messages, True, context)
        history_end, history_tail = 0, ""
        if last >= 0:
            history = self._render(messages[: last + 1], False, context)
            history_end = common_prefix_length(history, full)
            history_tail = history[history_end:]
        rendering, cuts = _cut_text(full, messages, history_end)
        if request is None:
            return rendering, None
        made = Kept(
            request=request,
            count=len(messages),
            text=full,
            cuts=cuts,
            last_user=last_of(messages, "user"),
            history_end=history_end,
            history_tail=history_tail,
            rendering=rendering,
        )
        return rendering, made

    def _splice(
        self,
        messages: Sequence[Message],
        context: dict[str, Any],
        kept: Kept,
        last: int,
        request: Request,
    ) -> tuple[Rendering, Kept] | None:
        """The rendering of a follow-up of ``kept``'s conversation, spliced onto it where
        the template allows (probed once, sampled since), else None."""
        kind = kind_of(messages[kept.count :])
        splicer = self.splicer
        if not splicer.allowed(kind, self._probe):
            return None

        try:
            spliced = splice(self._windows(context), messages, kept, last)
        except Exception:
            return None  # a window the template refuses: the whole render decides
        if spliced is None:
            return None
        rendering, cuts = _cut_text(spliced.text, messages, spliced.history_end, spliced)
        if splicer.sampled():
            whole, _ = self._whole(messages, context, last)
            if whole != rendering:
                splicer.refute(kind)
                return None
        added_user = last_of(messages[kept.count :], "user")
        made = Kept(
            request=request,
            count=len(messages),
            text=spliced.text,
            cuts=cuts,
            last_user=kept.count + added_user if added_user >= 0 else kept.last_user,
            history_end=spliced.history_end,
            history_tail=spliced.history_tail,
            rendering=rendering,
        )
        return rendering, made

    def _probe(self) -> dict[Kind, bool]:
        """Which kinds of extension this template splices exactly (``template_splice.probe``)."""
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token}

        def check(
            tools: list[Any] | None, messages: list[dict[str, Any]], previous: int
        ) -> bool | None:
            here = {**context, "tools": tools}
            try:
                _, made = self._whole(
                    messages[:previous], here, last_of(messages[:previous], "assistant"), _PROBE
                )
                whole, _ = self._whole(messages, here, last_of(messages, "assistant"))
            except RequestError:
                return None
            assert made is not None
            try:
                spliced = splice(
                    self._windows(here), messages, made, last_of(messages, "assistant")
                )
            except Exception:
                return None
            if spliced is None:
                return None
            return _cut_text(spliced.text, messages, spliced.history_end, spliced)[0] == whole

        return probe(check)

    def _windows(self, context: dict[str, Any]) -> Render:
        """What renders a splice's windows: the template as it is, its refusals raised."""

        def render(window: Sequence[Message], add_generation_prompt: bool) -> str:
            return self._template.render(
                context, messages=window, add_generation_prompt=add_generation_prompt
            )

        return render

    def _render(
        self, messages: Sequence[Message], add_generation_prompt: bool, context: dict[str, Any]
    ) -> str:
        try:
            return self._template.render(
                context, messages=messages, add_generation_prompt=add_generation_prompt
            )
        except Exception as error:
            # The template is code run on client data: whatever it raises (its own
            # raise_exception, a sandbox refusal, a type error on odd content) means this
            # request does not fit it, which is the client's 400, not the router's crash.
            raise RequestError(f"the chat template rejected the request: {error}") from error


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Hugging Face's ``tojson``: Jinja's own escapes HTML characters, which models never saw."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _content_ends(
    text: str, messages: Sequence[Message], known: Sequence[int] = ()
) -> tuple[list[int], int]:
    """Where each message's content ends in ``text``, for those found verbatim in order.

    Templates put a message's closing markup (usually a special token) right after its
    content, so these are cuts a tokeniser makes anyway. A content the template changed
    (older reasoning dropped, say) must start a bounded distance ahead, and is simply not
    a cut when missing. Per message, the offset the search reached after it (so a message
    not found repeats the one before, and the list never decreases), and the index of the
    first message with content not found (``len(messages)`` if none). ``known``: the ends
    of the first messages, all found or empty, from a text equal to this one as far as
    their searches read (``_cut_text``).
    """
    ends = list(known)
    cursor = ends[-1] if ends else 0
    lost = len(messages)
    for i in range(len(ends), len(messages)):
        content = messages[i]["content"]
        if content:
            # Find a short probe (memchr-fast), then compare the whole content in place: a
            # find of the whole content preprocesses all of it on every call.
            probe, limit = content[:64], cursor + _MARKUP_WINDOW + 64
            at = text.find(probe, cursor, limit)
            while at >= 0 and not text.startswith(content, at):
                at = text.find(probe, at + 1, limit)
            if at >= 0:
                cursor = at + len(content)
            else:
                lost = min(lost, i)
        ends.append(cursor)
    return ends, lost


def _cut(
    text: str,
    ends: list[int],
    turns: list[int],
    history_end: int,
    lent: Lent | None = None,
) -> tuple[Rendering, list[int]]:
    """``text`` cut at ``ends``, at ``history_end``, which closes the history, and where
    earlier turns closed alike (``turns``, from ``_like_the_history_end``); and where each
    segment stops.

    ``lent``, a rendering that cuts as this one up to an offset, lends its segments that
    stop by then as they are: the block memo then finds them by identity, without hashing
    their text again, and only the cuts after them are sorted out here.
    """
    count, after = 0, 0
    if lent is not None:
        count = bisect.bisect(lent.stops, lent.upto)
        after = lent.stops[count - 1] if count else 0
    later = {*ends[bisect.bisect(ends, after) :], *turns[bisect.bisect(turns, after) :]}
    if history_end > after:
        later.add(history_end)
    later.discard(len(text))
    cuts = sorted(later)
    stops = [*cuts, len(text)]
    segments = [text[a:b] for a, b in zip([after, *cuts], stops, strict=True)]
    if lent is not None:
        segments[:0] = lent.rendering.segments[:count]
        stops[:0] = lent.stops[:count]
    if history_end == 0:
        return Rendering(segments, 0), stops
    # The segment after the one that stops at the history end opens the rest.
    return Rendering(segments, bisect.bisect_left(stops, history_end) + 1), stops


@dataclass(frozen=True, slots=True)
class Lent:
    """A rendering (with where its segments stop) whose cuts equal another's up to ``upto``."""

    rendering: Rendering
    stops: list[int]
    upto: int


def _agreed(new: list[int], old: list[int]) -> int:
    """The offset through which two nondecreasing lists of offsets hold the same values."""
    same = common_prefix_length(new, old)
    firsts = [offsets[same] for offsets in (new, old) if same < len(offsets)]
    return min(firsts) - 1 if firsts else sys.maxsize


def _like_the_history_end(
    text: str,
    messages: Sequence[Message],
    ends: list[int],
    history_end: int,
    kept: Kept | None = None,
    shared: int = 0,
) -> tuple[str, list[int]]:
    """The markup around the history end (from the content end before it to the next
    content's start, at most ``_SIGNATURE`` characters each side) and the offsets where
    ``text`` reads the same way, the history end's among them.

    The history end closes an assistant message and opens the next one; every earlier
    assistant message closed alike was a request's history end when it was the last, so
    cutting there too keeps the segments a follow-up shares with its previous turn (the
    tool result after it, above all) the same strings, which the block memo then finds
    instead of tokenising them again. The cut is as safe for the tokeniser as the history
    end's own: the same characters around it. ``kept``, a rendering whose text equals this
    one for ``shared`` characters, lends what it found there when its markup was the same.
    """
    if history_end in (0, len(text)):
        return "", []
    at = bisect.bisect_left(ends, history_end)
    closing = text[max(ends[at - 1] if at else 0, history_end - _SIGNATURE) : history_end]
    start = history_end + _SIGNATURE
    for i in range(bisect.bisect_right(ends, history_end), len(ends)):
        if ends[i] > (ends[i - 1] if i else 0):  # found: its content starts the next one
            start = min(start, ends[i] - len(messages[i]["content"]))
            break
    opening = text[history_end:start]
    if not closing or not opening:
        return "", []
    signature, found, at = closing + opening, [], 0
    if kept is not None and kept.cuts.signature == signature:
        # Occurrences ending by ``shared`` lie in the text both share.
        limit = shared - len(signature)
        turns = kept.cuts.turns
        found = turns[: bisect.bisect(turns, limit + len(closing))]
        at = limit + 1
    at = text.find(signature, max(at, 0))
    while at >= 0:
        found.append(at + len(closing))
        at = text.find(signature, at + 1)
    return signature, found


def _cut_text(
    text: str, messages: Sequence[Message], history_end: int, spliced: Spliced | None = None
) -> tuple[Rendering, Cuts]:
    """``text`` (a whole render, or ``spliced``'s) cut as the whole render cuts it, and
    where.

    Spliced, it starts from the kept rendering's cuts. A kept content end at or before
    ``shared`` was found by a search that read nothing past it (the candidates it passed
    over end before it), so it stands in the spliced text, which equals the kept one that
    far. A content not found was searched for up to a window past the cursor, so the
    search starts again from the first such message.
    """
    if spliced is None:
        ends, lost = _content_ends(text, messages)
        signature, turns = _like_the_history_end(text, messages, ends, history_end)
        rendering, stops = _cut(text, ends, turns, history_end)
        return rendering, Cuts(ends, lost, signature, turns, stops)
    kept, shared, old = spliced.kept, spliced.shared, spliced.kept.cuts
    ends, lost = _content_ends(
        text, messages, old.ends[: bisect.bisect(old.ends, shared, 0, old.lost)]
    )
    signature, turns = _like_the_history_end(text, messages, ends, history_end, kept, shared)
    # Cut alike as far as both texts, their content ends and their turns agree, and short of
    # either history end (each a cut of one text only) and of either text's end.
    upto = min(
        shared,
        len(text) - 1,
        len(kept.text) - 1,
        _agreed(ends, old.ends),
        _agreed(turns, old.turns),
        *(end - 1 for end in (history_end, kept.history_end) if end > 0),
    )
    rendering, stops = _cut(text, ends, turns, history_end, Lent(kept.rendering, old.stops, upto))
    return rendering, Cuts(ends, lost, signature, turns, stops)


# What the probe's renderings are kept as: never looked up.
_PROBE = Request(b"", (), 0, 0)


# --- Completions and shared helpers ------------------------------------------------------


def _completion_facts(
    body: dict[str, Any], tokenizer: Tokenizer, block_size: int, memo: BlockMemo | None
) -> RequestFacts:
    """A completion has no message structure: turn 0 and no expected hit, by definition.

    Its session key digests the whole prompt, so session hashing treats every distinct
    prompt as a session of its own, as the turn does.
    """
    prompt = completion_prompt(body)
    if isinstance(prompt, str):
        hashed = hash_segments([prompt], tokenizer, block_size, memo)
        token_ids, blocks = hashed.token_parts[0].astype(np.int64), hashed.blocks
    else:
        token_ids = np.array(prompt, dtype=np.int64)
        blocks = chain_hashes(token_ids, block_size)
    return RequestFacts(
        turn=0,
        prompt_tokens=len(token_ids),
        est_hit_tokens=0,
        session_key=digest(token_ids.astype("<u4").tobytes()),
        blocks=blocks,
        token_parts=(token_ids,),
    )


# --- Shared text helpers -------------------------------------------------------------------


def _message_body(message: Message) -> str:
    """A message's text as the generic template and the session key see it."""
    tool_calls = message.get("tool_calls")
    if tool_calls:
        return f"{message['content']}\n{to_json(tool_calls)}"
    return message["content"]


def session_key(messages: Sequence[Message], system: str | None) -> str:
    """Digest of the opening: the system prompt and the messages through the first user one.

    Later turns only append, so every turn of a conversation has the same opening, and an
    Anthropic top-level prompt digests like an OpenAI system message.
    """
    opening = [] if system is None else [["system", system]]
    for message in messages:
        opening.append([message["role"], _message_body(message)])
        if message["role"] == "user":
            break
    return digest(to_json(opening))
