"""What the live router learns from one request body alone: turn, expected hit, blocks.

The router keeps no session table (DESIGN.md), so everything a policy needs must come from
the body of each request:

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

Three request shapes are understood: OpenAI chat (``messages`` with roles, string or
part-list content, ``tool_calls``, ``role: tool``), Anthropic Messages (``system`` plus
user/assistant ``messages`` whose content may hold ``text``, ``tool_use``, ``tool_result``
and other blocks) and OpenAI completions (``prompt`` as text or token ids; no structure, so
turn 0 and no expected hit). Any malformed body raises ``RequestError`` and nothing else,
so the router can answer 400 without guarding against surprises.

Rendering matters because blocks are only comparable when every turn of a session renders
its shared prefix identically. The default ``render_chat`` template is generic, but it has
the property the router needs: a request's full prompt (ending in the generation prompt) is
a text prefix of the next turn's history, so a follow-up's blocks start with all of the
previous request's full blocks. ``ChatTemplate`` renders a model's own Jinja template
instead, for token counts that match the engine's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import jinja2.ext
import numpy as np
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from smetric.core.blocks import Tokenizer, chain_hashes
from smetric.core.policy import RoutingRequest

Api = Literal["chat", "messages", "completions"]

# A message as the renderers take it: OpenAI-shaped, ``role`` and ``content`` strings (parts
# already flattened to text), optionally ``tool_calls`` and whatever other keys the client
# sent, which chat templates may read.
Message = Mapping[str, Any]

_TOKEN_LIMIT = 1 << 32
_GENERATION_PROMPT = "<|assistant|>\n"


class RequestError(ValueError):
    """A request body the router cannot analyse; the message says why, for a 400 reply."""


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """Everything routing needs from one request, derived from its body alone."""

    turn: int
    prompt_tokens: int
    est_hit_tokens: int
    session_key: str
    token_ids: np.ndarray
    # One chained id per full block of ``token_ids``.
    blocks: np.ndarray

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
) -> RequestFacts:
    """Turn, expected hit, session key, tokens and blocks of one request body.

    ``body`` is the decoded JSON; any JSON value either analyses or raises ``RequestError``.
    ``template`` (chat and messages only) replaces the generic rendering with a model's chat
    template. The history and the fresh part are encoded separately, so ``est_hit_tokens``
    is exactly the history's share of ``token_ids``. A body that ends in an assistant message
    (a prefill to continue) has all its messages in the history, since nothing follows them.
    """
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_kind(body)}")
    if api == "completions":
        return _completion_facts(body, tokenizer, block_size)
    if api == "chat":
        messages, system = _chat_messages(body), None
    elif api == "messages":
        messages, system = _anthropic_messages(body), _anthropic_system(body.get("system"))
    else:
        raise ValueError(f"unknown api {api!r}; expected 'chat', 'messages' or 'completions'")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError(f"tools must be a list, got {_kind(tools)}")
    extra = body.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise RequestError(f"chat_template_kwargs must be an object, got {_kind(extra)}")
    if template is None:
        text, history_end = render_chat(messages, system, tools)
    else:
        text, history_end = template.render(messages, system, tools, extra)
    history = tokenizer.encode(text[:history_end])
    token_ids = np.array(history + tokenizer.encode(text[history_end:]), dtype=np.int64)
    return RequestFacts(
        turn=sum(message["role"] == "assistant" for message in messages),
        prompt_tokens=len(token_ids),
        est_hit_tokens=len(history),
        session_key=_session_key(messages, system),
        token_ids=token_ids,
        blocks=chain_hashes(token_ids, block_size),
    )


def render_chat(
    messages: Sequence[Message], system: str | None = None, tools: list[Any] | None = None
) -> tuple[str, int]:
    """The generic rendering and the offset where its history ends (0 without one).

    The format is ``<|role|>\\n{content}\\n`` per message, assistant ``tool_calls`` as JSON
    on the line after the content, preceded by ``<|tools|>\\n{tools JSON}\\n`` and
    ``<|system|>\\n{system}\\n`` when given, and followed by the generation prompt
    ``<|assistant|>\\n``. The generation prompt equals the opening of the assistant message
    that answers it, which is what makes each prompt a prefix of the next turn's history.
    ``system`` is the Anthropic top-level prompt; OpenAI system messages sit in ``messages``.
    """
    pieces: list[str] = []
    if tools:
        pieces.append(f"<|tools|>\n{_json(tools)}\n")
    if system is not None:
        pieces.append(f"<|system|>\n{system}\n")
    length = sum(map(len, pieces))
    history_end = 0
    for message in messages:
        piece = f"<|{message['role']}|>\n{_message_body(message)}\n"
        pieces.append(piece)
        length += len(piece)
        if message["role"] == "assistant":
            history_end = length
    pieces.append(_GENERATION_PROMPT)
    return "".join(pieces), history_end


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
    """

    def __init__(self, template: str, bos_token: str = "", eos_token: str = "") -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        # Compiling here makes a broken template fail at start-up, not on every request.
        self._template = environment.from_string(template)
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: Sequence[Message],
        system: str | None = None,
        tools: list[Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> tuple[str, int]:
        """The rendered prompt and the offset where its history ends, like ``render_chat``.

        ``extra`` carries the request's ``chat_template_kwargs`` (``enable_thinking``, ...);
        it cannot override the messages, tools or special tokens.
        """
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        context = {
            **(extra or {}),
            "tools": tools,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        full = self._render(messages, True, context)
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        if last < 0:
            return full, 0
        history = self._render(messages[: last + 1], False, context)
        return full, _common_prefix_length(history, full)

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


def _common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix, by bisection over C-speed slice comparisons."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    # Invariant: a[:low] == b[:low] and a[:high] != b[:high].
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


# --- Parsing the three request shapes ------------------------------------------------------


def _kind(value: object) -> str:
    """The JSON name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _message_list(body: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" not in body:
        raise RequestError("the request has no 'messages'")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise RequestError(f"messages must be a list, got {_kind(messages)}")
    if not messages:
        raise RequestError("messages must not be empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be an object, got {_kind(message)}")
        if "role" not in message:
            raise RequestError(f"messages[{i}] has no role")
        if not isinstance(message["role"], str):
            raise RequestError(f"messages[{i}].role must be a string, got {_kind(message['role'])}")
    return messages


def _chat_messages(body: dict[str, Any]) -> list[Message]:
    """OpenAI chat messages with content flattened to text; other keys kept for templates."""
    messages: list[Message] = []
    for i, message in enumerate(_message_list(body)):
        where = f"messages[{i}]"
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and not (
            isinstance(tool_calls, list) and all(isinstance(call, dict) for call in tool_calls)
        ):
            raise RequestError(f"{where}.tool_calls must be a list of objects")
        content = message.get("content")
        messages.append({**message, "content": _openai_content(content, f"{where}.content")})
    return messages


def _openai_content(content: object, where: str) -> str:
    """Text parts joined by newlines (as vLLM joins them); other parts become placeholders."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(
            f"{where} must be a string, a list of parts or null, got {_kind(content)}"
        )
    texts = []
    for j, part in enumerate(content):
        part_type = _part_type(part, f"{where}[{j}]")
        texts.append(
            _text_field(part, "text", f"{where}[{j}]")
            if part_type == "text"
            else _placeholder(part_type, part)
        )
    return "\n".join(texts)


def _anthropic_system(system: object) -> str | None:
    """The top-level prompt as text; an empty one counts as none."""
    text = _anthropic_content(system, "system", nested=False) if system is not None else ""
    return text or None


def _anthropic_messages(body: dict[str, Any]) -> list[Message]:
    messages: list[Message] = []
    for i, message in enumerate(_message_list(body)):
        where = f"messages[{i}]"
        if message["role"] not in ("user", "assistant"):
            raise RequestError(
                f"{where}.role must be 'user' or 'assistant', got {message['role']!r}"
            )
        if "content" not in message:
            raise RequestError(f"{where} has no content")
        content = _anthropic_content(message["content"], f"{where}.content", nested=False)
        messages.append({"role": message["role"], "content": content})
    return messages


def _anthropic_content(content: object, where: str, *, nested: bool) -> str:
    """Blocks as text: text and thinking verbatim, a tool call as its JSON, a tool result as
    its own content; anything else (images, documents) as a placeholder.

    ``nested`` is set inside a tool result, whose content holds only leaf blocks, so that no
    body can recurse deeper than one level.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of blocks, got {_kind(content)}")
    texts = []
    for j, block in enumerate(content):
        here = f"{where}[{j}]"
        block_type = _part_type(block, here)
        if block_type == "text":
            texts.append(_text_field(block, "text", here))
        elif block_type == "thinking":
            texts.append(_text_field(block, "thinking", here))
        elif block_type == "tool_use":
            texts.append(_json({"name": block.get("name"), "input": block.get("input")}))
        elif block_type == "tool_result" and not nested:
            inner = block.get("content")
            texts.append("" if inner is None else _anthropic_content(inner, here, nested=True))
        else:
            texts.append(_placeholder(block_type, block))
    return "\n".join(texts)


def _part_type(part: object, where: str) -> str:
    if not isinstance(part, dict):
        raise RequestError(f"{where} must be an object, got {_kind(part)}")
    part_type = part.get("type")
    if not isinstance(part_type, str):
        raise RequestError(f"{where}.type must be a string, got {_kind(part_type)}")
    return part_type


def _text_field(part: dict[str, Any], field: str, where: str) -> str:
    text = part.get(field)
    if not isinstance(text, str):
        raise RequestError(f"{where}.{field} must be a string, got {_kind(text)}")
    return text


def _placeholder(part_type: str, part: object) -> str:
    """A short stand-in for an image or other non-text part, named by its content's digest.

    Counting a base64 image's characters as prompt would swamp every number, while one
    shared placeholder for all images would let different images look like a cached prefix.
    """
    return f"<|{part_type}:{_digest(_json(part, sort_keys=True))}|>"


def _completion_facts(body: dict[str, Any], tokenizer: Tokenizer, block_size: int) -> RequestFacts:
    """A completion has no message structure: turn 0 and no expected hit, by definition.

    Its session key digests the whole prompt, so session hashing treats every distinct
    prompt as a session of its own, as the turn does.
    """
    if "prompt" not in body:
        raise RequestError("the request has no 'prompt'")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        token_ids = np.array(tokenizer.encode(prompt), dtype=np.int64)
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if min(prompt) < 0 or max(prompt) >= _TOKEN_LIMIT:
            raise RequestError("prompt token ids must lie in [0, 2**32)")
        token_ids = np.array(prompt, dtype=np.int64)
    elif (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str | list) for p in prompt)
    ):
        raise RequestError("batched prompts are not supported: send one prompt per request")
    else:
        raise RequestError("prompt must be a string or a non-empty list of integer token ids")
    return RequestFacts(
        turn=0,
        prompt_tokens=len(token_ids),
        est_hit_tokens=0,
        session_key=_digest(token_ids.astype("<u4").tobytes()),
        token_ids=token_ids,
        blocks=chain_hashes(token_ids, block_size),
    )


# --- Shared text helpers -------------------------------------------------------------------


def _message_body(message: Message) -> str:
    """A message's text as the generic template and the session key see it."""
    tool_calls = message.get("tool_calls")
    if tool_calls:
        return f"{message['content']}\n{_json(tool_calls)}"
    return message["content"]


def _session_key(messages: Sequence[Message], system: str | None) -> str:
    """Digest of the opening: the system prompt and the messages through the first user one.

    Later turns only append, so every turn of a conversation has the same opening, and an
    Anthropic top-level prompt digests like an OpenAI system message.
    """
    opening = [] if system is None else [["system", system]]
    for message in messages:
        opening.append([message["role"], _message_body(message)])
        if message["role"] == "user":
            break
    return _digest(json.dumps(opening))


def _json(value: object, *, sort_keys: bool = False) -> str:
    """Compact JSON of client data; nesting too deep to serialise is the client's error."""
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=sort_keys)
    except (RecursionError, ValueError) as error:
        raise RequestError(f"cannot serialise part of the request: {error}") from None


def _digest(data: str | bytes) -> str:
    """16 hex digits of BLAKE2b, the same in every process (unlike ``hash()``)."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=8).hexdigest()
