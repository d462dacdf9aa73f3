"""The relay's usage tap: bounded memory, work per chunk proportional to the chunk."""

from __future__ import annotations

import json

from smetric.serve.forwarding import UsageTap


def test_keeps_a_bounded_tail_and_finds_usage_split_across_chunks() -> None:
    tap = UsageTap()
    for i in range(2000):
        tap.feed(f'data: {{"choices": [{{"delta": {{"content": "token {i}"}}}}]}}\n\n'.encode())
        assert tap.kept - len(tap.chunks[0]) < tap.KEEP  # only what the tail needs
    usage = {"usage": {"prompt_tokens": 90, "prompt_tokens_details": {"cached_tokens": 64}}}
    line = f"data: {json.dumps(usage)}\n\n".encode()
    tap.feed(line[:20])
    tap.feed(line[20:])
    tap.feed(b"data: [DONE]\n\n")
    assert tap.cached_tokens() == 64


def test_anthropic_usage_in_a_plain_json_body() -> None:
    tap = UsageTap()
    tap.feed(json.dumps({"usage": {"input_tokens": 9, "cache_read_input_tokens": 7}}).encode())
    assert tap.cached_tokens() == 7
