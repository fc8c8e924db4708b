"""The scheduler worker's RequestClock: phase timings of finished requests, and the first-token stamps
(FirstTokenTimes) on each request's first output only, from the stamps main and the tokenizer sent."""

from __future__ import annotations

from types import SimpleNamespace

from mllmd.engine.request import ReqStatus
from mllmd.messages import FirstTokenTimes, TokenOutput
from mllmd.workers.scheduler_worker import RequestClock


def out(rid: str, tokens: list[int], finished: bool = False) -> TokenOutput:
    return TokenOutput(rid, tokens, finished, "length" if finished else None, 4, len(tokens), 0)


def test_first_output_gets_the_stamps_and_the_timings_add_up() -> None:
    clock = RequestClock()
    engine = SimpleNamespace(reqs={"a": SimpleNamespace(status=ReqStatus.WAITING),
                                   "b": SimpleNamespace(status=ReqStatus.WAITING)})
    clock.received("a", 10.0, submitted=9.990, tokenized=9.995)
    clock.received("b", 10.0)  # no submission stamp (offline callers): timings, no FirstTokenTimes
    assert clock.after_step(engine, [], 10.0, 10.0) == []
    engine.reqs["a"].status = engine.reqs["b"].status = ReqStatus.RUNNING
    first = clock.after_step(engine, [out("a", [5]), out("b", [6])], 10.010, 10.040)
    assert first[0].first_times == FirstTokenTimes(9.990, 9.995, 10.0, 10.010, 10.040)
    assert first[1].first_times is None
    later = clock.after_step(engine, [out("a", [7], finished=True), out("b", [8], finished=True)], 10.040, 10.050)
    assert [o.first_times for o in later] == [None, None]
    timings = clock.take(SimpleNamespace(reqs={}))
    assert [(round(t.queue, 6), round(t.prefill, 6), round(t.decode, 6)) for t in timings] == [(0.01, 0.03, 0.01)] * 2
    assert not (clock.waiting or clock.admitted or clock.first or clock.origin)


def test_aborted_requests_leave_nothing_behind() -> None:
    clock = RequestClock()
    clock.received("gone", 1.0, submitted=0.5, tokenized=None)
    engine = SimpleNamespace(reqs={})  # aborted before a step saw it
    clock.after_step(engine, [], 1.0, 1.1)
    clock.take(engine)
    assert not (clock.waiting or clock.admitted or clock.first or clock.origin)
