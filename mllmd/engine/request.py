"""A request's state inside the engine (its per-step output is mllmd.messages.TokenOutput)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from mllmd.sampling_params import SamplingParams

# Stands for a sampled token still on its way from the device (overlap scheduling): the model reads
# it from the runner's per-request token buffer instead. Never part of a request's reported output.
PLACEHOLDER = -1


class ReqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class EngineImage:
    """One image of a prompt: its pad tokens are prompt[start : start + num_tokens]. `pixels` (uint8
    [H, W, 3], host or device) are kept until the request finishes, so that its encoder output can be
    computed again if the encoder cache lost it (a preempted or chunked request)."""

    start: int
    num_tokens: int
    grid_thw: tuple[int, int, int]
    content_hash: bytes
    pixels: Any

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def key_id(self) -> int:
        """What the prefix cache sees at this image's token positions: an id from its content (negative,
        below PLACEHOLDER, so never a vocabulary id), so that only the same image matches."""
        return -2 - int.from_bytes(self.content_hash[:7], "big")


class AdmissionError(ValueError):
    """The request can never be served (too long, bad parameters); maps to HTTP 400, naming the
    request field at fault (`param`) where there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(eq=False)
class Req:
    """One generation request. token_ids = prompt + output; KV exists for token_ids[:kv_len]."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    req_pool_idx: int | None = None
    kv_len: int = 0
    prefix_len: int = 0  # leading KV slots owned by the prefix cache (locked through last_node)
    last_node: Any = None
    cached_tokens: int = -1  # prompt tokens served from the prefix cache at first admission
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_preemptions: int = 0
    first_token_time: float | None = None
    images: list[EngineImage] = field(default_factory=list)
    # M-RoPE (Qwen3-VL): the prompt's 3-axis positions [3, P] when it has images; token n >= P sits
    # at n + mrope_delta on every axis
    mrope_positions: Any = None
    mrope_delta: int = 0
    # hybrid models: the state-pool slot holding this request's recurrent state after its kv_len
    # tokens (the snapshots it takes while prefilling go to the prefix cache at once)
    state_slot: int | None = None
    # structured outputs: the grammar matcher (mllmd.structured.matcher.RequestGrammar) of a
    # constrained request, advanced by each token it takes
    grammar: Any = None
    # params.prompt_logprobs: the logprob of prompt token i + 1 (and its top alternatives) for each i
    # computed so far; `prompt_logprobs_sent` once they went out with the first output
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    _key_prompt: list[int] | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if self.images:
            key = list(self.prompt_ids)
            for image in self.images:
                key[image.start : image.end] = [image.key_id] * image.num_tokens
            self._key_prompt = key

    def cache_key(self, n: int) -> list[int]:
        """The prefix cache's key of token_ids[:n]: the tokens, with each image's pad tokens standing
        for that image's content."""
        if self._key_prompt is None:
            return self.token_ids[:n]
        p = len(self._key_prompt)
        return self._key_prompt[:n] if n <= p else self._key_prompt + self.token_ids[p:n]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED
