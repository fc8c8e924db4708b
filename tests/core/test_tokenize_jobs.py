"""/tokenize on the tokenizer worker's thread: a job never holds up the caller, answers come back in
order once done, a full queue is answered busy (a 503) at once, and a job that cannot even load its
tokenizer is answered rather than lost."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from mllmd.messages import TextPrompt, TokenizeOnly, TokenizeResult
from mllmd.workers.tokenize_jobs import TokenizeJobs
from mllmd.workers.tokenizer_worker import tokenize_only


def _wait_for(jobs: TokenizeJobs, n: int) -> list[TokenizeResult]:
    out: list[TokenizeResult] = []
    deadline = time.monotonic() + 60
    while len(out) < n and time.monotonic() < deadline:
        out += jobs.finished()
        time.sleep(0.005)
    return out


def test_jobs_run_off_the_callers_thread_and_answer_in_order(qwen3_tied: Path) -> None:
    from transformers import AutoTokenizer

    gate = threading.Event()
    loads: list[int] = []

    def load() -> Any:
        loads.append(threading.get_ident())
        return AutoTokenizer.from_pretrained(qwen3_tied)

    def run(tok: Any, msg: TokenizeOnly) -> TokenizeResult:
        gate.wait(30)
        return tokenize_only(tok, msg)

    jobs = TokenizeJobs(load, run)
    try:
        assert jobs.submit(TokenizeOnly("a", TextPrompt("hello world"))) is None
        assert jobs.submit(TokenizeOnly("b", None, decode=[[9707]])) is None
        assert jobs.pending and jobs.finished() == []  # the caller went on while the job waits
        gate.set()
        answers = _wait_for(jobs, 2)
        reference = AutoTokenizer.from_pretrained(qwen3_tied)
        assert [a.id for a in answers] == ["a", "b"]
        assert answers[0].ids == reference.encode("hello world", add_special_tokens=False)
        assert answers[1].texts == [reference.decode([9707])] and not jobs.pending
        assert loads and threading.get_ident() not in loads  # the job's own tokenizer, on its thread
    finally:
        gate.set()
        jobs.close()


def test_a_full_queue_is_answered_busy_at_once() -> None:
    gate = threading.Event()
    jobs = TokenizeJobs(lambda: object(), lambda tok, msg: (gate.wait(30), TokenizeResult(msg.id, ids=[1]))[1],
                        max_queued=2)  # fmt: skip
    try:
        assert jobs.submit(TokenizeOnly("a", TextPrompt("x"))) is None
        assert jobs.submit(TokenizeOnly("b", TextPrompt("x"))) is None
        busy = jobs.submit(TokenizeOnly("c", TextPrompt("x")))
        assert busy is not None and busy.id == "c" and busy.unavailable and "2 tokenize requests" in (busy.error or "")
        gate.set()
        assert [a.id for a in _wait_for(jobs, 2)] == ["a", "b"]
        assert jobs.submit(TokenizeOnly("d", TextPrompt("x"))) is None  # room again
        assert [a.id for a in _wait_for(jobs, 1)] == ["d"]
    finally:
        gate.set()
        jobs.close()


def test_a_job_whose_tokenizer_fails_to_load_is_answered_unavailable() -> None:
    def load() -> Any:
        raise OSError("tokenizer.json vanished")

    jobs = TokenizeJobs(load, tokenize_only)
    try:
        assert jobs.submit(TokenizeOnly("a", TextPrompt("x"))) is None
        (answer,) = _wait_for(jobs, 1)
        assert answer.id == "a" and answer.unavailable and "tokenizer.json vanished" in (answer.error or "")
    finally:
        jobs.close()
