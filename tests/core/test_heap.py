"""mllmd.heap: what a process holds after loading is frozen out of full collections, garbage is not
frozen with it, and a later call frees what became garbage since (a model swapped out)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from mllmd.heap import freeze_long_lived
from mllmd.messages import WorkerReady
from mllmd.workers.base import WorkerContext


class Node:
    def __init__(self) -> None:
        self.other: Any = None


def _cycle() -> Node:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a


@pytest.fixture(autouse=True)
def _thawed() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the test session collects as usual


def _tracked(obj: object) -> bool:
    """Whether a collection visits `obj` (gc.get_objects lists generations 0-2, not the frozen one)."""
    return any(o is obj for o in gc.get_objects())


def test_what_is_alive_is_frozen_and_garbage_is_collected_first() -> None:
    kept = [_cycle() for _ in range(100)]
    garbage = _cycle()
    dead = weakref.ref(garbage)
    del garbage
    assert dead() is not None  # a cycle: reference counting alone does not free it

    frozen = freeze_long_lived()

    assert dead() is None
    assert frozen == gc.get_freeze_count() >= 200
    assert not _tracked(kept) and not _tracked(kept[0])
    fresh = []
    assert _tracked(fresh)  # allocated after the freeze: collected as usual


def test_a_frozen_cycle_that_becomes_garbage_is_freed_by_the_next_call() -> None:
    held = [_cycle()]
    freeze_long_lived()
    dead = weakref.ref(held[0])
    held.clear()  # a model swapped out: its cycle is garbage now, but frozen
    gc.collect()
    assert dead() is not None  # a collection does not look at frozen objects

    freeze_long_lived()

    assert dead() is None


def test_a_worker_freezes_its_heap_when_it_reports_ready(tmp_path: Any) -> None:
    ctx = WorkerContext("tokenizer", str(tmp_path), {})
    sent: list[Any] = []
    ctx.send_main = sent.append  # type: ignore[method-assign]  # no main process to receive it
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    try:
        ctx.ready(context_length=1)
    finally:
        ctx.to_main.close(linger=0)
        ctx.ctx.term()
    assert gc.get_freeze_count() > 0
    assert not _tracked(ctx)
    assert isinstance(sent[0], WorkerReady) and sent[0].context_length == 1
