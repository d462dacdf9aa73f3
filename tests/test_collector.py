"""The serving process's garbage collector: passes spaced out, never switched off."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from smetric.serve import collector


@pytest.fixture
def restored() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


class _Cyclic:
    def __init__(self) -> None:
        self.itself = self


def test_settle_freezes_what_exists_and_spaces_young_passes(restored: None) -> None:
    before = gc.get_freeze_count()
    collector.settle()
    assert gc.get_freeze_count() > before
    assert gc.get_threshold()[0] == collector.YOUNG
    assert gc.isenabled()


def test_cycles_made_while_serving_are_still_freed(restored: None) -> None:
    collector.settle()
    cycle = _Cyclic()
    gone = weakref.ref(cycle)
    del cycle
    assert gone() is not None  # only the collector frees a cycle
    gc.collect()
    assert gone() is None


def test_enough_allocations_start_a_young_pass_on_their_own(restored: None) -> None:
    collector.settle()
    gc.collect()
    passes = [0]

    def count(phase: str, info: dict[str, int]) -> None:
        passes[0] += phase == "start"

    gc.callbacks.append(count)
    try:
        kept: list[list[int]] = [[] for _ in range(collector.YOUNG + 100)]
    finally:
        gc.callbacks.remove(count)
    assert kept and passes[0] >= 1
