"""Tokenizers for the router: the byte-level fallback, a local Hugging Face one, an engine's.

Block ids only match an engine's prefix cache when the router cuts the same tokens the
engine prefills, so the best tokenizer is the model's own. The router cannot download it
(it may run where only the engines can reach the hub), so a Hugging Face tokenizer is read
from a local folder, together with the chat template the engine renders chats with. Without
one, an engine's vLLM-style ``/tokenize`` gives the exact tokens at the cost of a round trip,
and the byte tokenizer keeps routing consistent when neither is available.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from smetric.core.block_memo import BlockMemo
from smetric.core.blocks import ByteTokenizer, Tokenizer
from smetric.core.conversation import Api, ChatTemplate, RequestFacts, analyze_request
from smetric.core.errors import ConfigError, UserError

if TYPE_CHECKING:
    import tokenizers

_HF_PREFIX = "hf:"


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind the router's ``Tokenizer`` protocol."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, name: str) -> None:
        self._tokenizer = tokenizer
        self.name = name

    def encode(self, text: str) -> list[int]:
        # No special tokens: the rendered template carries them (see the protocol). The
        # batch call without offsets finds the same ids a fifth faster than ``encode``,
        # which also works out where each token lies in the text.
        try:
            return self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        except TypeError:
            # The Rust side refuses lone surrogates, which JSON can carry ("\ud800"); the
            # engine cannot prefill them either, so any stable stand-in will do.
            clean = text.encode("utf-8", "replace").decode("utf-8")
            return self._tokenizer.encode_batch_fast([clean], add_special_tokens=False)[0].ids


def load_hf_tokenizer(path: Path) -> tuple[HFTokenizer, ChatTemplate | None]:
    """The tokenizer in ``path/tokenizer.json`` and the chat template beside it, if any.

    The template comes from ``chat_template.jinja`` when present (newer ``transformers``
    save it there, and prefer it), else from ``tokenizer_config.json``'s ``chat_template``,
    which older models keep as a string or as a list of named templates, of which the
    engine uses ``default`` for plain chat. Problems raise ``UserError`` at start-up rather
    than leaving the router to guess at every request.
    """
    try:
        import tokenizers
    except ImportError as error:  # an optional dependency: byte-level routing needs none
        raise UserError(
            "Hugging Face tokenizers need the 'tokenizers' package: pip install 'smetric[hf]'"
        ) from error
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"tokenizer folder {path} does not exist")
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as error:  # the Rust loader raises bare Exception on bad files
        raise UserError(f"cannot read {tokenizer_file}: {error}") from error
    config = _read_config(path / "tokenizer_config.json")
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        template_text: object = jinja_file.read_text(encoding="utf-8")
    else:
        template_text = config.get("chat_template")
    template = None
    if template_text is not None:
        template = ChatTemplate(
            _default_template(template_text, path),
            _token_text(config.get("bos_token")),
            _token_text(config.get("eos_token")),
        )
    return HFTokenizer(tokenizer, path.name or str(path)), template


def make_tokenizer(spec: str) -> tuple[Tokenizer, ChatTemplate | None]:
    """The tokenizer and chat template a ``--tokenizer`` value names.

    ``bytes`` is the byte-level fallback with the generic rendering; ``hf:/path/to/dir`` a
    local Hugging Face tokenizer folder (see ``load_hf_tokenizer``).
    """
    if spec == "bytes":
        return ByteTokenizer(), None
    if spec.startswith(_HF_PREFIX) and spec[len(_HF_PREFIX) :]:
        return load_hf_tokenizer(Path(spec[len(_HF_PREFIX) :]).expanduser())
    raise ConfigError(f"unknown tokenizer {spec!r}; expected 'bytes' or 'hf:/path/to/dir'")


@dataclass(frozen=True, slots=True)
class EngineTokenizer:
    """Tokenisation by an engine's vLLM-style ``POST /tokenize``, exact by construction.

    ``url`` is the engine's base URL. Transport and HTTP failures raise
    ``aiohttp.ClientError``; a reply without a token list raises ``ValueError``.
    """

    client: aiohttp.ClientSession
    url: str
    path: str = "/tokenize"

    async def encode(self, text: str) -> list[int]:
        if not text:
            return []  # spares a round trip, and engines that refuse empty prompts
        payload = {"prompt": text, "add_special_tokens": False}
        async with self.client.post(f"{self.url.rstrip('/')}{self.path}", json=payload) as reply:
            reply.raise_for_status()
            body = await reply.json()
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise ValueError(f"{self.url}/tokenize did not answer with a list of token ids")
        return tokens


async def analyze_with_engine(
    body: object,
    api: Api,
    client: aiohttp.ClientSession,
    url: str,
    block_size: int,
    template: ChatTemplate | None = None,
    memo: BlockMemo | None = None,
    path: str = "/tokenize",
) -> RequestFacts:
    """``analyze_request`` with the engine at ``url`` as tokenizer, without blocking the loop.

    ``analyze_request`` encodes synchronously, so it runs twice: first with a tokenizer that
    only records the texts it is asked for (the rendered segments), then, once the engine
    has tokenised those concurrently, with one that replays the answers. Rendering is pure,
    so both passes ask for the same texts, and all parsing, validation and fact building
    stay in ``analyze_request``. With ``memo`` (made for an ``EngineTokens``), the segments
    it holds are not sent, so a follow-up costs a round trip per new message only. Request
    errors raise ``RequestError`` from the first pass, before any I/O.
    """
    recorder = _Recorder()
    analyze_request(body, api, recorder, block_size, template)
    replay = EngineTokens() if memo is None else memo.tokenizer
    if not isinstance(replay, EngineTokens):
        raise ValueError("the memo must be made for an EngineTokens tokenizer")
    engine = EngineTokenizer(client, url, path)
    # Entries can be evicted while the engine answers; then everything is asked for.
    for held in ([memo.held(recorder.texts)] if memo is not None else []) + [0]:
        texts = recorder.texts[held:]
        answers = await asyncio.gather(*(engine.encode(text) for text in texts))
        replay.tokens = dict(zip(texts, answers, strict=True))
        try:
            return analyze_request(body, api, replay, block_size, template, memo)
        except KeyError:
            continue
        finally:
            replay.tokens = {}
    raise AssertionError("unreachable: the last pass had every text")


class _Recorder:
    """Notes every text to encode and answers nothing, for the first pass."""

    name = "recorder"

    def __init__(self) -> None:
        self.texts: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.texts.append(text)
        return []


class EngineTokens:
    """The tokenizer of ``--tokenizer engine`` as the analysis sees it: it answers from the
    engine's tokens fetched for the request being analysed (``analyze_with_engine``). One
    per router, so that the router's memo can be made for it."""

    name = "engine"

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return self.tokens[text]


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"cannot read {path}: {error}") from error
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold a JSON object")
    return config


def _default_template(template: object, path: Path) -> str:
    """The template string, picking ``default`` from a list of named templates."""
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default":
                named = entry.get("template")
                if isinstance(named, str):
                    return named
        raise UserError(f"{path}: chat_template lists no template named 'default'")
    raise UserError(f"{path}: chat_template must be a string or a list of named templates")


def _token_text(token: object) -> str:
    """A special token as text: configs store it as a string or as ``{"content": ...}``."""
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    return ""
