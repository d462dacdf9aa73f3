"""Router tokenizers: a real local Hugging Face tokenizer and the mock engine's /tokenize."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestServer
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from smetric.core.block_memo import BlockMemo
from smetric.core.blocks import ByteTokenizer
from smetric.core.conversation import RequestError, analyze_request
from smetric.core.errors import ConfigError, UserError
from smetric.engine import EngineConfig, create_app
from smetric.serve.tokenizers import (
    EngineTokens,
    HFTokenizer,
    analyze_with_engine,
    load_hf_tokenizer,
    make_tokenizer,
)

pytestmark = pytest.mark.server

BS = 4
QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
SENTENCES = [
    "You are a careful coding agent.",
    "Fix the failing test in the parser, then run the suite again.",
    "The quick brown fox jumps over the lazy dog.",
    "I changed the parser and all tests pass now.",
]
TURN_1 = [
    {"role": "system", "content": SENTENCES[0]},
    {"role": "user", "content": SENTENCES[1]},
]
TURN_2 = [
    *TURN_1,
    {"role": "assistant", "content": SENTENCES[3]},
    {"role": "user", "content": SENTENCES[2]},
]


def write_tokenizer(folder: Path, config: dict[str, Any] | None = None) -> Path:
    """A byte-level BPE trained on a few sentences, with a BOS post-processor to strip."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(SENTENCES * 5, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def qwen_dir(tmp_path: Path) -> Path:
    config = {
        "chat_template": QWEN_TEMPLATE,
        "bos_token": None,
        "eos_token": {"content": "<|im_end|>", "__type": "AddedToken"},
    }
    return write_tokenizer(tmp_path / "qwen", config)


def test_load_reads_tokenizer_and_template(qwen_dir: Path) -> None:
    tokenizer, template = load_hf_tokenizer(qwen_dir)
    assert tokenizer.name == "qwen"
    assert template is not None
    assert (template.bos_token, template.eos_token) == ("", "<|im_end|>")
    rendering = template.render(TURN_1)
    text, history_end = rendering.text, rendering.history_end()
    assert history_end == 0
    assert text.endswith("<|im_start|>assistant\n")
    # The template's special tokens encode as single ids.
    assert tokenizer.encode("<|im_start|>") == [1]


def test_encode_adds_no_special_tokens(qwen_dir: Path) -> None:
    tokenizer, _ = load_hf_tokenizer(qwen_dir)
    raw = Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))
    with_bos = raw.encode(SENTENCES[2]).ids
    assert with_bos[0] == 0
    assert tokenizer.encode(SENTENCES[2]) == with_bos[1:]
    # Lone surrogates (valid in JSON) encode instead of failing the request.
    assert tokenizer.encode("a\ud800b")


def test_follow_up_blocks_extend_previous_prompt(qwen_dir: Path) -> None:
    tokenizer, template = load_hf_tokenizer(qwen_dir)
    first = analyze_request({"messages": TURN_1}, "chat", tokenizer, BS, template)
    second = analyze_request({"messages": TURN_2}, "chat", tokenizer, BS, template)
    assert len(first.blocks) > 2
    np.testing.assert_array_equal(second.blocks[: len(first.blocks)], first.blocks)
    assert second.turn == 1
    assert second.session_key == first.session_key


def test_segments_cut_at_special_tokens_tokenise_as_the_whole_prompt(qwen_dir: Path) -> None:
    """Cuts fall where the template puts special tokens, which the tokenizer splits at
    anyway: tokenising segment by segment (what makes the memo possible) gives exactly the
    tokens of the whole rendered prompt, as the engine tokenises it."""
    tokenizer, template = load_hf_tokenizer(qwen_dir)
    assert template is not None
    facts = analyze_request({"messages": TURN_2}, "chat", tokenizer, BS, template)
    whole = tokenizer.encode(template.render(TURN_2).text)
    assert facts.token_ids.tolist() == whole
    assert len(template.render(TURN_2).segments) > 3


class Counting:
    """A tokenizer that notes how many characters it was asked to encode."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer, self.name, self.chars = tokenizer, tokenizer.name, 0

    def encode(self, text: str) -> list[int]:
        self.chars += len(text)
        return self.tokenizer.encode(text)


def test_a_follow_up_encodes_what_it_adds_and_tokenises_as_the_whole_prompt(
    qwen_dir: Path,
) -> None:
    """Turn by turn through an agent session: the segments (spliced onto the previous
    turn's rendering, cut where earlier turns closed) still tokenise as the whole prompt,
    and the memo leaves only the new messages to encode."""
    tokenizer, template = load_hf_tokenizer(qwen_dir)
    assert template is not None
    counting = Counting(tokenizer)
    memo = BlockMemo(counting, BS)
    messages = list(TURN_1)
    for i in range(8):
        added = [
            {"role": "assistant", "content": SENTENCES[i % 4]},
            {"role": "tool", "content": " ".join(SENTENCES[: 1 + i % 4])},
        ]
        messages += added
        before = counting.chars
        facts = analyze_request({"messages": messages}, "chat", counting, BS, template, memo)
        assert facts.token_ids.tolist() == tokenizer.encode(template.render(messages).text)
        if i:  # the markup around the new messages, and their contents
            assert counting.chars - before <= sum(len(m["content"]) + 50 for m in added)
    assert template.splicer.spliced > 0


def test_est_hit_counts_history_rendering(qwen_dir: Path) -> None:
    tokenizer, template = load_hf_tokenizer(qwen_dir)
    facts = analyze_request({"messages": TURN_2}, "chat", tokenizer, BS, template)
    history = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in TURN_2[:3])
    assert facts.est_hit_tokens == len(tokenizer.encode(history))
    assert 0 < facts.est_hit_tokens < facts.prompt_tokens


def test_named_templates_and_jinja_file(tmp_path: Path) -> None:
    named = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ bos_token }}default"},
    ]
    folder = write_tokenizer(tmp_path / "named", {"chat_template": named, "bos_token": "<s>"})
    _, template = load_hf_tokenizer(folder)
    assert template is not None
    assert template.render([{"role": "user", "content": "x"}]).text == "<s>default"
    # chat_template.jinja takes precedence over the config, as in transformers.
    (folder / "chat_template.jinja").write_text("from file")
    _, template = load_hf_tokenizer(folder)
    assert template is not None
    assert template.render([{"role": "user", "content": "x"}]).text == "from file"


def test_no_config_means_no_template(tmp_path: Path) -> None:
    tokenizer, template = load_hf_tokenizer(write_tokenizer(tmp_path / "bare"))
    assert isinstance(tokenizer, HFTokenizer)
    assert template is None


def test_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_hf_tokenizer(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        load_hf_tokenizer(empty)
    (empty / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot read"):
        load_hf_tokenizer(empty)
    folder = write_tokenizer(tmp_path / "bad_config")
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot read"):
        load_hf_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "x"}]}))
    with pytest.raises(UserError, match="'default'"):
        load_hf_tokenizer(folder)


def test_make_tokenizer(qwen_dir: Path) -> None:
    tokenizer, template = make_tokenizer("bytes")
    assert isinstance(tokenizer, ByteTokenizer)
    assert template is None
    tokenizer, template = make_tokenizer(f"hf:{qwen_dir}")
    assert isinstance(tokenizer, HFTokenizer)
    assert template is not None
    for spec in ("hf:", "gpt2", ""):
        with pytest.raises(ConfigError, match="unknown tokenizer"):
            make_tokenizer(spec)


def test_analyze_with_engine_matches_engine_count() -> None:
    body = {"model": "m", "messages": TURN_2, "max_tokens": 2, "ignore_eos": True}

    async def main() -> None:
        async with (
            TestServer(create_app(EngineConfig(speed=0.0001)), host="127.0.0.1") as server,
            aiohttp.ClientSession() as client,
        ):
            url = str(server.make_url("/"))
            facts = await analyze_with_engine(body, "chat", client, url, BS)
            async with client.post(f"{url}v1/chat/completions", json=body) as reply:
                usage = (await reply.json())["usage"]
            assert facts.prompt_tokens == usage["prompt_tokens"]
            local = analyze_request(body, "chat", ByteTokenizer(), BS)
            assert facts.est_hit_tokens == local.est_hit_tokens > 0
            np.testing.assert_array_equal(facts.blocks, local.blocks)
            completion = await analyze_with_engine(
                {"prompt": [5, 6, 7, 8, 9]}, "completions", client, url, BS
            )
            assert completion.prompt_tokens == 5
            with pytest.raises(RequestError):
                await analyze_with_engine({"messages": []}, "chat", client, url, BS)

    asyncio.run(main())


def test_analyze_with_engine_and_a_memo_sends_only_new_segments() -> None:
    sent: list[str] = []

    async def count(session: object, context: object, params: Any) -> None:
        sent.append(str(params.url))

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(count)

    async def main() -> None:
        async with (
            TestServer(create_app(EngineConfig(speed=0.0001)), host="127.0.0.1") as server,
            aiohttp.ClientSession(trace_configs=[trace]) as client,
        ):
            url = str(server.make_url("/"))
            memo = BlockMemo(EngineTokens(), BS)
            first = await analyze_with_engine(
                {"messages": TURN_1}, "chat", client, url, BS, None, memo
            )
            assert first.blocks.size and len(sent) == len(TURN_1) + 1  # and the generation prompt
            sent.clear()
            second = await analyze_with_engine(
                {"messages": TURN_2}, "chat", client, url, BS, None, memo
            )
            plain = await analyze_with_engine({"messages": TURN_2}, "chat", client, url, BS)
            np.testing.assert_array_equal(second.blocks, plain.blocks)
            assert second.prompt_tokens == plain.prompt_tokens
            assert second.est_hit_tokens == plain.est_hit_tokens

    asyncio.run(main())
    # TURN_2 adds an assistant answer and a user message; the rest came from the memo.
    assert len(sent) == 3 + (len(TURN_2) + 1)
