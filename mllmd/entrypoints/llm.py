"""Offline API: `LLM(model_path, **config).generate(prompts, sampling_params)` and `LLM.chat(...)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mllmd.config import EngineConfig
from mllmd.detokenizer import DetokenizerState
from mllmd.engine.engine import Engine
from mllmd.engine.request import EngineImage
from mllmd.messages import TokenOutput
from mllmd.multimodal.chat import build_vision_prompt, image_parts
from mllmd.multimodal.image_io import ImageLimits
from mllmd.multimodal.prompt import VisionTokenIds
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
        # images for chat(): local paths anywhere (the caller is this program), no remote URLs
        self.image_limits = ImageLimits(media_dirs=("/",))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        images: Sequence[list[EngineImage] | None] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for each prompt (text or token ids); results in input order. `images[i]`: prompt i's
        images over its runs of image tokens (see `chat`, which builds them)."""
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
        per_prompt = list(images) if images is not None else [None] * len(prompt_list)
        for prompt, p, imgs in zip(prompt_list, params, per_prompt, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, ids, p, imgs)
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
        """Apply the model's chat template to one conversation or a list of them, then generate. Image
        parts (`{"type": "image_url", "image_url": {"url": ...}}` with a data URL, a local path or a
        file:// URL, or `{"type": "image", "image": <PIL image>}`) go to a vision-language model."""
        convs: list[list[dict[str, Any]]] = [messages] if messages and isinstance(messages[0], dict) else messages  # type: ignore[list-item]
        built = [self.chat_prompt(conv, chat_template_kwargs) for conv in convs]
        return self.generate([ids for ids, _ in built], sampling_params, [images for _, images in built])

    def chat_prompt(
        self, conv: list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None = None
    ) -> tuple[list[int], list[EngineImage] | None]:
        """One conversation's prompt ids (chat template applied) and its images over their runs of image
        tokens (None without images): what `chat` generates from."""
        kwargs = chat_template_kwargs or {}
        if not image_parts(conv):
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, **kwargs)
            return self.tokenizer.encode(text), None
        vision = self.engine.runner.vision
        if vision is None:
            raise ValueError("the loaded model does not take images")
        prompt = build_vision_prompt(self.tokenizer, conv, kwargs, vision.preprocess,
                                     VisionTokenIds.from_config(self.engine.info.hf_config), self.image_limits)
        return prompt.input_ids, [EngineImage(s, e - s, im.grid_thw, im.content_hash, im.pixels)
                                  for im, (s, e) in zip(prompt.images, prompt.image_spans)]
