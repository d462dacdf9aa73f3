"""The fault suite, small: ``smetric serve`` and mock engines as real processes on
loopback, misbehaving engines and hostile clients; no request may hang, none may stay in
flight, no healthy engine may be ejected (``benchmarks/faults.py`` runs it full size)."""

from __future__ import annotations

import asyncio

import pytest

from smetric.testing.fault_suite import Scale, run_suite, table

pytestmark = [pytest.mark.server, pytest.mark.subprocess]


def test_the_router_keeps_its_promises_under_faults() -> None:
    scale = Scale.quick()
    rows = asyncio.run(run_suite(scale))
    print(table(rows))
    assert len(rows) == 12
    for row in rows:
        assert row.outcomes["hung"] == 0, row
        assert row.outcomes["unclean"] == 0, row
        assert row.inflight_after == 0, row
        assert row.wrongly_ejected == 0, row
    killed, stalled, stalled_by_default, failing, garbage, timing_out, resetting, *kv = rows[:-2]
    hostile, huge = rows[-2:]
    # The kill cut some streams (clean error events), and the others completed.
    assert killed.outcomes["clean_error"] > 0 and killed.outcomes["completed"] > 0
    # One bad engine of four: every request still completes, retried elsewhere.
    for row in (stalled, stalled_by_default, failing, garbage):
        assert row.outcomes["completed"] == scale.requests, row
    for row in (timing_out, resetting):
        assert row.outcomes["aborted"] == scale.aborts, row
    for row in kv:
        assert row.outcomes["completed"] == row.requests, row
    assert hostile.outcomes["clean_error"] == hostile.requests >= 40
    assert huge.outcomes["clean_error"] == scale.huge_prompts
