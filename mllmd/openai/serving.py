"""OpenAI chat/completions and native /generate: stream or collect a request's results.

Each choice's queue receives mllmd.messages.TextOutput items from the detokenizer (text deltas,
cumulative token counts, logprob entries, the prompt's meta), or one RequestFailed that ends it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from mllmd.messages import PromptMeta, RequestFailed, TextOutput, TokenLogprob
from mllmd.openai import responses as R
from mllmd.openai.errors import error_for_failure
from mllmd.openai.reasoning_parser import StreamingReasoning, get_reasoning_parser
from mllmd.openai.tool_parser import ContentDelta, StreamingToolCalls, get_tool_parser


@dataclass
class Choice:
    """What one choice has accumulated."""

    text: str = ""
    finish_reason: str | None = None
    matched_stop: Any = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # completions' echo with logprobs
    meta: PromptMeta = field(default_factory=PromptMeta)


Result = TextOutput | RequestFailed


ABORTED = "the request was aborted by the server's administrator"


def openai_item(item: Result) -> Result:
    """OpenAI has no finish_reason for an abort: on the OpenAI routes an admin abort (a final item with
    finish_reason "abort") ends the request as an error, like a lost worker (native /generate keeps
    SGLang's finish_reason {"type": "abort"})."""
    if isinstance(item, TextOutput) and item.finished and item.finish_reason == "abort":
        return RequestFailed(item.rid, "unavailable", ABORTED)
    return item


def raise_if_error(item: Result) -> TextOutput:
    """The item, or its failure as an APIError."""
    if isinstance(item, RequestFailed):
        raise error_for_failure(item)
    return item


ERROR_EVENT_PREFIX = b'data: {"error"'  # how every event of stream_error begins


def stream_error(item: RequestFailed) -> bytes:
    """The SSE event that ends a stream whose request failed after its first event: the body the same
    failure gets as an HTTP error (a refused request is an invalid_request_error naming its field)."""
    return R.sse(error_for_failure(item).to_dict())


def _ends(item: Result) -> bool:
    return isinstance(item, RequestFailed) or item.finished


async def merged(states: list[Any]) -> AsyncIterator[tuple[int, Result]]:
    """(choice index, item) from every state's queue, in arrival order, until all have finished."""
    if len(states) == 1:  # the common n=1: one queue, no per-item futures
        while True:
            item = await states[0].queue.get()
            yield 0, item
            if _ends(item):
                return
    pending = {asyncio.ensure_future(s.queue.get()): i for i, s in enumerate(states)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                item = fut.result()
                yield i, item
                if not _ends(item):
                    pending[asyncio.ensure_future(states[i].queue.get())] = i
    finally:
        for fut in pending:
            fut.cancel()


def accumulate(choice: Choice, item: TextOutput) -> None:
    choice.text += item.text
    choice.prompt_tokens = item.prompt_tokens
    choice.completion_tokens = item.completion_tokens
    choice.cached_tokens = item.cached_tokens
    choice.meta = item.meta
    if item.logprobs:
        choice.logprobs += item.logprobs
    if item.prompt_logprobs is not None:
        choice.prompt_logprobs = item.prompt_logprobs
    if item.finished:
        choice.finish_reason = item.finish_reason or "stop"
        choice.matched_stop = item.matched_stop


def usage_of(choices: list[Choice], per_prompt: int | None = None) -> dict[str, Any]:
    """Usage of a request's choices: `per_prompt` consecutive choices share a prompt (n of a batched
    completions request; default: all of them), counted once."""
    size = per_prompt or max(len(choices), 1)
    groups = [choices[i : i + size] for i in range(0, len(choices), size)]
    prompt = sum(max(c.prompt_tokens for c in g) for g in groups)
    cached = sum(max(c.cached_tokens for c in g) for g in groups)
    return R.usage(prompt, sum(c.completion_tokens for c in choices), cached)


def token_logprobs(entries: list[TokenLogprob], top_n: int) -> list[R.TokenLogprob]:
    return [
        R.TokenLogprob(
            token=e.token, logprob=e.logprob, raw=bytes(e.bytes),
            top_logprobs=[(t.token, t.logprob, bytes(t.bytes)) for t in e.top[:top_n]],
        )
        for e in entries
    ]


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _tool_finish(reason: str | None, has_calls: bool) -> str:
    """"tool_calls" for a reply with calls that ended by itself; a reply cut by max_tokens is "length"
    even with calls in it (its last call may be cut short, and its text holds the cut markup)."""
    return "tool_calls" if has_calls and reason != "length" else _finish(reason)


# ---- chat ------------------------------------------------------------------------------------
@dataclass
class ChatOptions:
    model: str
    reasoning_parser: str | None
    tool_call_parser: str | None


def _uses_tools(req: Any, opts: ChatOptions) -> bool:
    """The reply is parsed for tool calls: the model has a parser, and the request tools it may call."""
    return bool(opts.tool_call_parser and req.tools and req.tool_choice != "none")


class ChatSplitter:
    """One choice's streaming parsers: raw text deltas in, chat deltas out (reasoning_content, content,
    tool_calls), as chat streams send them; also what the Responses API translates its events from."""

    def __init__(self, meta: PromptMeta, req: Any, opts: ChatOptions) -> None:
        use_tools = _uses_tools(req, opts)
        self.reasoner: StreamingReasoning | None = None
        self.tools: StreamingToolCalls | None = None
        if opts.reasoning_parser:
            self.reasoner = get_reasoning_parser(opts.reasoning_parser)(
                starts_in_reasoning=meta.starts_in_reasoning, ends_at_tool_call=use_tools).stream()
        if use_tools:
            assert opts.tool_call_parser is not None
            self.tools = get_tool_parser(opts.tool_call_parser)(tools=req.tools).stream()

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The chat deltas of a text delta (`final`: the reply's last, which releases what was held)."""
        return _chat_deltas(text, final, self.reasoner, self.tools)

    @property
    def has_calls(self) -> bool:
        return self.tools is not None and bool(self.tools.tool_calls)


def _split_chat(text: str, meta: PromptMeta, req: Any, opts: ChatOptions) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    reasoning = None
    content: str | None = text
    if opts.reasoning_parser:
        tools = _uses_tools(req, opts)
        parser = get_reasoning_parser(opts.reasoning_parser)(starts_in_reasoning=meta.starts_in_reasoning,
                                                             ends_at_tool_call=tools)
        reasoning, content = parser.extract(text)
    calls: list[dict[str, Any]] = []
    if opts.tool_call_parser and req.tools and req.tool_choice != "none" and content:
        content, tool_calls = get_tool_parser(opts.tool_call_parser)(tools=req.tools).extract(content)
        calls = [c.to_openai() for c in tool_calls]
        if calls and not content.strip():
            content = None
    return reasoning, content, calls


async def chat_full(states: list[Any], req: Any, opts: ChatOptions) -> dict[str, Any]:
    choices = [Choice() for _ in states]
    async for i, item in merged(states):
        accumulate(choices[i], raise_if_error(openai_item(item)))
    out = []
    for i, c in enumerate(choices):
        reasoning, content, calls = _split_chat(c.text, c.meta, req, opts)
        reason = _tool_finish(c.finish_reason, bool(calls))
        lp = R.chat_logprobs(token_logprobs(c.logprobs, req.top_logprobs)) if req.logprobs else None
        out.append(R.chat_choice(i, R.chat_message(content, calls or None, reasoning), reason, lp))
    return R.chat_completion(R.chat_completion_id(), opts.model, R.now(), out, usage_of(choices))


async def chat_stream(states: list[Any], req: Any, opts: ChatOptions) -> AsyncIterator[bytes]:
    cid, created, inc = R.chat_completion_id(), R.now(), req.include_usage
    choices = [Choice() for _ in states]
    splitters: list[ChatSplitter | None] = [None] * len(states)
    # logprobs of tokens whose text has not been sent yet (held back by a parser or the detokenizer): they
    # go out with the next chunk of the choice, so that a chunk's text and its logprobs are the same tokens
    pending: list[list[TokenLogprob]] = [[] for _ in states]
    for i in range(len(states)):
        yield R.sse(R.chat_role_chunk(cid, opts.model, created, i, inc))
    try:
        async for i, item in merged(states):
            item = openai_item(item)
            if isinstance(item, RequestFailed):
                yield stream_error(item)
                return
            c = choices[i]
            splitter = splitters[i] = splitters[i] or ChatSplitter(item.meta, req, opts)
            accumulate(c, item)
            final = item.finished
            if req.logprobs and item.logprobs:
                pending[i] += item.logprobs
            for delta in splitter.feed(item.text, final):
                lp, pending[i] = _chat_logprobs_of(pending[i], req.top_logprobs), []
                yield R.sse(R.chat_chunk(cid, opts.model, created, [R.chat_chunk_choice(i, delta, None, lp)],
                                         include_usage=inc))
            if final:
                reason = _tool_finish(c.finish_reason, splitter.has_calls)
                lp, pending[i] = _chat_logprobs_of(pending[i], req.top_logprobs), []
                yield R.sse(R.chat_finish_chunk(cid, opts.model, created, i, reason, inc, lp))
        if inc:
            yield R.sse(R.chat_usage_chunk(cid, opts.model, created, usage_of(choices)))
        yield R.SSE_DONE
    except asyncio.CancelledError:
        raise


def _chat_logprobs_of(entries: list[TokenLogprob], top_n: int) -> dict[str, Any] | None:
    """`choices[].logprobs` for a chunk carrying these tokens' text; None when there are none."""
    return R.chat_logprobs(token_logprobs(entries, top_n)) if entries else None


def _chat_deltas(text: str, final: bool, reasoner: Any, tools: Any) -> list[dict[str, Any]]:
    """Turn a text delta into chat deltas (reasoning_content / content / tool_calls)."""
    deltas: list[dict[str, Any]] = []
    parts: list[tuple[str, str]] = []
    if reasoner is not None:
        r, c = reasoner.feed(text) if text else ("", "")
        if final:
            r2, c2 = reasoner.flush()
            r, c = r + r2, c + c2
        if r:
            parts.append(("reasoning", r))
        content = c
    else:
        content = text
    if tools is not None:
        events = tools.feed(content) if content else []
        if final:
            events += tools.flush()
        for ev in events:
            if isinstance(ev, ContentDelta):
                if ev.text:
                    parts.append(("content", ev.text))
            else:
                deltas.append(R.chat_delta(tool_calls=[ev.to_openai()]))
    elif content:
        parts.append(("content", content))
    out = [R.chat_delta(reasoning_content=v) if k == "reasoning" else R.chat_delta(v) for k, v in parts]
    return out + deltas


# ---- completions -----------------------------------------------------------------------------
async def completion_full(states: list[Any], req: Any, model: str, echo_texts: list[str]) -> dict[str, Any]:
    choices = [Choice() for _ in states]
    async for i, item in merged(states):
        accumulate(choices[i], raise_if_error(openai_item(item)))
    out = []
    for i, c in enumerate(choices):
        prefix = echo_texts[i] if req.echo else ""
        lp = None
        if req.logprobs:
            entries = (c.prompt_logprobs or []) + c.logprobs if req.echo else c.logprobs
            start = 0 if req.echo and c.prompt_logprobs else len(prefix)
            lp = R.completion_logprobs(token_logprobs(entries, req.top_logprobs), start)
        out.append(R.completion_choice(i, prefix + c.text, _finish(c.finish_reason), lp))
    return R.completion(R.completion_id(), model, R.now(), out, usage_of(choices, req.n))


async def completion_stream(states: list[Any], req: Any, model: str, echo_texts: list[str]) -> AsyncIterator[bytes]:
    cid, created, inc = R.completion_id(), R.now(), req.include_usage
    choices = [Choice() for _ in states]
    offsets = [len(t) if req.echo else 0 for t in echo_texts]  # text_offset of each choice's next token
    # with logprobs the echo waits for the choice's first output, which brings the prompt's logprobs
    echo_waits = req.echo and req.logprobs
    if req.echo and not echo_waits:
        for i, t in enumerate(echo_texts):
            yield R.sse(R.completion_chunk(cid, model, created, [R.completion_choice(i, t, None)], include_usage=inc))
    echoed = [not echo_waits] * len(states)
    async for i, item in merged(states):
        item = openai_item(item)
        if isinstance(item, RequestFailed):
            yield stream_error(item)
            return
        accumulate(choices[i], item)
        if not echoed[i]:
            echoed[i] = True
            plp = None
            if item.prompt_logprobs:
                plp = R.completion_logprobs(token_logprobs(item.prompt_logprobs, req.top_logprobs), 0)
            yield R.sse(R.completion_chunk(cid, model, created, [R.completion_choice(i, echo_texts[i], None, plp)],
                                           include_usage=inc))
        final = item.finished
        lp = None
        if req.logprobs and item.logprobs:
            lp = R.completion_logprobs(token_logprobs(item.logprobs, req.top_logprobs), offsets[i])
            offsets[i] += sum(len(t) for t in lp["tokens"])
        if item.text or lp or final:
            reason = _finish(choices[i].finish_reason) if final else None
            yield R.sse(R.completion_chunk(cid, model, created, [R.completion_choice(i, item.text, reason, lp)], include_usage=inc))
    if inc:
        yield R.sse(R.completion_chunk(cid, model, created, [], usage=usage_of(choices, req.n)))
    yield R.SSE_DONE


# ---- native /generate ------------------------------------------------------------------------
def _sglang_logprobs(entries: list[TokenLogprob]) -> list[list[Any]]:
    """SGLang's `[logprob, token id, token text]` triples."""
    return [[e.logprob, e.token_id, e.token] for e in entries]


def generate_result(c: Choice, state: Any, req: Any) -> dict[str, Any]:
    """SGLang's /generate result; `meta_info.id` is the client's `rid` where it gave one."""
    meta: dict[str, Any] = {
        "id": state.alias or state.rid,
        "finish_reason": {"type": _finish(c.finish_reason) if c.finish_reason != "abort" else "abort",
                          "matched": c.matched_stop},
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "cached_tokens": c.cached_tokens,
    }
    if req.logprobs:  # return_logprob: each output token's, and its top_logprobs_num alternatives
        meta["output_token_logprobs"] = _sglang_logprobs(c.logprobs)
        if req.top_logprobs:
            meta["output_top_logprobs"] = [
                [[t.logprob, t.token_id, t.token] for t in e.top[: req.top_logprobs]] for e in c.logprobs
            ]
    return {"text": c.text, "meta_info": meta}


async def generate_full(states: list[Any], req: Any) -> list[dict[str, Any]]:
    choices = [Choice() for _ in states]
    async for i, item in merged(states):
        accumulate(choices[i], raise_if_error(item))
    return [generate_result(c, s, req) for c, s in zip(choices, states)]


async def generate_stream(states: list[Any], req: Any) -> AsyncIterator[bytes]:
    """Each event holds a prompt's text and meta_info so far (SGLang's cumulative shape) and its
    `index` in the batch."""
    choices = [Choice() for _ in states]
    async for i, item in merged(states):
        if isinstance(item, RequestFailed):
            yield stream_error(item)
            return
        accumulate(choices[i], item)
        out = generate_result(choices[i], states[i], req)
        out["index"] = i
        yield f"data: {json.dumps(out, ensure_ascii=False)}\n\n".encode()
    yield R.SSE_DONE
