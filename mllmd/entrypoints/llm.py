"""Offline API: `LLM(model_path, **config).generate(prompts, sampling_params)` and `LLM.chat(...)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mllmd.config import EngineConfig
from mllmd.detokenizer import DetokenizerState
from mllmd.engine.engine import Engine
from mllmd.messages import TokenOutput
from mllmd.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class GenerationOutput:
    """The result of one request."""

    rid: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class LLM:
    """Runs the engine in this process. Config keys are EngineConfig fields (errors name bad ones)."""

    def __init__(self, model_path: str, **config: Any) -> None:
        from transformers import AutoTokenizer

        self.config = EngineConfig.from_kwargs(model_path, **config)
        self.engine = Engine(self.config)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer_path or self.config.model_path)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for each prompt (text or token ids); results in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompt_list) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(params)} sampling params")
        results: dict[str, GenerationOutput] = {}
        order: list[str] = []
        self._stops: dict[str, DetokenizerState] = {}
        for prompt, p in zip(prompt_list, params):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, ids, p)
            results[rid] = GenerationOutput(rid, ids, logprobs=[] if p.logprobs else None,
                                            top_logprobs=[] if p.logprobs else None)
            order.append(rid)
            if p.stop:  # stop strings: incremental text, matched across token boundaries
                self._stops[rid] = DetokenizerState(
                    self.tokenizer, stop=p.stop, skip_special_tokens=p.skip_special_tokens, prompt_ids=ids
                )
        by_rid = dict(zip(order, params))
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.rid in results:
                    self._apply(results[out.rid], out, by_rid[out.rid])
        for rid in order:
            res, p = results[rid], by_rid[rid]
            if not res.text:
                res.text = self.tokenizer.decode(res.token_ids, skip_special_tokens=p.skip_special_tokens)
        return [results[rid] for rid in order]

    def _apply(self, res: GenerationOutput, out: TokenOutput, p: SamplingParams) -> None:
        if res.finish_reason is not None:
            return  # already ended by a stop string
        res.token_ids += out.new_token_ids
        res.cached_tokens = out.cached_tokens
        if res.logprobs is not None and out.new_logprobs:
            res.logprobs += out.new_logprobs
            res.top_logprobs += out.new_top_logprobs or []  # type: ignore[operator]
        state = self._stops.get(res.rid)
        if state is not None:
            stopped = state.add(out.new_token_ids).stopped
            if not stopped and out.finished:
                stopped = state.flush().stopped
            if stopped:
                if not out.finished:
                    self.engine.abort(res.rid)
                res.text = state.text
                res.finish_reason = "stop"
                return
            if out.finished:
                res.text = state.text
        if out.finished:
            res.finish_reason = out.finish_reason

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[GenerationOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
            )
            for conv in convs
        ]
        ids = [self.tokenizer.encode(p) for p in prompts]
        return self.generate(ids, sampling_params)
