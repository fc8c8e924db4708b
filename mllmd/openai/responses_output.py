"""The Responses API's output: the response object, its output items and the events of its stream.

Both a stream and a whole response are built by one `ResponseAssembler`, from the chat deltas that
the chat stream sends (`serving.ChatSplitter`: the chat path's reasoning and tool-call parsers), so
that they cannot differ. Items come in the reply's order, one open at a time: a `reasoning` item (the
thinking, as a `reasoning_text` content part; no summary), a `message` (one `output_text` part) and a
`function_call` per tool call. A stream is, as OpenAI sends it: `response.created`,
`response.in_progress`; per item `response.output_item.added`, its content part's `.added`, its deltas
(`response.reasoning_text.delta`, `response.output_text.delta`, `response.function_call_arguments.delta`)
and `.done` events, `response.output_item.done`; then `response.completed`, or `response.incomplete`
(`incomplete_details.reason` "max_output_tokens") for a reply cut by max_output_tokens, or
`response.failed` for a request that failed after its first event. Each event names its type in an
SSE `event:` line too, and carries a `sequence_number`; there is no `[DONE]`.

Usage counts as reasoning the tokens that arrived while the reasoning parser was inside the thinking
(`</think>` included). `input_tokens_details.cache_write_tokens`, which the SDK requires, is 0: the
prefix cache has no separate write count.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from mllmd.messages import RequestFailed, TextOutput, TokenLogprob
from mllmd.openai import responses as R
from mllmd.openai.responses_api import ResponsesRequest
from mllmd.openai.serving import (
    ChatOptions,
    ChatSplitter,
    Choice,
    accumulate,
    merged,
    openai_item,
    raise_if_error,
    token_logprobs,
)

FAILED_EVENT_PREFIX = b"event: response.failed\n"  # how the event that ends a failed stream begins


def new_id(prefix: str) -> str:
    """An id in OpenAI's form: `resp_`, `msg_`, `rs_` or `fc_` and 48 hex digits."""
    return prefix + secrets.token_hex(24)


def sse_event(event: dict[str, Any]) -> bytes:
    """One server-sent event, its type in the `event:` line as OpenAI sends them."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def usage(prompt: int, output: int, cached: int, reasoning: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output}


def output_logprobs(entries: list[TokenLogprob], top_n: int) -> list[dict[str, Any]]:
    """`output_text.logprobs`: chat's logprob entries (token, logprob, bytes, top_logprobs)."""
    return list(R.chat_logprobs(token_logprobs(entries, top_n))["content"]) if entries else []


def event_logprobs(full: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same in text events, which carry no bytes."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in full]


def _new_item(kind: str) -> dict[str, Any]:
    """An output item as it is announced (`output_item.added`)."""
    if kind == "reasoning":
        return {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}


def _part(item: dict[str, Any], text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    """An item's one content part, holding `text`."""
    if item["type"] == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


class ResponseAssembler:
    """One response: chat results in (`feed`), Responses events out; `result` once the reply ended."""

    def __init__(self, req: ResponsesRequest, opts: ChatOptions) -> None:
        self.req, self.opts = req, opts
        self.id, self.created_at = new_id("resp_"), R.now()
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""  # the open item's text (reasoning or output_text)
        self.logprobs: list[dict[str, Any]] = []  # the open message's
        self.pending: list[TokenLogprob] = []  # logprobs of tokens whose text has not been sent yet
        self.held = ""  # whitespace that would open a message: held until text follows it
        self.choice = Choice()
        self.splitter: ChatSplitter | None = None
        self.reasoning_tokens = 0
        self.started = False
        self.result: dict[str, Any] | None = None

    # ---- the response object ----------------------------------------------------------------
    def response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        c = self.choice
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.opts.model, "output": list(self.items), "previous_response_id": None,
            **self.req.echo,
            "usage": usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens, self.reasoning_tokens)
            if status != "in_progress" else None,
        }  # fmt: skip
        if status == "completed":
            body["completed_at"] = R.now()
        return body

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> list[dict[str, Any]]:
        """`response.created` and `response.in_progress`."""
        self.started = True
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def feed(self, item: TextOutput) -> list[dict[str, Any]]:
        """The events of one result (the last one ends the response: `result` is set)."""
        counted = self.choice.completion_tokens
        accumulate(self.choice, item)
        if self.splitter is None:
            self.splitter = ChatSplitter(item.meta, self.req.chat, self.opts)
        before = self._thinking()
        deltas = self.splitter.feed(item.text, item.finished)
        if before or self._thinking():  # the tokens that opened, filled or closed the reasoning
            self.reasoning_tokens += self.choice.completion_tokens - counted
        if self.req.chat.logprobs:
            self.pending += item.logprobs or []
        events = [ev for d in deltas for ev in self._delta(d)]
        return events + self._finish() if item.finished else events

    def _thinking(self) -> bool:
        """Inside the reasoning: opened (by the reply's `<think>`, or by the prompt) and not closed yet."""
        r = self.splitter.reasoner if self.splitter is not None else None
        return r is not None and not r.reasoning_ended and (r.in_reasoning or r.saw_reasoning)

    def _finish(self) -> list[dict[str, Any]]:
        status = "incomplete" if self.choice.finish_reason == "length" else "completed"
        events: list[dict[str, Any]] = []
        self.pending = []  # tokens that never became text (the end of turn)
        calls = self.splitter is not None and self.splitter.has_calls
        if (self.held and not calls) or not self.items:  # a reply of whitespace, or of nothing
            events += self._text("", force=True)
        events += self._close(status)
        self.result = self.response(status)
        return events + [self._event(f"response.{status}", response=self.result)]

    def fail(self, failure: RequestFailed) -> list[dict[str, Any]]:
        """The events that end a stream whose request failed: `response.failed`, after `response.created`
        if it was not sent yet."""
        events = [] if self.started else self.start()
        events += self._close("incomplete")
        error = {"code": "invalid_prompt" if failure.code == "invalid_request" else "server_error",
                 "message": failure.message}
        param = self.req.params.name(failure.param)
        if param is not None:
            error["param"] = param
        return events + [self._event("response.failed", response=self.response("failed", error))]

    def failure_event(self, failure: RequestFailed) -> bytes:
        """`fail` as SSE bytes (http_app calls this for a failure it meets outside the event stream)."""
        return b"".join(sse_event(ev) for ev in self.fail(failure))

    # ---- items ------------------------------------------------------------------------------
    def _delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta."""
        if "reasoning_content" in delta:
            self.pending = []  # thinking tokens: not output_text's
            return self._reasoning(delta["reasoning_content"])
        if "content" in delta:
            return self._text(delta["content"])
        self.pending = []
        return [ev for call in delta["tool_calls"] for ev in self._call(call)]

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """Close the open item and announce `item` (with its content part, where it has one)."""
        events = self._close("completed")
        self.open, self.text, self.logprobs = item, "", []
        self.items.append(item)
        events.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        if item["type"] != "function_call":
            events.append(self._event("response.content_part.added", **self._where(), part=_part(item, "", [])))
        return events

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        out: dict[str, Any] = {"item_id": self.open["id"], "output_index": len(self.items) - 1}
        if self.open["type"] != "function_call":
            out["content_index"] = 0
        return out

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = [] if self.open is not None and self.open["type"] == "reasoning" else self._open(_new_item("reasoning"))
        self.text += text
        return events + [self._event("response.reasoning_text.delta", **self._where(), delta=text)]

    def _text(self, text: str, force: bool = False) -> list[dict[str, Any]]:
        """Answer text: a message opens at its first non-whitespace (or at the end, `force`)."""
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != "message":
            if not text.strip() and not force:
                self.held += text
                return []
            text, self.held = self.held + text, ""
            events = self._open(_new_item("message"))
        lp = output_logprobs(self.pending, self.req.chat.top_logprobs)
        self.pending = []
        self.text += text
        self.logprobs += lp
        if text or lp:
            events.append(self._event("response.output_text.delta", **self._where(), delta=text,
                                      logprobs=event_logprobs(lp)))
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool call's header opens a function_call item; its arguments are that item's delta."""
        events: list[dict[str, Any]] = []
        if "id" in call:
            events = self._open({"id": new_id("fc_"), "type": "function_call", "call_id": call["id"],
                                 "name": call["function"]["name"], "arguments": "", "status": "in_progress"})
        args = call["function"].get("arguments", "")
        if args:
            assert self.open is not None
            self.open["arguments"] += args
            events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=args))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        """End the open item (if any) with `status`: its `.done` events."""
        item = self.open
        if item is None:
            return []
        where = self._where()
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])]
        else:
            part = _part(item, self.text, self.logprobs)
            item["content"] = [part]
            done = ("response.reasoning_text.done", {"text": self.text}) if item["type"] == "reasoning" else (
                "response.output_text.done", {"text": self.text, "logprobs": event_logprobs(self.logprobs)})
            events = [self._event(done[0], **where, **done[1]),
                      self._event("response.content_part.done", **where, part=part)]
        item["status"] = status
        self.open = None
        return events + [self._event("response.output_item.done", output_index=where["output_index"], item=item)]


async def response_stream(states: list[Any], asm: ResponseAssembler) -> AsyncIterator[bytes]:
    """The SSE events of a response (its one choice)."""
    for ev in asm.start():
        yield sse_event(ev)
    async for _, item in merged(states):
        item = openai_item(item)
        if isinstance(item, RequestFailed):
            for ev in asm.fail(item):  # one event a chunk: the access log sees the failed one begin a chunk
                yield sse_event(ev)
            return
        for ev in asm.feed(item):
            yield sse_event(ev)


async def response_full(states: list[Any], asm: ResponseAssembler) -> dict[str, Any]:
    """The whole response object (an error before the end is an APIError, as on chat)."""
    async for _, item in merged(states):
        asm.feed(raise_if_error(openai_item(item)))
    assert asm.result is not None
    return asm.result
