"""Detokenizer: sampled token ids -> text deltas, with stop strings (the detokenizer worker's core).

Per request the worker keeps one `DetokenizerState`:

    state = DetokenizerState(tokenizer, stop=params.stop, skip_special_tokens=..., prompt_ids=...)
    out = state.add(new_token_ids)   # DetokOutput(text_delta, stopped, matched_stop)
    ...                              # on stopped: finish with reason "stop", abort the request
    out = state.flush()              # generation ended (EOS / length / abort): held-back text

Concatenated `text_delta`s never hold half a character nor any text at or past a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mllmd.detokenizer.incremental import (
    IncrementalDetokenizer,
    backend_tokenizer,
    bytes_to_unicode,
    token_bytes,
    token_text,
)
from mllmd.detokenizer.stop import StopStringMatcher

__all__ = [
    "DetokOutput",
    "DetokenizerState",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "backend_tokenizer",
    "bytes_to_unicode",
    "token_bytes",
    "token_text",
]


@dataclass(frozen=True)
class DetokOutput:
    """What one `add`/`flush` produced: new text, and whether (and by which string) it stopped."""

    text_delta: str
    stopped: bool = False
    matched_stop: str | None = None


class DetokenizerState:
    """One request's detokenization: incremental decoding, then stop-string matching."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        stop: Iterable[str] = (),
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens, prompt_ids)
        self.matcher = StopStringMatcher(stop, include_stop=include_stop_str_in_output)
        self._chunks: list[str] = []

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    @property
    def matched_stop(self) -> str | None:
        return self.matcher.matched

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    def add(self, token_ids: Sequence[int]) -> DetokOutput:
        """Decode newly sampled ids; after a stop string matched, further ids are ignored."""
        if self.matcher.stopped:
            return DetokOutput("", True, self.matcher.matched)
        delta = self.detokenizer.add(token_ids)
        emit, stopped = self.matcher.feed(delta) if delta else ("", False)
        return self._out(emit, stopped)

    def flush(self) -> DetokOutput:
        """Generation ended: release held-back bytes (as U+FFFD) and held-back stop-prefix text."""
        if self.matcher.stopped:
            return DetokOutput("", True, self.matcher.matched)
        emit, stopped = self.matcher.feed(self.detokenizer.flush())
        if not stopped:
            emit += self.matcher.flush()
        return self._out(emit, stopped)

    def _out(self, emit: str, stopped: bool) -> DetokOutput:
        if emit:
            self._chunks.append(emit)
        return DetokOutput(emit, stopped, self.matcher.matched)
