"""Router decision latency on agent-shaped prompts: decode, render, tokenise, hash, match, choose.

    python benchmarks/router_decision.py [--engines 16] [--tokenizer hf:/path] [--clock cpu]

In process, no HTTP; each body read as ``smetric serve`` reads it (``core.envelope``: from
its envelope and the prefixes kept of earlier bodies; with a chat template, a follow-up's
last messages rendered and spliced onto the rendering kept of its previous turn,
``core.template_splice``). For each tokenizer (bytes;
a Hugging Face one, given or SmolLM2's when the real-engine setup left it in
~/.cache/smetric, with the generic rendering and with the model's chat template) and
prompt size, one agent session (``agentic_bodies``) is decided turn by turn as the router
decides it:

- *cold*: the last, largest request with an empty memo (a conversation the router has
  never seen, or a replica that just started; a chat template keeping no renderings);
- *follow-up*: the last 20 turns, each after the router decided every earlier turn (so the
  memo holds the history, the earlier body's prefix is kept, and one engine's index holds
  the previous prompt);
- *uncached*: the same follow-ups decoded and analysed whole with the memo off (and a
  chat template that keeps no renderings, so it renders the whole conversation), which is
  what every request cost before the memo (with the faster hash already), timed after
  the follow-ups rather than between them;
- *new*: tokenising only the messages a follow-up adds, which no cache can spare;
- *rest*: a follow-up's time less its *new* time, the router's own share (p99);
- *checks*: how many of the timed follow-ups were a chat template's sampled check, one
  splice in ``template_splice.SAMPLE`` rendered whole as well (its p99 is the worst of 20,
  so one check sets it);
- *route*: matching the follow-up against every engine's index and choosing (p50).

Prints p50 and p99 in milliseconds, the target being follow-ups p99 <= 2 ms and cold
<= 10 ms at 128 k tokens. Times are the deciding thread's CPU time unless ``--clock wall``:
on a machine shared with other jobs, wall-clock percentiles measure the neighbours.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from agentic_bodies import agent_messages, chat_body, prose, session_turns

from smetric.core.block_memo import BlockMemo
from smetric.core.blocks import ByteTokenizer, Tokenizer
from smetric.core.conversation import ChatTemplate, RequestFacts, analyze_request
from smetric.core.envelope import ChatReader
from smetric.core.parsing import decode_body
from smetric.core.template_splice import SAMPLE
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.serve.tokenizers import make_tokenizer

PROMPTS = (8_000, 32_000, 128_000)
FOLLOW_UPS = 20
MEMO = 256 << 20  # --memo-bytes' default
SMOLLM2 = Path("~/.cache/smetric/engines/smollm2-135m-instruct").expanduser()


# The thread's CPU time by default: what a decision costs, whatever else the machine runs.
CLOCK: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}


def decide(
    router: Router,
    raw: bytes,
    memo: BlockMemo | None,
    clock: Callable[[], float],
    reader: ChatReader | None = None,
    template: ChatTemplate | None = None,
) -> tuple[float, RequestFacts]:
    """Seconds to decide one request (from its raw body), and its facts: read as
    ``smetric serve`` reads it (``reader``: its envelope and kept prefixes, with the
    router's rendering), or decoded and analysed whole (with ``template`` in place of the
    router's, if given)."""
    started = clock()
    size = router.settings.block_size
    if reader is not None:
        read = reader.read(raw, "chat", None)
        assert read is not None
        facts = reader.facts(read, "chat", router.tokenizer, size, memo)
    else:
        body = decode_body(raw)
        chosen = template or router.template
        facts = analyze_request(body, "chat", router.tokenizer, size, chosen, memo)
    router.core.decide(facts, router.engines)
    return clock() - started, facts


def encode_seconds(tokenizer: Tokenizer, messages: list[dict], clock: Callable[[], float]) -> float:
    """What tokenising a follow-up's new messages alone takes: the floor of its decision."""
    started = clock()
    for message in messages:
        tokenizer.encode(message["content"])
    return clock() - started


def run(
    label: str,
    tokenizer: Tokenizer,
    engines: int,
    clock: Callable[[], float],
    template_of: Callable[[int], ChatTemplate] | None = None,
) -> None:
    """One row per prompt size, each decided by a fresh router; ``template_of(keep_bytes)``
    makes the model's template anew (keeping nothing for the uncached analyses)."""
    sample = prose(random.Random(1), 50_000)
    ratio = len(sample) / len(tokenizer.encode(sample))
    for tokens in PROMPTS:
        template = template_of(MEMO) if template_of is not None else None
        whole = template_of(0) if template_of is not None else None
        turns = session_turns(agent_messages(int(tokens * ratio)))
        raws = [json.dumps(chat_body(m)).encode() for m in turns]
        router = Router(
            [Engine(f"http://127.0.0.1:{9000 + i}", 1 << 20) for i in range(engines)],
            RouterSettings(),
            tokenizer=tokenizer,
            template=template,
        )
        gc.freeze()  # as ``smetric serve`` does once started
        cold = [
            decide(router, raws[-1], BlockMemo(tokenizer, 16), clock, ChatReader(MEMO, whole))[0]
            for _ in range(10)
        ]
        memo, reader = BlockMemo(tokenizer, 16), ChatReader(MEMO, template)
        warm, uncached, fresh, matching, size, checks = [], [], [], [], 0, 0
        first = max(1, len(raws) - FOLLOW_UPS)  # the timed follow-ups: never the first turn
        for i, raw in enumerate(raws):
            spliced = template.splicer.spliced if template is not None else 0
            seconds, facts = decide(router, raw, memo, clock, reader)
            if i >= first:
                warm.append(seconds)
                if template is not None and template.splicer.spliced > spliced:
                    checks += template.splicer.spliced % SAMPLE == 0
                fresh.append(encode_seconds(tokenizer, turns[i][len(turns[i - 1]) :], clock))
                started = clock()
                router.core.decide(facts, router.engines)
                matching.append(clock() - started)
            router.engines[i % 2].remember(facts.blocks)
            size = facts.prompt_tokens
        # Apart from the follow-ups: a whole analysis between two of them would leave the
        # next one the CPU caches full of its own data, which no neighbour in a router
        # serving follow-ups does.
        for raw in raws[first:]:
            uncached.append(decide(router, raw, None, clock, template=whole)[0])
        row = [np.percentile(x, q) * 1e3 for x in (cold, warm, uncached) for q in (50, 99)]
        print(
            f"{label:<10} {size:>8,} {len(raws[-1]) / 1e3:>7.0f}"
            + "".join(f"{v:>9.2f}" for v in row)
            + f"{row[4] / row[2]:>9.1f}{np.percentile(fresh, 50) * 1e3:>9.2f}"
            + f"{np.percentile(np.subtract(warm, fresh), 99) * 1e3:>9.2f}"
            + f"{np.percentile(matching, 50) * 1e3:>9.2f}{checks:>7}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--tokenizer", action="append", help="hf:/path (repeatable)")
    parser.add_argument("--clock", choices=sorted(CLOCK), default="cpu")
    args = parser.parse_args()
    clock = CLOCK[args.clock]
    specs = args.tokenizer or []
    if not specs and (SMOLLM2 / "tokenizer.json").is_file():
        specs.append(f"hf:{SMOLLM2}")
    print(f"{args.engines} engines, block size 16; milliseconds per decision ({args.clock} time)")
    print(
        f"{'tokenizer':<10} {'tokens':>8} {'KB':>7}"
        + "".join(f"{h:>9}" for h in ("cold p50", "cold p99", "foll p50", "foll p99"))
        + "".join(
            f"{h:>9}" for h in ("unc p50", "unc p99", "unc/foll", "new p50", "rest p99", "route")
        )
        + f"{'checks':>7}"
    )
    run("bytes", ByteTokenizer(), args.engines, clock)
    for spec in specs:
        tokenizer, template = make_tokenizer(spec)
        run("hf", tokenizer, args.engines, clock)
        if template is not None:

            def template_of(keep_bytes: int, spec: str = spec) -> ChatTemplate:
                made = make_tokenizer(spec)[1]
                assert made is not None
                made.prepare(keep_bytes)
                return made

            run("hf+tmpl", tokenizer, args.engines, clock, template_of)


if __name__ == "__main__":
    main()
