"""/admin/status and mllmctl during a hot swap: requests still finishing on the model being swapped out
are in flight too (the count read the active model only, so a drain or a status said 0 while the old
model still served)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from mllmd.ctl import render_status
from mllmd.daemon.config import load_config
from mllmd.daemon.main import Daemon


class _Slot:
    """What status() reads of a model slot: its requests, no engine figures yet, its workers."""

    def __init__(self, in_flight: int) -> None:
        self.rm = SimpleNamespace(num_in_flight=in_flight, num_groups=in_flight, aliases={})
        self.engine_stats = None
        self.ready = True
        self.supervisor = SimpleNamespace(status=lambda: [], degraded_reason=None)

    def describe(self) -> dict[str, Any]:
        return {"name": "m"}


def _slot(in_flight: int) -> Any:
    return _Slot(in_flight)


@pytest.fixture
def daemon() -> Any:
    d = Daemon(load_config("/dev/null", {}, environ={}))
    yield d
    d.zctx.destroy(linger=0)


def test_requests_of_a_retiring_model_count_as_in_flight(daemon: Any) -> None:
    daemon.active, daemon.retiring = _slot(2), {_slot(5)}
    req = daemon.status()["requests"]
    assert (req["in_flight"], req["retiring"], req["tracked"]["requests"]) == (7, 5, 7)
    assert "5 finishing on the previous model" in render_status(daemon.status())


def test_no_retiring_model_no_retiring_line(daemon: Any) -> None:
    daemon.active = _slot(1)
    status = daemon.status()
    assert (status["requests"]["in_flight"], status["requests"]["retiring"]) == (1, 0)
    assert "previous model" not in render_status(status)


def test_drain_counts_the_retiring_models_requests(daemon: Any) -> None:
    daemon.active, daemon.retiring = _slot(1), {_slot(3)}
    assert "4 in flight will finish" in asyncio.run(daemon.start_drain())
