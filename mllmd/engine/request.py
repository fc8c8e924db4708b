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

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED
