"""Stop strings over a stream of text deltas.

`StopStringMatcher.feed(delta)` returns the text that is safe to emit: everything before the first
stop string, minus a held-back tail that could still grow into a stop string. Matches are found
across delta (token) boundaries because the held-back tail is searched together with the next delta.

When several stop strings occur, the one whose occurrence *ends* first wins (the first one to appear
as the text streams); on a tie the one that starts first (the longer one). This makes the result
independent of how the text is cut into deltas: feeding "abcd" at once or one character at a time
stops at the same place with the same `matched` string.

Memory is linear in the stop strings' length and a feed costs C-level string searches only (an
earlier version kept every proper prefix of every stop string: a 40,000-character stop string cost
the detokenizer 727 MiB and seconds of CPU).
"""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    """Finds stop strings in streamed text; never emits text past a stop.

    `include_stop`: keep the matched stop string in the emitted text (vLLM's
    `include_stop_str_in_output`); by default it is cut off.
    """

    def __init__(self, stops: Iterable[str], include_stop: bool = False) -> None:
        unique: list[str] = []
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings (got {s!r})")
            if s not in unique:
                unique.append(s)
        self.stops: tuple[str, ...] = tuple(unique)
        self.include_stop = include_stop
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    @property
    def held(self) -> str:
        """Text received but not emitted yet (a possible start of a stop string)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a text delta; return `(text to emit now, stopped)`. After a stop, returns `("", True)`."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return delta, False
        text = self._held + delta
        hit = self._find(text)
        if hit is not None:
            start, stop = hit
            self.matched = stop
            self._held = ""
            return text[: start + len(stop) if self.include_stop else start], True
        keep = self._hold_len(text)
        cut = len(text) - keep
        self._held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """End of generation: release the held-back text (nothing once a stop string matched)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _find(self, text: str) -> tuple[int, str] | None:
        """The occurrence that ends first (ties: starts first), as `(start, stop)`."""
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _hold_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string.

        For each stop string, the candidate tails start where its first character occurs in the last
        len(stop) - 1 characters; the first (longest) that the stop string starts with wins."""
        n = len(text)
        best = 0
        for s in self.stops:
            first = s[0]
            i = text.find(first, max(0, n - len(s) + 1))
            while i != -1 and n - i > best:
                if s.startswith(text[i:]):
                    best = n - i
                    break
                i = text.find(first, i + 1)
        return best
