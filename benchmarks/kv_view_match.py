"""What matching a prompt against engines' KV-event views costs a routing decision.

    python benchmarks/kv_view_match.py [--engines 32] [--tokens 131072] [--repeat 50]

In process. Each engine's events view holds one session of ``--tokens`` random tokens on
its GPU and the same blocks offloaded to CPU (vLLM's hash-only offload events); the prompt
is one engine's session, so one engine matches it whole and the others miss at its first
block, as in a cluster where sessions stick. Prints the deciding thread's CPU time per
request for the local hits (one match per engine) and for ``--global-tier events`` (the
longest prefix any engine's offload media hold).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from smetric.core.blocks import chain_hashes
from smetric.core.kv_events import BlockStored, EventIndex
from smetric.serve.engines import Engine
from smetric.serve.global_tier import OffloadEvents

BS = 16


def cluster(engines: int, tokens: int) -> tuple[list[Engine], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    out, prompts = [], []
    for i in range(engines):
        session = rng.integers(0, 1 << 17, tokens).tolist()
        hashes = tuple(range(i << 32, (i << 32) + tokens // BS))
        index = EventIndex(BS)
        index.apply([BlockStored(hashes, None, tuple(session), BS, "GPU")])
        index.apply([BlockStored(hashes, None, (), BS, "CPU")])
        engine = Engine(f"http://engine-{i}", 1 << 20, events=index)
        out.append(engine)
        prompts.append(chain_hashes(session, BS))
    return out, prompts


def per_request_ms(work: Callable[[], object], repeat: int) -> float:
    started = time.thread_time()
    for _ in range(repeat):
        work()
    return (time.thread_time() - started) / repeat * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    engines, prompts = cluster(args.engines, args.tokens)
    tier = OffloadEvents(engines)
    blocks = prompts[len(prompts) // 2]
    prompt_tokens = len(blocks) * BS
    assert tier.match(blocks) == len(blocks)
    local = per_request_ms(
        lambda: [e.predicted_hit(blocks, BS, prompt_tokens) for e in engines], args.repeat
    )
    offloaded = per_request_ms(lambda: tier.match(blocks), args.repeat)
    print(f"{args.engines} engines, {args.tokens} tokens ({len(blocks)} blocks):")
    print(f"  local hits (GPU views):   {local:.2f} ms CPU per request")
    print(f"  global tier (CPU views):  {offloaded:.2f} ms CPU per request")


if __name__ == "__main__":
    main()
