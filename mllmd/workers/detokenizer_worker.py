"""Detokenizer worker: engine outputs -> text deltas (incremental), stop strings, logprob tokens."""

from __future__ import annotations

import logging
from typing import Any

from mllmd.workers import ipc
from mllmd.workers.base import WorkerContext, worker_main

logger = logging.getLogger("detokenizer")


class Detokenizer:
    """Per-request detokenization state; turns RequestOutputs into the items main streams out."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, Any] = {}
        self.params: dict[str, Any] = {}
        self.meta: dict[str, dict[str, Any]] = {}

    def register(self, msg: dict[str, Any]) -> None:
        from mllmd.detokenizer import DetokenizerState

        p = msg["params"]
        self.states[msg["rid"]] = DetokenizerState(
            self.tokenizer, stop=p.stop, skip_special_tokens=p.skip_special_tokens, prompt_ids=msg["input_ids"]
        )
        self.params[msg["rid"]] = p
        self.meta[msg["rid"]] = msg.get("meta") or {}

    def reset(self) -> int:
        """Drop every request's state (a new scheduler started: whatever it ran before is gone, and
        its requests were failed by main); returns how many were dropped."""
        dropped = len(self.states)
        self.states.clear()
        self.params.clear()
        self.meta.clear()
        return dropped

    def _logprob_entries(self, out: Any) -> list[dict[str, Any]] | None:
        from mllmd.detokenizer import token_bytes, token_text

        if out.new_logprobs is None:
            return None
        tok = self.tokenizer
        entries = []
        for tid, lp, top in zip(out.new_token_ids, out.new_logprobs, out.new_top_logprobs or []):
            entries.append(
                {
                    "token_id": tid,
                    "token": token_text(tok, tid),
                    "bytes": token_bytes(tok, tid),
                    "logprob": lp,
                    "top": [
                        {"token_id": t, "token": token_text(tok, t), "bytes": token_bytes(tok, t), "logprob": v}
                        for t, v in top
                    ],
                }
            )
        return entries

    def process(self, out: Any) -> dict[str, Any] | None:
        state = self.states.get(out.rid)
        if state is None:
            return None
        d = state.add(out.new_token_ids)
        text, finished, reason = d.text_delta, out.finished, out.finish_reason
        matched = out.matched_stop
        stop_str = None
        if d.stopped:
            finished, reason, stop_str = True, "stop", d.matched_stop
        elif finished:
            text += state.flush().text_delta
        item = {
            "rid": out.rid,
            "text": text,
            "token_ids": out.new_token_ids,
            "finished": finished,
            "finish_reason": reason,
            "matched_stop": stop_str if stop_str is not None else matched,
            "matched_stop_str": stop_str,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
            "logprobs": self._logprob_entries(out),
            "meta": self.meta.get(out.rid, {}),
        }
        if finished:
            self.states.pop(out.rid, None)
            self.params.pop(out.rid, None)
            self.meta.pop(out.rid, None)
        return item


def run(wctx: WorkerContext) -> None:
    from transformers import AutoTokenizer

    detok = Detokenizer(AutoTokenizer.from_pretrained(wctx.settings["tokenizer_path"]))
    inbox = ipc.pull(wctx.ctx, wctx.ipc_dir, ipc.DETOKENIZER)
    wctx.ready()
    while not wctx.stopping:
        if not inbox.poll(100):
            continue
        items = handle(detok, inbox.recv_pyobj())
        if items:
            wctx.send_main({"type": "outputs", "items": items})


def handle(detok: Detokenizer, msg: dict[str, Any]) -> list[dict[str, Any]]:
    """Apply one message from the scheduler; returns the items to stream out (outputs only)."""
    kind = msg["type"]
    logger.debug("%s", kind)
    if kind == "register":
        detok.register(msg)
    elif kind == "outputs":
        return [i for i in (detok.process(o) for o in msg["outputs"]) if i is not None]
    elif kind == "reset":
        dropped = detok.reset()
        if dropped:
            logger.warning("scheduler restarted: dropped the state of %d unfinished requests", dropped)
    return []


if __name__ == "__main__":
    worker_main(ipc.DETOKENIZER, run)
