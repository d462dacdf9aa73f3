"""How a router process runs CPython's cyclic garbage collector once it serves.

Reference counting frees what a request allocates the moment the request ends; the
collector is there for cycles, and a router makes few (under load, young passes freed 9
objects in about 45,000 requests). Yet with CPython's default, a young pass every 700 net
allocations, one comes every twenty-odd tiny requests and walks every object of every
request in flight (coroutines, frames, headers); about one in a hundred and twenty is a
full pass, which walks all the caches hold (blocks, prefix-tree nodes, messages: 22 ms at
tens of thousands of objects, more as they fill), landing on whichever requests are in
flight. Together they cost a tiny request about a tenth of its CPU time
(``benchmarks/router_collector.py``).

So what exists once the router is built lives as long as the process and is left out of
collection, and young passes come every ``YOUNG`` net allocations: thousands of requests,
as the caches grow. The other thresholds stay CPython's: a middle pass walks what ten
young passes left, so it grows with ``YOUNG``, and a full pass still waits for ten of
those. The few cycles requests leave (an exception and its traceback: about 500 objects
in 45,000 requests, with the default's passes) wait longer to be freed.
"""

from __future__ import annotations

import gc

YOUNG = 50_000


def settle() -> None:
    """Freeze what exists now out of collection and space the young passes out."""
    gc.freeze()
    gc.set_threshold(YOUNG)
