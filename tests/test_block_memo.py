"""The block memo: bounded, and invisible in results (same facts as the uncached path)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_conversation import QWEN, assistant, user

from smetric.core.block_memo import BlockMemo, hash_segments
from smetric.core.blocks import ByteTokenizer, chain_hashes, token_array32
from smetric.core.conversation import ChatTemplate, RequestFacts, analyze_request

TOKENIZER = ByteTokenizer()


class CountingTokenizer(ByteTokenizer):
    """Bytes, counting the characters it was asked to encode."""

    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, text: str) -> bytes:
        self.encoded += len(text)
        return super().encode(text)


def same(a: RequestFacts, b: RequestFacts) -> bool:
    return (
        (a.turn, a.prompt_tokens, a.est_hit_tokens, a.session_key)
        == (b.turn, b.prompt_tokens, b.est_hit_tokens, b.session_key)
        and np.array_equal(a.token_ids, b.token_ids)
        and np.array_equal(a.blocks, b.blocks)
        and a.token_ids.dtype == b.token_ids.dtype == a.blocks.dtype == np.int64
    )


texts = st.text(max_size=30)
turns = st.lists(st.tuples(texts, texts), min_size=1, max_size=5)


def bodies(api: str, system: str, exchanges: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Every request of a conversation: turn k carries the first k exchanges and a question."""
    out = []
    for k in range(len(exchanges)):
        messages = [m for u, a in exchanges[:k] for m in (user(u), assistant(a))]
        messages.append(user(exchanges[k][0]))
        if api == "messages":
            out.append({"system": system, "messages": messages})
        else:
            out.append({"messages": [{"role": "system", "content": system}, *messages]})
    return out


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(
    api=st.sampled_from(["chat", "messages", "completions"]),
    conversations=st.lists(st.tuples(texts, turns), min_size=1, max_size=3),
    block_size=st.integers(1, 16),
    max_bytes=st.sampled_from([0, 1500, 4000, 1 << 20]),
    template=st.sampled_from([None, ChatTemplate(QWEN)]),
    order=st.randoms(use_true_random=False),
)
def test_memoised_facts_equal_uncached_facts_for_any_conversations(
    api: str,
    conversations: list[tuple[str, list[tuple[str, str]]]],
    block_size: int,
    max_bytes: int,
    template: ChatTemplate | None,
    order: Any,
) -> None:
    """Interleaved conversations (some sharing openings), evicting or not, any block size."""
    memo = BlockMemo(TOKENIZER, block_size, max_bytes)
    requests = []
    for system, exchanges in conversations:
        chat_api = "chat" if api == "completions" else api
        for body in bodies(chat_api, system, exchanges):
            if api == "completions":
                body = {"prompt": "".join(str(m["content"]) for m in body["messages"])}
            requests.append(body)
    # Turns of one conversation stay in order; conversations interleave at random.
    requests = (
        sorted(requests, key=lambda _: order.random()) if len(conversations) > 1 else requests
    )
    for body in [*requests, *requests]:  # the second pass hits whatever was kept
        cached = analyze_request(body, api, TOKENIZER, block_size, template, memo)  # type: ignore[arg-type]
        plain = analyze_request(body, api, TOKENIZER, block_size, template)  # type: ignore[arg-type]
        assert same(cached, plain)
        assert memo.nbytes <= max_bytes


@given(segments=st.lists(st.text(max_size=40), max_size=8), block_size=st.integers(1, 8))
def test_segments_hash_as_their_encodings_concatenated(
    segments: list[str], block_size: int
) -> None:
    hashed = hash_segments(segments, TOKENIZER, block_size)
    parts = [token_array32(TOKENIZER.encode(s)) for s in segments]
    tokens = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    assert [p.tolist() for p in hashed.token_parts] == [p.tolist() for p in parts]
    assert hashed.blocks.tolist() == chain_hashes(tokens, block_size).tolist()
    counts = [hashed.tokens_in(k) for k in range(len(parts) + 1)]
    assert counts == [0, *np.cumsum([len(p) for p in parts]).tolist()]
    assert hashed.tokens == len(tokens)


@given(
    earlier=st.lists(st.text(max_size=40), max_size=6),
    shared=st.integers(0, 6),
    added=st.lists(st.text(max_size=40), max_size=4),
    block_size=st.integers(1, 8),
)
def test_a_known_run_lends_exactly_the_segments_a_prompt_starts_with(
    earlier: list[str], shared: int, added: list[str], block_size: int
) -> None:
    """A follow-up's rendering shares the previous one's segments up to where it parts:
    those are taken from the previous run, the rest encoded; the result is the uncached one."""
    run = hash_segments(earlier, TOKENIZER, block_size).run(earlier)
    segments = [*earlier[:shared], *added]
    tokenizer = CountingTokenizer()
    lent = hash_segments(segments, tokenizer, block_size, known=run)
    fresh = hash_segments(segments, TOKENIZER, block_size)
    assert lent.blocks.tolist() == fresh.blocks.tolist()
    assert [n.end for n in lent.nodes] == [n.end for n in fresh.nodes]
    assert [p.tolist() for p in lent.token_parts] == [p.tolist() for p in fresh.token_parts]
    reused = run.leading(segments, block_size)
    assert tokenizer.encoded == sum(map(len, segments[len(reused.segments) :]))
    assert len(reused.segments) >= min(shared, len(earlier))


def test_a_follow_up_encodes_only_its_new_messages() -> None:
    tokenizer = CountingTokenizer()
    memo = BlockMemo(tokenizer, 16)
    history = [{"role": "system", "content": "s" * 5000}, user("u" * 3000), assistant("a" * 400)]
    analyze_request({"messages": [*history, user("first")]}, "chat", tokenizer, 16, memo=memo)
    tokenizer.encoded = 0
    follow_up = [*history, user("first"), assistant("done"), user("next")]
    analyze_request({"messages": follow_up}, "chat", tokenizer, 16, memo=memo)
    # "<|assistant|>\ndone\n", "<|user|>\nnext\n" and the generation prompt.
    assert tokenizer.encoded == len("<|assistant|>\ndone\n<|user|>\nnext\n<|assistant|>\n")
    assert memo.hits == 4  # the system, user, assistant and first-question segments


def test_memo_is_bounded_and_evicts_least_recently_used_runs() -> None:
    memo = BlockMemo(TOKENIZER, 4, max_bytes=100_000)
    for i in range(50):
        analyze_request({"messages": [user(f"{i} " + "x" * 3000)]}, "chat", TOKENIZER, 4, memo=memo)
        assert memo.nbytes <= 100_000
    assert 0 < len(memo) < 50 * 2
    # The newest conversation is still there: asking again hits every segment.
    hits = memo.hits
    analyze_request({"messages": [user("49 " + "x" * 3000)]}, "chat", TOKENIZER, 4, memo=memo)
    assert memo.hits == hits + 2


def test_a_memo_serves_only_its_own_tokenizer_and_block_size() -> None:
    memo = BlockMemo(TOKENIZER, 16)
    with pytest.raises(ValueError, match="another tokenizer or block size"):
        hash_segments(["x"], TOKENIZER, 8, memo)
    with pytest.raises(ValueError, match="another tokenizer or block size"):
        hash_segments(["x"], ByteTokenizer(), 16, memo)
    with pytest.raises(ValueError, match="max_bytes"):
        BlockMemo(TOKENIZER, 16, -1)
