"""A request body into the facts the router routes on, where that costs the event loop least.

The analysis itself is pure (``core.conversation.analyze_request``); this is where it
runs: on the event loop, large bodies in a few worker threads when the tokenizer releases
the GIL while it encodes (a model's does; the byte tokenizer does not, so a thread would
add its hand-off and nothing else), or through an engine's tokenize endpoint. A text that
cannot fit the prompt limit is refused before it is tokenised (``serve.limits``).
"""

from __future__ import annotations

import asyncio

import msgspec

from smetric.core.block_memo import BlockMemo
from smetric.core.blocks import ByteTokenizer, Tokenizer
from smetric.core.conversation import Api, ChatTemplate, RequestFacts, analyze_request
from smetric.core.envelope import ChatBody, ChatReader
from smetric.core.parsing import RequestError
from smetric.serve.limits import CappedTokenizer, PromptTooLong
from smetric.serve.pool import EnginePool
from smetric.serve.tokenizers import EngineTokens, analyze_with_engine

# Bodies above this are analysed off the event loop.
OFF_LOOP_BYTES = 64 << 10


class Analyzer:
    def __init__(
        self,
        pool: EnginePool,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        *,
        block_size: int,
        memo_bytes: int,
        threads: int,
        max_prompt_tokens: int = 0,
        engine_tokenizer: bool = False,
    ) -> None:
        self.pool = pool
        self.template = template
        self.block_size = block_size
        self.engine_tokenizer = engine_tokenizer
        self._max_prompt_tokens = max_prompt_tokens
        # 0: every body on the event loop, as with a tokenizer that holds the GIL: a
        # thread would only add its hand-off and GIL contention with the loop.
        self.threads = 0 if isinstance(tokenizer, ByteTokenizer) else threads
        self._slots = asyncio.Semaphore(max(threads, 1))
        # A message too long for the limit is refused before it is tokenised.
        self.tokenizer = CappedTokenizer(tokenizer, self.max_prompt_tokens)
        # Follow-ups re-send earlier turns: their blocks are looked up, not recomputed.
        memo_tokenizer: Tokenizer = EngineTokens() if engine_tokenizer else self.tokenizer
        self.memo = BlockMemo(memo_tokenizer, block_size, memo_bytes)
        # The bodies' prefixes and what each message renders to, found by their bytes.
        self.reader = ChatReader(memo_bytes, template)
        if template is not None:
            # Follow-ups are spliced onto the renderings kept of earlier turns.
            template.prepare(memo_bytes)

    def max_prompt_tokens(self) -> int:
        """The configured cap, else the longest context an engine reported (0: none yet)."""
        return self._max_prompt_tokens or self.pool.max_context()

    def prompt_limit(self) -> str:
        """The prompt limit in force, as a client's error message names it."""
        if self._max_prompt_tokens:
            return f"--max-prompt-tokens ({self._max_prompt_tokens} tokens)"
        return (
            f"the engines' longest context ({self.pool.max_context()} tokens; "
            "--max-prompt-tokens is 0)"
        )

    def analyze_now(self, body: object, api: Api) -> RequestFacts:
        """The facts, on this thread, with the router's own tokenizer."""
        return analyze_request(body, api, self.tokenizer, self.block_size, self.template, self.memo)

    def reads_envelope(self, api: Api) -> bool:
        """Whether ``api``'s bodies are analysed from their envelope: chat and Messages
        with the router's own tokenizer (``core.envelope``)."""
        return api in ("chat", "messages") and not self.engine_tokenizer

    def chat_now(
        self, body: bytes, api: Api, session: str | None
    ) -> tuple[ChatBody, RequestFacts] | None:
        """A chat or Messages body read and its facts, on this thread; None where the
        whole body must be analysed (which words any fault). ``session``: the sender's,
        a hint where to look for the body's prefix. A prompt over the limit is refused
        here."""
        assert api == "chat" or api == "messages"
        reader = self.reader
        try:
            read = reader.read(body, api, session)
            if read is None:
                return None
            return read, reader.facts(read, api, self.tokenizer, self.block_size, self.memo)
        except PromptTooLong:
            raise
        except (RequestError, msgspec.DecodeError):
            return None

    async def analyze_chat(
        self, body: bytes, api: Api, session: str | None, large: bool = False
    ) -> tuple[ChatBody, RequestFacts] | None:
        """``chat_now``, in a worker thread where ``analyze`` would use one."""
        if large and self.threads:
            async with self._slots:
                return await asyncio.to_thread(self.chat_now, body, api, session)
        return self.chat_now(body, api, session)

    async def analyze(self, body: object, api: Api, large: bool = False) -> RequestFacts:
        """With a model's tokenizer, a large body is analysed in a worker thread: a new
        128 k-token prompt takes tens of ms there, and the tokenizer releases the GIL
        while it encodes, so other requests keep streaming meanwhile; a few at a time,
        since each holds its tokens meanwhile. With the byte tokenizer the body is
        analysed here: a follow-up costs under a millisecond (the memo holds its
        history), a new 128 k-token prompt a few, all of it holding the GIL."""
        if not self.engine_tokenizer:
            if large and self.threads:
                async with self._slots:
                    return await asyncio.to_thread(self.analyze_now, body, api)
            return self.analyze_now(body, api)
        engines = self.pool.engines
        engine = next((e for e in engines if e.healthy), engines[0])
        return await analyze_with_engine(
            body,
            api,
            self.pool.client(),
            engine.url,
            self.block_size,
            self.template,
            self.memo,
            path=engine.backend.tokenize_path,
        )
