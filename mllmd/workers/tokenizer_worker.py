"""Tokenizer worker: chat template and tokenization, then hand the token ids to the scheduler.

The chat template is the model's own, or the administrator's `model.chat_template` file; a request
only sets template variables (chat_template_kwargs, checked by the main process). A tokenizer that
loads empty (a model folder without tokenizer files, for which transformers builds an empty one)
fails the load instead of every request.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from mllmd.messages import (
    ChatPrompt,
    GenerateRequest,
    PromptMeta,
    RequestFailed,
    TextPrompt,
    TokenizeRequest,
    TokenizerInbox,
    decoder,
    encode,
    request_id_of,
)
from mllmd.sampling_params import InvalidSamplingParam, choice_params, fit_max_tokens
from mllmd.workers import ipc
from mllmd.workers.base import WorkerContext, worker_main

logger = logging.getLogger("tokenizer")


def tokenize(tokenizer: Any, req: TokenizeRequest, chat_template: str | None = None) -> tuple[list[int], PromptMeta]:
    """Token ids for a chat / completion / token-id prompt, plus facts the detokenizer needs.
    `chat_template`: the administrator's template (None: the model's)."""
    prompt = req.prompt
    if isinstance(prompt, ChatPrompt):
        kwargs = dict(prompt.chat_template_kwargs)
        kwargs.pop("chat_template", None)  # never the client's (main refuses it; this is the last line)
        if prompt.tools:
            kwargs["tools"] = prompt.tools
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        text = tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True, **kwargs)
        meta = PromptMeta(starts_in_reasoning=text.rstrip().endswith("<think>"))
        return tokenizer.encode(text, add_special_tokens=False), meta
    if isinstance(prompt, TextPrompt):
        return tokenizer.encode(prompt.text, add_special_tokens=False), PromptMeta()
    return list(prompt.ids), PromptMeta()


def generate_requests(req: TokenizeRequest, ids: list[int], meta: PromptMeta, context_length: int) -> list[GenerateRequest]:
    """One GenerateRequest per choice, with max_tokens fitted to the prompt (InvalidSamplingParam if it cannot)."""
    b = req.budget
    max_tokens = fit_max_tokens(b.requested, b.default, len(ids), context_length, req.prompt_param)
    params = dataclasses.replace(req.params, max_tokens=max_tokens)
    return [GenerateRequest(rid, ids, p, meta, req.t_submit) for rid, p in zip(req.rids, choice_params(params, len(req.rids)))]


def check_tokenizer(tokenizer: Any, path: str) -> None:
    """Refuse a tokenizer that cannot tokenize (transformers builds an empty one from a folder without
    tokenizer files)."""
    if len(tokenizer) == 0 or not tokenizer.encode("hello", add_special_tokens=False):
        raise RuntimeError(f"the tokenizer in {path} is empty: the folder has no usable tokenizer files "
                           "(tokenizer.json, or vocab.json and merges.txt)")


def run(wctx: WorkerContext) -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = wctx.settings["tokenizer_path"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    check_tokenizer(tokenizer, path)
    chat_template = None
    if wctx.settings.get("chat_template"):
        with open(wctx.settings["chat_template"], encoding="utf-8") as f:
            chat_template = f.read()
    context_length = wctx.settings["engine"].get("context_length") or int(
        AutoConfig.from_pretrained(wctx.settings["engine"]["model_path"]).max_position_embeddings
    )
    inbox = ipc.pull(wctx.ctx, wctx.ipc_dir, ipc.TOKENIZER)
    to_sched = ipc.push(wctx.ctx, wctx.ipc_dir, ipc.SCHEDULER)
    decode = decoder(TokenizerInbox).decode
    wctx.ready(context_length=context_length)
    while not wctx.stopping:
        if not inbox.poll(100):
            continue
        data = inbox.recv()
        try:
            req: TokenizeRequest = decode(data)
        except Exception as e:  # main's bug, not a reason to drop every request: fail this one
            logger.error("cannot decode a request: %s", e)
            group = request_id_of(data)
            if group is not None:
                wctx.send_main(RequestFailed(group, "internal", "the request could not be read by the tokenizer"))
            continue
        logger.debug("request %s (%s)", req.group, type(req.prompt).__name__)
        try:
            ids, meta = tokenize(tokenizer, req, chat_template)
            out = generate_requests(req, ids, meta, context_length)
        except InvalidSamplingParam as e:
            wctx.send_main(RequestFailed(req.group, "invalid_request", str(e), e.param))
            continue
        except Exception as e:  # a template or tokenizer error is the request's fault
            wctx.send_main(RequestFailed(req.group, "invalid_request", f"could not build the prompt: {e}"))
            continue
        for gen in out:
            to_sched.send(encode(gen))


if __name__ == "__main__":
    worker_main(ipc.TOKENIZER, run)
