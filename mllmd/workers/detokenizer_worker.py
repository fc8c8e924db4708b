"""Detokenizer worker: engine outputs -> text deltas (incremental), stop strings, logprob tokens."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from mllmd.messages import (
    DetokenizerInbox,
    PromptMeta,
    RegisterRequest,
    RequestFailed,
    ResetRequests,
    TextOutput,
    TextOutputs,
    TokenLogprob,
    TokenOutput,
    TokenOutputs,
    TopLogprob,
    decoder,
    request_id_of,
)
from mllmd.workers import ipc
from mllmd.workers.base import WorkerContext, worker_main

logger = logging.getLogger("detokenizer")


class Detokenizer:
    """Per-request detokenization state; turns TokenOutputs into the TextOutputs main streams out."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, Any] = {}
        self.meta: dict[str, PromptMeta] = {}
        self.prompts: dict[str, list[int]] = {}  # a request's prompt ids until its first output
        self.failed: list[RequestFailed] = []  # requests that could not be detokenized (sent to main)

    def register(self, msg: RegisterRequest) -> None:
        from mllmd.detokenizer import DetokenizerState

        self.states[msg.rid] = DetokenizerState(
            self.tokenizer, stop=msg.stop, skip_special_tokens=msg.skip_special_tokens, prompt_ids=msg.prompt_ids
        )
        self.meta[msg.rid] = msg.meta
        self.prompts[msg.rid] = msg.prompt_ids  # until the first output (prompt logprobs name its tokens)

    def reset(self) -> int:
        """Drop every request's state (a new scheduler started: whatever it ran before is gone, and
        its requests were failed by main); returns how many were dropped."""
        dropped = len(self.states)
        self.states.clear()
        self.meta.clear()
        self.prompts.clear()
        return dropped

    def _logprob_entries(self, out: TokenOutput) -> list[TokenLogprob] | None:
        from mllmd.detokenizer import token_bytes, token_text

        if out.new_logprobs is None:
            return None
        tok = self.tokenizer
        return [
            TokenLogprob(
                tid, token_text(tok, tid), token_bytes(tok, tid), lp,
                [TopLogprob(t, token_text(tok, t), token_bytes(tok, t), v) for t, v in top],
            )
            for tid, lp, top in zip(out.new_token_ids, out.new_logprobs, out.new_top_logprobs or [])
        ]  # fmt: skip

    def _prompt_entries(self, out: TokenOutput, prompt_ids: list[int]) -> list[TokenLogprob] | None:
        """Every prompt token with its logprob (the first has none) and top alternatives."""
        from mllmd.detokenizer import token_bytes, token_text

        if out.prompt_logprobs is None:
            return None
        tok = self.tokenizer
        lps: list[float | None] = [None, *out.prompt_logprobs]
        tops = [[], *(out.prompt_top_logprobs or [[] for _ in out.prompt_logprobs])]
        return [
            TokenLogprob(tid, token_text(tok, tid), token_bytes(tok, tid), lp,
                         [TopLogprob(t, token_text(tok, t), token_bytes(tok, t), v) for t, v in top])
            for tid, lp, top in zip(prompt_ids, lps, tops)
        ]

    def process(self, out: TokenOutput) -> TextOutput | None:
        state = self.states.get(out.rid)
        if state is None:
            return None
        d = state.add(out.new_token_ids)
        text, finished, reason = d.text_delta, out.finished, out.finish_reason
        stop_str = None
        if d.stopped:
            finished, reason, stop_str = True, "stop", d.matched_stop
        elif finished:
            text += state.flush().text_delta
        item = TextOutput(
            rid=out.rid,
            text=text,
            token_ids=out.new_token_ids,
            finished=finished,
            finish_reason=reason,
            matched_stop=stop_str if stop_str is not None else out.matched_stop,
            matched_stop_str=stop_str,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            logprobs=self._logprob_entries(out),
            meta=self.meta.get(out.rid, PromptMeta()),
            prompt_logprobs=self._prompt_entries(out, self.prompts.pop(out.rid, [])),
            first_times=None if out.first_times is None else msgspec.structs.replace(
                out.first_times, detokenized=time.perf_counter()),
        )
        self.prompts.pop(out.rid, None)
        if finished:
            self.states.pop(out.rid, None)
            self.meta.pop(out.rid, None)
        return item


def run(wctx: WorkerContext) -> None:
    from transformers import AutoTokenizer

    detok = Detokenizer(AutoTokenizer.from_pretrained(wctx.settings["tokenizer_path"]))
    inbox = ipc.pull(wctx.ctx, wctx.ipc_dir, ipc.DETOKENIZER)
    decode = decoder(DetokenizerInbox).decode
    wctx.count_requests = lambda: len(detok.states)
    wctx.ready()
    while not wctx.stopping:
        if not inbox.poll(100):
            continue
        data = inbox.recv()
        try:
            msg = decode(data)
        except Exception as e:  # the scheduler's bug: skip the message, fail its request if named
            logger.error("cannot decode a message: %s", e)
            rid = request_id_of(data)
            if rid is not None:
                detok.failed.append(RequestFailed(rid, "internal", "the request's output could not be read"))
            msg = None
        items = handle(detok, msg) if msg is not None else []
        if items:
            wctx.send_main(TextOutputs(items))
        while detok.failed:
            wctx.send_main(detok.failed.pop(0))


def handle(detok: Detokenizer, msg: RegisterRequest | TokenOutputs | ResetRequests) -> list[TextOutput]:
    """Apply one message from the scheduler; returns the items to stream out (outputs only)."""
    logger.debug("%s", type(msg).__name__)
    if isinstance(msg, RegisterRequest):
        detok.register(msg)
    elif isinstance(msg, TokenOutputs):
        return [i for i in (_process(detok, o) for o in msg.outputs) if i is not None]
    else:
        dropped = detok.reset()
        if dropped:
            logger.warning("scheduler restarted: dropped the state of %d unfinished requests", dropped)
    return []


def _process(detok: Detokenizer, out: TokenOutput) -> TextOutput | None:
    """One request's output; a failure ends that request alone (its state is dropped, main is told)."""
    try:
        return detok.process(out)
    except Exception as e:
        logger.exception("detokenizing %s failed", out.rid)
        detok.states.pop(out.rid, None)
        detok.meta.pop(out.rid, None)
        detok.failed.append(RequestFailed(out.rid, "internal", f"detokenization failed: {type(e).__name__}"))
        return None


if __name__ == "__main__":
    worker_main(ipc.DETOKENIZER, run)
