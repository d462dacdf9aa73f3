"""Router decision latency: request analysis (render, tokenize, hash) plus the policy's view
and choice, by prompt length and engine count, in process (no HTTP).

    python benchmarks/router_decision.py

Prints the median per decision and, side by side, the share spent analysing the body vs
matching every engine's prefix index and routing. Byte tokenizer, block size 16.
"""

from __future__ import annotations

import statistics
import time

from smetric.core.blocks import ByteTokenizer
from smetric.core.conversation import analyze_request
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine

PROMPTS = (1_000, 8_000, 32_000, 128_000)
ENGINES = (4, 16, 64)


def body(tokens: int) -> dict:
    history = [
        {"role": "system", "content": "s" * 2000},
        {"role": "user", "content": "u" * (tokens // 2)},
        {"role": "assistant", "content": "a" * 200},
        {"role": "user", "content": "v" * (tokens // 2 - 2400)},
    ]
    return {"model": "m", "messages": history}


def main() -> None:
    print(f"{'prompt':>8} {'engines':>8} {'analyse ms':>11} {'route ms':>9} {'total ms':>9}")
    tokenizer = ByteTokenizer()
    for tokens in PROMPTS:
        request = body(tokens)
        for n in ENGINES:
            router = Router(
                [Engine(f"http://127.0.0.1:{9000 + i}", 1 << 16) for i in range(n)],
                RouterSettings(),
            )
            facts = analyze_request(request, "chat", tokenizer, 16)
            router.engines[0].remember(facts.blocks)  # one engine holds the prefix
            analyse, route = [], []
            for _ in range(20):
                t0 = time.perf_counter()
                facts = analyze_request(request, "chat", tokenizer, 16)
                t1 = time.perf_counter()
                router.route(facts, router.engines)
                t2 = time.perf_counter()
                analyse.append(t1 - t0)
                route.append(t2 - t1)
            a, r = statistics.median(analyse) * 1e3, statistics.median(route) * 1e3
            print(f"{tokens:>8,} {n:>8} {a:>11.2f} {r:>9.2f} {a + r:>9.2f}")


if __name__ == "__main__":
    main()
