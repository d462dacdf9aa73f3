"""A cap on the prompt a request may make the router tokenise.

Analysing a prompt costs time and memory in proportion to its length (the byte tokenizer
makes a Python int per byte): one 25 MB chat body took the router from 103 to 628 MB and
4 s of CPU, for a prompt every engine refuses anyway. Counting characters is free, so the
rendered prompt is checked against the longest the engines take before it is tokenised.
"""

from __future__ import annotations

from smetric.core.blocks import Tokenizer
from smetric.core.conversation import RequestError

# Characters one token covers, at most, in any tokenizer the router meets: BPE averages
# about 4 on English, and long runs of spaces or symbols reach 16 in common vocabularies;
# the byte tokenizer covers at most 1. A prompt over the cap cannot fit the engines.
CHARS_PER_TOKEN = 16


class BoundedTokenizer:
    """``tokenizer`` for one request, refusing once the texts it was given to encode
    (a prompt is encoded in two parts: history, then the fresh turn) cannot fit in
    ``max_tokens``."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.name = tokenizer.name
        self.max_tokens = max_tokens
        self.chars_left = max_tokens * CHARS_PER_TOKEN

    def encode(self, text: str) -> list[int]:
        self.chars_left -= len(text)
        if self.chars_left < 0:
            raise RequestError(
                f"the prompt is longer than the engines' context of {self.max_tokens} tokens"
            )
        return self.tokenizer.encode(text)
