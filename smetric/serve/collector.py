"""How a router process runs CPython's cyclic garbage collector once it serves.

Reference counting frees what a request allocates the moment the request ends; the
collector is there for cycles, and a router makes few (under load, young passes find
none). Yet each young pass walks every object of every request in flight (their
coroutines, frames and headers), and CPython's default starts one every 700 net
allocations: several times a request at a few dozen in flight, about a tenth of a tiny
request's CPU time in ``benchmarks/router_throughput.py``. A full pass walks every object
the caches hold (blocks, prefix-tree nodes, messages), tens of milliseconds at their
default sizes, landing on whichever requests are in flight.

So what exists once the router is built lives as long as the process and is left out of
collection, young passes come every ``YOUNG`` net allocations (hundreds of requests), and
full passes rarely. The few cycles requests leave (an exception and its traceback) wait
longer to be freed; they are a few kilobytes between passes.
"""

from __future__ import annotations

import gc

YOUNG = 50_000
# Passes of each generation before one of the next; CPython's default is 10 and 10. A
# full pass also waits until a quarter of the old objects are new since the last one.
MIDDLE = 20
OLD = 100


def settle() -> None:
    """Freeze what exists now out of collection and space the passes out."""
    gc.freeze()
    gc.set_threshold(YOUNG, MIDDLE, OLD)
