"""Tokenizer worker: chat template and tokenization, then hand the token ids to the scheduler."""

from __future__ import annotations

import copy
import logging
from typing import Any

from mllmd.workers import ipc
from mllmd.workers.base import WorkerContext, worker_main

logger = logging.getLogger("tokenizer")


def tokenize(tokenizer: Any, msg: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """Token ids for a chat / completion / token-id request, plus facts the detokenizer needs."""
    meta: dict[str, Any] = {}
    mode = msg["mode"]
    if mode == "chat":
        kwargs = dict(msg.get("chat_template_kwargs") or {})
        if msg.get("tools"):
            kwargs["tools"] = msg["tools"]
        text = tokenizer.apply_chat_template(msg["messages"], tokenize=False, add_generation_prompt=True, **kwargs)
        meta["starts_in_reasoning"] = text.rstrip().endswith("<think>")
        return tokenizer.encode(text, add_special_tokens=False), meta
    if mode == "text":
        return tokenizer.encode(msg["prompt"], add_special_tokens=False), meta
    return list(msg["input_ids"]), meta


def sampling_params_for(msg: dict[str, Any], n_prompt: int, context_length: int) -> list[Any]:
    """One SamplingParams per sub-request; unset max_tokens fills the context. APIError if invalid."""
    from mllmd.openai.errors import bad_request

    if n_prompt + 1 > context_length:
        raise bad_request(
            f"the prompt has {n_prompt} tokens but the model's context length is {context_length} "
            "(at least one token must be left for the completion)",
            "messages" if msg["mode"] == "chat" else "prompt",
        )
    params = msg["sampling"].sampling_params(context_length - n_prompt)
    out = []
    for i in range(len(msg["rids"])):
        p = copy.copy(params)
        if p.seed is not None and i:
            p.seed = p.seed + i  # n > 1 with a seed: distinct but reproducible choices
        out.append(p)
    return out


def run(wctx: WorkerContext) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from mllmd.openai.errors import APIError

    tokenizer = AutoTokenizer.from_pretrained(wctx.settings["tokenizer_path"])
    context_length = wctx.settings["engine"].get("context_length") or int(
        AutoConfig.from_pretrained(wctx.settings["engine"]["model_path"]).max_position_embeddings
    )
    inbox = ipc.pull(wctx.ctx, wctx.ipc_dir, ipc.TOKENIZER)
    to_sched = ipc.push(wctx.ctx, wctx.ipc_dir, ipc.SCHEDULER)
    wctx.ready(context_length=context_length)
    while not wctx.stopping:
        if not inbox.poll(100):
            continue
        msg = inbox.recv_pyobj()
        rid = msg["rid"]
        logger.debug("request %s (%s)", rid, msg["mode"])
        try:
            ids, meta = tokenize(tokenizer, msg)
            params_list = sampling_params_for(msg, len(ids), context_length)
        except APIError as e:
            wctx.send_main({"type": "error", "rid": rid, "status": e.status, "message": e.message, "param": e.param})
            continue
        except Exception as e:  # a template or tokenizer error is the request's fault
            wctx.send_main({"type": "error", "rid": rid, "status": 400, "message": f"could not build the prompt: {e}"})
            continue
        for sub_rid, params in zip(msg["rids"], params_list):
            to_sched.send_pyobj({"type": "generate", "rid": sub_rid, "input_ids": ids, "params": params, "meta": meta,
                                 "t_submit": msg.get("t_submit")})


if __name__ == "__main__":
    worker_main(ipc.TOKENIZER, run)
