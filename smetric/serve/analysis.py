"""A request body into the facts the router routes on, without stalling the event loop.

The analysis itself is pure (``core.conversation.analyze_request``); this is where it
runs: small bodies inline, large ones in a few worker threads, or through an engine's
tokenize endpoint. Prompts are capped at the engines' longest context before they are
tokenised (``serve.limits``).
"""

from __future__ import annotations

import asyncio

from smetric.core.block_memo import BlockMemo
from smetric.core.blocks import Tokenizer
from smetric.core.conversation import Api, ChatTemplate, RequestFacts, analyze_request
from smetric.serve.limits import BYTES_PER_TOKEN, CappedTokenizer
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
        max_body_bytes: int = 32 << 20,
        engine_tokenizer: bool = False,
    ) -> None:
        self.pool = pool
        self.template = template
        self.block_size = block_size
        self.engine_tokenizer = engine_tokenizer
        self.max_body_bytes = max_body_bytes
        self._max_prompt_tokens = max_prompt_tokens
        # 0: every body on the event loop (a tokenizer that holds the GIL gains nothing).
        self.threads = threads
        self._slots = asyncio.Semaphore(max(threads, 1))
        # A message too long for any engine is refused before it is tokenised.
        self.tokenizer = CappedTokenizer(tokenizer, self.max_prompt_tokens)
        # Follow-ups re-send earlier turns: their blocks are looked up, not recomputed.
        memo_tokenizer: Tokenizer = EngineTokens() if engine_tokenizer else self.tokenizer
        self.memo = BlockMemo(memo_tokenizer, block_size, memo_bytes)

    def max_prompt_tokens(self) -> int:
        """The configured cap, else the longest context an engine reported (0: none yet)."""
        return self._max_prompt_tokens or self.pool.max_context()

    def body_limit(self) -> int:
        """Bytes a body may have: the configured limit, lowered to what the longest prompt
        the engines take could need."""
        tokens = self.max_prompt_tokens()
        limit = self.max_body_bytes
        return limit if tokens == 0 else min(limit, tokens * BYTES_PER_TOKEN)

    def analyze_now(self, body: object, api: Api) -> RequestFacts:
        """The facts, on this thread, with the router's own tokenizer."""
        return analyze_request(body, api, self.tokenizer, self.block_size, self.template, self.memo)

    async def analyze(self, body: object, api: Api, large: bool = False) -> RequestFacts:
        """A large body is analysed in a worker thread: a follow-up costs about a
        millisecond there (the memo holds its history), but a new 128 k-token prompt takes
        a few ms with the byte tokenizer and far more with a model's, which releases the
        GIL while it encodes, so other requests keep streaming meanwhile; a few at a time,
        since each holds its tokens meanwhile."""
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
