"""Bounds on what one request body may cost the router: its size once decompressed
(``--max-body-bytes``, the one body limit), and the prompt it makes the router tokenise
(``--max-prompt-tokens``, in tokens).

A compressed body is inflated here rather than by aiohttp, whose errors for a broken or
unknown encoding come from below the application as plain-text pages; inflating stops
at the size limit, so a small bomb cannot become a large body.

Analysing a prompt costs time and memory in proportion to its length (the byte tokenizer
makes a Python int per byte): one 25 MB chat body took the router from 103 to 628 MB and
4 s of CPU, for a prompt every engine refuses anyway. Counting characters is free, so a
text that cannot fit the token limit is refused before it is tokenised; the prompt's
whole token count is checked once it is analysed (images and other non-text parts count
as their placeholders, not as the bytes of their base64).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from smetric.core.blocks import Tokenizer
from smetric.core.conversation import RequestError

# zlib's window bits for a gzip or a zlib header, whichever the body has.
_GZIP_OR_ZLIB = 32 + zlib.MAX_WBITS


class BodyError(ValueError):
    """A body the router will not read; ``status`` says why (400, 408, 413 or 415)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def decoded_body(raw: bytes, encoding: str, max_bytes: int) -> bytes:
    """The body as sent before its ``Content-Encoding`` (gzip or deflate, or none)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        body = raw
    elif encoding in ("gzip", "x-gzip", "deflate"):
        inflater = zlib.decompressobj(_GZIP_OR_ZLIB)
        try:
            body = inflater.decompress(raw, max_bytes + 1)
        except zlib.error as exc:
            raise BodyError(400, f"the body is not valid {encoding}: {exc}") from None
        if len(body) <= max_bytes and not inflater.eof:
            raise BodyError(400, f"the {encoding} body is cut short")
    else:
        raise BodyError(415, f"unsupported Content-Encoding {encoding!r}; use gzip or deflate")
    if len(body) > max_bytes:
        raise BodyError(413, body_too_large_message(max_bytes))
    return body


# Deflate's greatest compression ratio (zlib's technical notes): a gzip or deflate body
# inflates to at most this many times its size.
MAX_INFLATION = 1032


def inflated_bound(size: int, max_bytes: int) -> int:
    """The most a compressed body of ``size`` bytes may take once inflated, within the
    body limit: what to hold for it before it is inflated."""
    return min(size * MAX_INFLATION, max_bytes)


def body_too_large_message(max_bytes: int) -> str:
    return f"request body too large: over --max-body-bytes ({max_bytes} bytes)"


class PromptTooLong(RequestError):
    """A prompt over the token limit, found before it was all tokenised."""


# Characters one token covers, at most, in any tokenizer the router meets: BPE averages
# about 4 on English, and long runs of spaces or symbols reach 16 in common vocabularies;
# the byte tokenizer covers at most 1. A prompt over the cap cannot fit the engines.
CHARS_PER_TOKEN = 16


class CappedTokenizer:
    """``tokenizer``, refusing a text (one message, or one prompt) that cannot fit in
    ``max_tokens()`` tokens (0: no cap known yet) before encoding it.

    Per text rather than per request, since prompts are encoded message by message (and
    the memo spares the ones seen before); the request's whole prompt is checked once it
    is analysed.
    """

    def __init__(self, tokenizer: Tokenizer, max_tokens: Callable[[], int]) -> None:
        self.tokenizer = tokenizer
        self.name = tokenizer.name
        self.max_tokens = max_tokens

    def encode(self, text: str) -> Sequence[int]:
        limit = self.max_tokens()
        if limit and len(text) > limit * CHARS_PER_TOKEN:
            raise PromptTooLong(f"a text of {len(text)} characters")
        return self.tokenizer.encode(text)
