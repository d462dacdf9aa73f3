"""Where a template follow-up's decision time goes, step by step.

    python benchmarks/decision_steps.py [--tokenizer hf:/path] [--tokens 128000]

One agent session (``agentic_bodies``) of about ``--tokens`` tokens is decided turn by turn
as ``router_decision.py`` decides it, with the model's tokenizer and chat template (the
SmolLM2 folder the real-engine setup leaves in ~/.cache/smetric by default). For the last
20 follow-ups, the CPU time of each step is summed: each step's function is wrapped with
a timer (a step inside another counts in both), and the mean per follow-up is printed.
The wrapping adds about a microsecond a call, so the total sits a little above
``router_decision.py``'s. The steps are the functions the router calls by name, so the
same command on an older commit compares step by step.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentic_bodies import agent_messages, chat_body, prose, session_turns

from smetric.core import conversation, envelope
from smetric.core.block_memo import BlockMemo
from smetric.core.envelope import ChatReader
from smetric.serve import routing
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.serve.tokenizers import HFTokenizer, make_tokenizer

SMOLLM2 = Path("~/.cache/smetric/engines/smollm2-135m-instruct").expanduser()
FOLLOW_UPS = 20
MEMO = 256 << 20
# (owner, attribute, label): the steps, outermost first.
STEPS: list[tuple[Any, str, str]] = [
    (envelope.ChatReader, "read", "read the body (envelope, kept prefix, tail)"),
    (envelope.Prefixes, "find", "  find and compare the kept prefix"),
    (envelope.ChatReader, "facts", "the facts"),
    (conversation.ChatTemplate, "render", "  render with the template"),
    (conversation, "identify", "    identify the messages"),
    (conversation, "splice", "    splice"),
    (conversation, "_cut", "    cut the text into segments"),
    (envelope, "hash_segments", "  tokenise and hash"),
    (HFTokenizer, "encode", "    tokenise (the tokenizer alone)"),
    (routing.RoutingCore, "decide", "match the engines' indexes and choose"),
]
CLOCK = time.thread_time


def timed(spent: dict[str, float], label: str, step: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = CLOCK()
        try:
            return step(*args, **kwargs)
        finally:
            spent[label] += CLOCK() - started

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=f"hf:{SMOLLM2}")
    parser.add_argument("--tokens", type=int, default=128_000)
    args = parser.parse_args()
    tokenizer, template = make_tokenizer(args.tokenizer)
    if template is None:
        raise SystemExit(f"{args.tokenizer} has no chat template")
    template.prepare(MEMO)
    spent: dict[str, float] = collections.defaultdict(float)
    for owner, name, label in STEPS:
        setattr(owner, name, timed(spent, label, getattr(owner, name)))
    jinja = template._template
    jinja.render = timed(spent, "      the window renders (Jinja)", jinja.render)  # type: ignore[method-assign]
    sample = prose(random.Random(1), 50_000)
    ratio = len(sample) / len(tokenizer.encode(sample))
    turns = session_turns(agent_messages(int(args.tokens * ratio)))
    raws = [json.dumps(chat_body(messages)).encode() for messages in turns]
    engines = [Engine(f"http://127.0.0.1:{9000 + i}", 1 << 20) for i in range(16)]
    router = Router(engines, RouterSettings(), tokenizer=tokenizer, template=template)
    memo, reader = BlockMemo(tokenizer, 16, MEMO), ChatReader(MEMO, template)
    gc.freeze()
    first, total = len(raws) - FOLLOW_UPS, 0.0
    for i, raw in enumerate(raws):
        if i == first:
            spent.clear()
        started = CLOCK()
        read = reader.read(raw, "chat", None)
        assert read is not None
        facts = reader.facts(read, "chat", tokenizer, 16, memo)
        router.core.decide(facts, router.engines)
        if i >= first:
            total += CLOCK() - started
        router.engines[i % 2].remember(facts.blocks)
    print(f"{facts.prompt_tokens:,} tokens; mean CPU ms per follow-up over the last {FOLLOW_UPS}")
    print(f"{'a follow-up in all':<48} {total / FOLLOW_UPS * 1e3:6.3f}")
    order = [label for *_, label in STEPS]
    order.insert(order.index("    cut the text into segments"), "      the window renders (Jinja)")
    for label in order:
        print(f"{label:<48} {spent[label] / FOLLOW_UPS * 1e3:6.3f}")


if __name__ == "__main__":
    main()
