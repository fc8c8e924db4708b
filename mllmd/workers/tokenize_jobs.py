"""/tokenize, /detokenize and long prompts off the tokenizer worker's loop.

Counting the tokens of a text longer than the context is what /tokenize is for, so its bodies are
encoded whole: megabytes take seconds, and on the worker's loop every generation request behind one
would wait that long. The jobs run on a thread of their own, with a tokenizer of their own (a fast
tokenizer's settings are not safe to share across threads), and the Rust encoder lets the loop run
meanwhile. At most `max_queued` jobs wait; past that a job is answered busy at once (a 503), so a
client flooding /tokenize costs bounded memory and delays only requests that queue here too. The
worker encodes the text of a long generation prompt here as well (`call_later`), for the same reason.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

from mllmd.messages import TokenizeOnly, TokenizeResult

MAX_QUEUED = 8  # jobs (/tokenize, long prompts) waiting or running at once in one worker
T = TypeVar("T")


class TokenizeJobs:
    """A one-thread queue of TokenizeOnly jobs; the worker's loop collects the answers."""

    def __init__(self, load_tokenizer: Callable[[], Any], run: Callable[[Any, TokenizeOnly], TokenizeResult],
                 max_queued: int = MAX_QUEUED) -> None:  # fmt: skip
        self._load = load_tokenizer
        self._run = run
        self._tokenizer: Any = None  # loaded on the thread by its first job
        self.max_queued = max_queued
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._jobs: list[tuple[str, concurrent.futures.Future[TokenizeResult]]] = []
        self._calls: list[concurrent.futures.Future[Any]] = []  # call_later's, until done

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def _in_hand(self) -> int:
        self._calls = [f for f in self._calls if not f.done()]
        return len(self._jobs) + len(self._calls)

    def call_later(self, fn: Callable[..., T]) -> concurrent.futures.Future[T] | None:
        """`fn(tokenizer)` on the jobs' thread, with its tokenizer; None when `max_queued` jobs are in hand."""
        if self._in_hand() >= self.max_queued:
            return None
        f = self._pool.submit(lambda: fn(self._loaded()))
        self._calls.append(f)
        return f

    def submit(self, msg: TokenizeOnly) -> TokenizeResult | None:
        """Queue `msg`; a busy answer to send at once when `max_queued` jobs are already in hand."""
        if self._in_hand() >= self.max_queued:
            return TokenizeResult(msg.id, error=f"{self.max_queued} tokenize requests are already in progress; "
                                  "retry shortly", unavailable=True)  # fmt: skip
        self._jobs.append((msg.id, self._pool.submit(self._job, msg)))
        return None

    def finished(self) -> list[TokenizeResult]:
        """The answers of the jobs done since the last call, in the order they were queued."""
        done = [(i, f) for i, f in self._jobs if f.done()]
        self._jobs = [(i, f) for i, f in self._jobs if not f.done()]
        out = []
        for job_id, f in done:
            try:
                out.append(f.result())
            except Exception as e:  # the job's tokenizer could not be loaded: the worker's fault, not the client's
                out.append(TokenizeResult(job_id, error=f"the tokenizer worker failed: {e}", unavailable=True))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _loaded(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._load()
        return self._tokenizer

    def _job(self, msg: TokenizeOnly) -> TokenizeResult:
        return self._run(self._loaded(), msg)
