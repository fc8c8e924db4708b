"""Split a Qwen3 reply into reasoning (`<think>...</think>`) and answer content.

Qwen3 chat templates render a thinking turn as::

    <|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{content}

With thinking on, Qwen3 (2504) models emit `<think>` themselves, while Qwen3.5 (and the
Qwen3-2507 thinking models) end the *prompt* with `<think>\\n`, so the reply starts inside the
reasoning with no opening tag: construct the parser with `starts_in_reasoning=True` then (see
`prompt_ends_in_reasoning`). With `enable_thinking=False` the template puts an empty
`<think>\\n\\n</think>\\n\\n` in the prompt and the reply is all content.

Rules, identical for `ReasoningParser.extract` and `StreamingReasoning` (whatever the deltas):

* An opening `<think>` is recognised only at the very start of the reply (after optional
  whitespace, which is then dropped). Without it the reply is all content, unless
  `starts_in_reasoning`. A `<think>` anywhere else is ordinary text.
* Reasoning: one `\\n` right after the opening (tag or start of reply) and one `\\n` right
  before `</think>` are removed; everything else is kept verbatim.
* Content: every `\\n` right after `</think>` is removed (the template's `\\n\\n`, which it also
  strips with `lstrip('\\n')` when rendering a past reply); the rest is verbatim, including any
  later `<think>`/`</think>` text.
* No `</think>` before the end of the reply (e.g. cut by `max_tokens`): all of it is reasoning and
  the content is empty, except that, for a request with tools, a `<tool_call>` ends the unclosed
  reasoning (its preceding `\n`s dropped) and the content starts with it.
* `extract` returns reasoning `None` when the reply had no reasoning section at all and `""` for an
  empty `<think>\\n\\n</think>` block.

Streaming holds back only what could still turn out to be part of a tag, e.g. a trailing `"\\n</th"`,
so `"</thi" + "nk>"` is handled and every character is emitted exactly once.
"""

from __future__ import annotations

from typing import ClassVar

THINK_START = "<think>"
THINK_END = "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 if none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def prompt_ends_in_reasoning(prompt: str, start_tag: str = THINK_START, end_tag: str = THINK_END) -> bool:
    """True when the rendered prompt's last assistant turn opened `<think>` without closing it."""
    tail = prompt[prompt.rfind("<|im_start|>assistant") :] if "<|im_start|>assistant" in prompt else prompt
    return tail.rfind(start_tag) > tail.rfind(end_tag)


# Streaming states.
_START = 0  # before anything decisive: waiting for an optional leading `<think>`
_REASONING_BEGIN = 1  # just inside the reasoning: drop one leading "\n"
_REASONING = 2
_CONTENT_BEGIN = 3  # just after `</think>`: drop leading "\n"s
_CONTENT = 4


class StreamingReasoning:
    """Incremental splitter: `feed(delta) -> (reasoning_delta, content_delta)`, then `flush()`."""

    def __init__(self, starts_in_reasoning: bool = False, start_tag: str = THINK_START,
                 end_tag: str = THINK_END, tool_call_tag: str | None = None) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self.start_tag = start_tag
        self.end_tag = end_tag
        self.tool_call_tag = tool_call_tag  # ends an unclosed reasoning; kept, as the content's start
        self._state = _START
        self._buf = ""
        self.saw_reasoning = False  # a reasoning section was opened (by tag or by the prompt)
        self.reasoning_ended = False  # `</think>` has been seen

    @property
    def in_reasoning(self) -> bool:
        """True while the reply is (or, before the first character, will be) inside the reasoning."""
        if self._state == _START:
            return self.starts_in_reasoning
        return self._state in (_REASONING_BEGIN, _REASONING)

    def feed(self, delta: str) -> tuple[str, str]:
        """Consume a text delta; return the reasoning and content text that became certain."""
        self._buf += delta
        return self._process(final=False)

    def flush(self) -> tuple[str, str]:
        """End of the reply: release everything held back."""
        return self._process(final=True)

    def _process(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf = self._buf
            if self._state == _START:
                rest = buf.lstrip()
                if rest.startswith(self.start_tag):
                    self._buf = rest[len(self.start_tag) :]
                    self._enter_reasoning()
                elif not final and self.start_tag.startswith(rest):  # "" or a partial "<thi"
                    break
                elif self.starts_in_reasoning:
                    self._enter_reasoning()
                else:
                    self._state = _CONTENT
            elif self._state == _REASONING_BEGIN:
                if not buf:
                    if final:
                        self._state = _REASONING
                        continue
                    break
                if buf[0] == "\n":
                    self._buf = buf[1:]
                self._state = _REASONING
            elif self._state == _REASONING:
                idx = buf.find(self.end_tag)
                call = buf.find(self.tool_call_tag) if self.tool_call_tag else -1
                if call >= 0 and (idx < 0 or call < idx):  # a tool call before any `</think>`
                    reasoning.append(buf[:call].rstrip("\n"))
                    self._buf = buf[call:]
                    self._state = _CONTENT
                    self.reasoning_ended = True
                    continue
                if idx >= 0:
                    text = buf[:idx]
                    reasoning.append(text[:-1] if text.endswith("\n") else text)
                    self._buf = buf[idx + len(self.end_tag) :]
                    self._state = _CONTENT_BEGIN
                    self.reasoning_ended = True
                    continue
                if final:
                    reasoning.append(buf)
                    self._buf = ""
                    break
                hold = _partial_suffix(buf, self.end_tag)
                if self.tool_call_tag:  # the "\n"s before a tool call are dropped: hold them all
                    hold = max(hold, _partial_suffix(buf, self.tool_call_tag))
                    while hold < len(buf) and buf[len(buf) - hold - 1] == "\n":
                        hold += 1
                elif buf[: len(buf) - hold].endswith("\n"):  # the one before `</think>` is dropped
                    hold += 1
                reasoning.append(buf[: len(buf) - hold])
                self._buf = buf[len(buf) - hold :]
                break
            elif self._state == _CONTENT_BEGIN:
                self._buf = buf.lstrip("\n")
                if not self._buf:
                    break
                self._state = _CONTENT
            else:
                content.append(buf)
                self._buf = ""
                break
        return "".join(reasoning), "".join(content)

    def _enter_reasoning(self) -> None:
        self._state = _REASONING_BEGIN
        self.saw_reasoning = True


class ReasoningParser:
    """Qwen3 `<think>` reasoning parser; `extract` for whole replies, `stream()` for deltas."""

    name: ClassVar[str] = "qwen3"
    start_tag: ClassVar[str] = THINK_START
    end_tag: ClassVar[str] = THINK_END

    tool_call_tag: ClassVar[str] = "<tool_call>"

    def __init__(self, starts_in_reasoning: bool = False, ends_at_tool_call: bool = False) -> None:
        """`ends_at_tool_call` (a request with tools): a `<tool_call>` inside a reasoning that was never
        closed ends the reasoning there and starts the content, so that the tool parser sees the call
        (Qwen3.5 thinking models may call a tool without closing `<think>`)."""
        self.starts_in_reasoning = starts_in_reasoning
        self.ends_at_tool_call = ends_at_tool_call

    def stream(self) -> StreamingReasoning:
        """A fresh streaming splitter for one reply."""
        return StreamingReasoning(self.starts_in_reasoning, self.start_tag, self.end_tag,
                                  self.tool_call_tag if self.ends_at_tool_call else None)

    def extract(self, text: str) -> tuple[str | None, str]:
        """Split a whole reply into `(reasoning or None, content)`."""
        s = self.stream()
        r1, c1 = s.feed(text)
        r2, c2 = s.flush()
        return (r1 + r2 if s.saw_reasoning else None), c1 + c2


class Qwen35ReasoningParser(ReasoningParser):
    """Qwen3.5: the same `<think>` rules. Its 4B/9B templates think by default, ending the prompt inside
    an open `<think>` (`starts_in_reasoning`, from `prompt_ends_in_reasoning`), and it may open a
    `<tool_call>` without closing the reasoning (`ends_at_tool_call`, for requests with tools)."""

    name: ClassVar[str] = "qwen3_5"


_REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": ReasoningParser,
    "qwen3_5": Qwen35ReasoningParser,
}


def reasoning_parser_names() -> list[str]:
    """Names accepted by `get_reasoning_parser`."""
    return sorted(_REASONING_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The reasoning parser class registered as `name`; ValueError naming unknown names."""
    try:
        return _REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning_parser {name!r}; known: {', '.join(reasoning_parser_names())}"
        ) from None
