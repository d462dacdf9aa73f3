"""The router-wide budget of request-body bytes: holds that grow as bodies arrive."""

from __future__ import annotations

import asyncio

import pytest

from smetric.serve.buffered import ByteBudget, Hold
from smetric.serve.refusals import Refusal


def test_holds_grow_within_the_budget_wait_for_room_and_give_it_back() -> None:
    async def main() -> None:
        seen: list[int] = []
        budget = ByteBudget(100, wait_s=0.2, report=seen.append)
        first, second = Hold(budget), Hold(budget)
        await first.grow(60)
        await first.grow(150)  # alone, a body always fits, even past the limit
        await first.grow(100)  # never less than it holds
        assert budget.used == first.size == 150
        waiting = asyncio.create_task(second.grow(10))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        first.shrink(50)  # 50 + 10 fit: the waiter is woken and takes its room
        await asyncio.wait_for(waiting, 1)
        assert budget.used == 60
        with pytest.raises(Refusal) as refused:
            await second.grow(60)  # 50 + 60 do not fit, and nobody gives back in time
        assert refused.value.status == 503 and refused.value.retry_after_s == 1
        assert second.size == 10  # a refused growth holds nothing more
        first.shrink(0)
        second.shrink(0)
        second.shrink(0)  # given back once
        assert budget.used == 0
        assert seen == [60, 150, 50, 60, 10, 0]  # the gauge follows every change

    asyncio.run(main())
