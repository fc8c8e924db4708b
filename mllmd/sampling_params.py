"""Per-request sampling parameters (plain Python: imported by the daemon's main process too)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20

# What an OutputConstraint may ask for (mllmd/structured builds the grammar of each).
CONSTRAINT_KINDS = ("json_object", "json_schema", "tool_calls")
TOOL_CALL_FORMATS = ("hermes", "qwen3_xml")


@dataclass
class ToolSchema:
    """One function a constrained reply may call: its name and its parameters' JSON schema (text)."""

    name: str
    parameters: str = '{"type": "object"}'


@dataclass
class OutputConstraint:
    """Structured output: the reply (after any reasoning block) must match a grammar.

    kind json_object: any JSON object; json_schema: `schema` (JSON text), `strict` refusing
    properties the schema does not name; tool_calls: one call of one of `tools` (several, one per
    line, with `parallel`), written in the model's `tool_format`. `starts_after_token`: the grammar
    applies only after this token (the `</think>` of a prompt that opens a reasoning block)."""

    kind: str
    schema: str | None = None
    strict: bool = True
    tools: list[ToolSchema] = field(default_factory=list)
    tool_format: str = "hermes"
    parallel: bool = False
    starts_after_token: int | None = None

    def cache_key(self) -> str:
        """What the compiled grammar depends on (not where it starts)."""
        tools = [(t.name, t.parameters) for t in self.tools]
        return repr((self.kind, self.schema, self.strict, tools, self.tool_format, self.parallel))


class InvalidSamplingParam(ValueError):
    """A sampling parameter out of range; `param` is its name."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 means greedy decoding. top_k <= 0 disables top-k. seed None lets the engine draw
    one; a given seed reproduces the same output for the same prompt whatever else is batched.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    # the logprob of every prompt token after the first (with top_logprobs alternatives): completions'
    # echo with logprobs; the prompt is computed in full (no prefix-cache hit)
    prompt_logprobs: bool = False
    constraint: OutputConstraint | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidSamplingParam (a ValueError) naming the first invalid field."""

        def bad(name: str, why: str) -> None:
            raise InvalidSamplingParam(f"{name}: {why} (got {getattr(self, name)!r})", name)

        def finite(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, "must be a finite number")
            return float(v)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if finite("temperature") < 0:
            bad("temperature", "must be >= 0")
        if not 0.0 < finite("top_p") <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            bad("top_k", "must be an integer (<= 0 disables it)")
        if not 0.0 <= finite("min_p") <= 1.0:
            bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= finite(name) <= 2.0:
                bad(name, "must be in [-2, 2]")
        if finite("repetition_penalty") <= 0:
            bad("repetition_penalty", "must be > 0")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", "must be an integer")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int):
            bad("top_logprobs", "must be an integer")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad("stop", "must be non-empty strings")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad("stop_token_ids", "must be token ids in the vocabulary")
        c = self.constraint
        if c is not None:
            if c.kind not in CONSTRAINT_KINDS:
                raise InvalidSamplingParam(f"constraint: kind must be one of {', '.join(CONSTRAINT_KINDS)} "
                                           f"(got {c.kind!r})", "response_format")
            if c.kind == "json_schema" and not c.schema:
                raise InvalidSamplingParam("constraint: json_schema needs a schema", "response_format")
            if c.kind == "tool_calls" and (not c.tools or c.tool_format not in TOOL_CALL_FORMATS):
                raise InvalidSamplingParam("constraint: tool_calls needs tools and a known tool_format",
                                           "tool_choice")
        if self.logit_bias:
            for t, b in self.logit_bias.items():
                if t < 0 or (vocab_size is not None and t >= vocab_size):
                    bad("logit_bias", f"token id {t} is outside the vocabulary")
                if not math.isfinite(b) or not -100.0 <= b <= 100.0:
                    bad("logit_bias", f"bias for token {t} must be in [-100, 100]")


def fit_max_tokens(
    requested: int | None,
    default: int | None,
    prompt_tokens: int,
    context_length: int,
    prompt_param: str,
    budget_param: str = "max_tokens",
    kv_tokens: int | None = None,
) -> int:
    """The output-token limit of a request once its prompt length is known.

    `requested` (the client's max_tokens, sent as `budget_param`) is kept as given, and refused here,
    naming both numbers and that field, when prompt + requested is over the context or over the KV
    cache's `kv_tokens` (a small GPU may hold fewer tokens than the model's context). Unset, the limit
    is `default` capped at what both leave, or (default None) all of it. A prompt that leaves no room
    at all is refused, naming `prompt_param`.
    """
    limit, what, size = context_length, "the context length", f"the model's context length is {context_length}"
    if kv_tokens is not None and kv_tokens < context_length:
        limit, what, size = kv_tokens, "the KV cache", f"the KV cache holds {kv_tokens} tokens"
    room = limit - prompt_tokens
    if room < 1:
        raise InvalidSamplingParam(
            f"the prompt has {prompt_tokens} tokens but {size} "
            "(at least one token must be left for the completion)",
            prompt_param,
        )
    if requested is not None and requested > room:
        raise InvalidSamplingParam(
            f"prompt ({prompt_tokens} tokens) + {budget_param} ({requested}) = {prompt_tokens + requested} "
            f"tokens exceeds {what} of {limit}",
            budget_param,
        )
    return requested if requested is not None else output_limit(default, room)


def output_limit(default: int | None, room: int) -> int:
    """An unset max_tokens: `default` capped at the `room` the context leaves (None: all of it)."""
    return room if default is None else min(default, room)


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice of an n > 1 request: with a seed, choice i uses seed + i
    (distinct but reproducible choices)."""
    out = []
    for i in range(n):
        p = copy.copy(params)
        if p.seed is not None and i:
            p.seed = p.seed + i
        out.append(p)
    return out
