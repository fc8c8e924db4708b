"""Request parsing and validation for /v1/chat/completions, /v1/completions and native /generate.

Each parser takes the decoded JSON body (any value) and returns a dataclass, or raises APIError 400
whose ``param`` names the offending field (``messages[2].content[0].type``,
``sampling_params.top_p``). Unknown fields are ignored, since OpenAI clients send extras, except the
fields OpenAI defines that mllmd does not implement (``UNSUPPORTED_CHAT_FIELDS``,
``UNSUPPORTED_COMPLETION_FIELDS``): those are refused rather than silently dropped. The native
endpoint's ``sampling_params`` object is strict: an unknown key there is an error (a typo such as
``max_tokens`` for ``max_new_tokens`` would otherwise go unnoticed). Every field is bounded in size
(mllmd.openai.limits): what passes the parser can always be forwarded to the workers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mllmd.messages import ChatPrompt, OutputBudget
from mllmd.openai.errors import bad_request
from mllmd.openai.fields import MAX_INT, JsonFields, as_float, as_str, as_token_ids, show
from mllmd.openai.limits import (
    DEFAULT_LIMITS,
    MAX_CONTENT_PARTS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_TEMPLATE_KWARG_NAME,
    MAX_TEMPLATE_KWARGS,
    MAX_TOOL_CALLS,
    MAX_TOOL_NAME,
    MAX_TOOLS,
    RESERVED_TEMPLATE_KWARGS,
    Limits,
    check_count,
    check_free_json,
    check_schemas,
    decode_json,  # noqa: F401 (re-exported: the API's JSON rules, used by the admin routes too)
)
from mllmd.sampling_params import MAX_TOP_LOGPROBS, OutputConstraint, SamplingParams, ToolSchema, output_limit

MAX_N = 16  # choices per prompt
MAX_BATCH = 256  # prompts per request (completions, /generate); also caps len(prompts) * n
MAX_STOP = 64  # stop strings per request
MAX_STOP_TOKEN_IDS = 1024
MAX_RID_LEN = 256
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions `logprobs` (OpenAI's limit)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")
IMAGE_DETAILS = ("auto", "low", "high")

# OpenAI-defined fields mllmd does not implement: a non-null value is a 400 that names the field.
UNSUPPORTED_CHAT_FIELDS: dict[str, str] = {
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "functions": "the deprecated 'functions' field is not supported; use 'tools'",
    "function_call": "the deprecated 'function_call' field is not supported; use 'tool_choice'",
    "web_search_options": "web search is not supported",
}
# reasoning_effort -> the template's enable_thinking (Qwen3 thinks or not; it has no degrees of effort):
# none / minimal turn thinking off, low / medium / high leave the template's default alone
REASONING_EFFORTS: dict[str, bool | None] = {"none": False, "minimal": False, "low": None, "medium": None,
                                             "high": None}
UNSUPPORTED_COMPLETION_FIELDS: dict[str, str] = {
    "suffix": "(insertion after the completion) is not supported",
}
UNSUPPORTED_PART_TYPES = ("input_audio", "file", "refusal")
GENERATE_SAMPLING_KEYS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "seed", "logit_bias", "skip_special_tokens",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Sampling fields shared by every endpoint


def _read_stop(o: JsonFields, limits: Limits, key: str = "stop") -> list[str]:
    v, p = o.raw(key), o.param(key)
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise bad_request(f"'{p}' must be a string or an array of strings (got {show(v)})", p)
    if len(v) > MAX_STOP:
        raise bad_request(f"'{p}' may hold at most {MAX_STOP} strings (got {len(v)})", p)
    out = [as_str(s, p, allow_empty=False) for s in v]
    for s in out:
        if len(s) > limits.max_stop_length:
            raise bad_request(f"'{p}' holds a stop string of {len(s)} characters; the limit is "
                              f"{limits.max_stop_length} (server.max_stop_length)", p)
    return out


def _read_logit_bias(o: JsonFields, key: str = "logit_bias") -> dict[int, float] | None:
    v, p = o.raw(key), o.param(key)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_request(f"'{p}' must be an object mapping token ids to biases (got {show(v)})", p)
    check_count(v, p, MAX_LOGIT_BIAS, "entries")
    out: dict[int, float] = {}
    for k, b in v.items():
        if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10:
            token = int(k)
        elif isinstance(k, int) and not isinstance(k, bool):  # a Python caller's int keys
            token = k
        else:
            token = -1
        if not 0 <= token <= MAX_INT:
            raise bad_request(f"'{p}' keys must be token ids as decimal strings (got {show(k)})", p)
        out[token] = as_float(b, p, -100.0, 100.0)
    return out


def _read_sampling(o: JsonFields, limits: Limits, temperature_max: float = 2.0) -> dict[str, Any]:
    """The validated sampling fields common to all endpoints, as keyword arguments."""
    stop_token_ids = o.get_list("stop_token_ids") or []
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise o.err("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids")
    return {
        "temperature": o.get_float("temperature", 1.0, 0.0, temperature_max),
        "top_p": o.get_float("top_p", 1.0, 0.0, 1.0, lo_open=True),
        "top_k": o.get_int("top_k", -1, -1, MAX_INT),
        "min_p": o.get_float("min_p", 0.0, 0.0, 1.0),
        "presence_penalty": o.get_float("presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": o.get_float("frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": o.get_float("repetition_penalty", 1.0, 0.0, 1000.0, lo_open=True),
        "seed": o.get_int("seed", None, SEED_MIN, SEED_MAX),
        "stop": _read_stop(o, limits),
        "stop_token_ids": as_token_ids(stop_token_ids, o.param("stop_token_ids"), allow_empty=True),
        "ignore_eos": o.get_bool("ignore_eos", False),
        "logit_bias": _read_logit_bias(o),
        "skip_special_tokens": o.get_bool("skip_special_tokens", True),
    }


@dataclass(kw_only=True)
class _SamplingRequest:
    """Validated sampling fields; ``max_tokens`` None means the client did not set it."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    # SamplingParams field -> the name the client used, where it differs (for error params).
    param_names: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    # The limit of an unset max_tokens, capped at what the context leaves; None: all of it.
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = None

    def output_budget(self) -> OutputBudget:
        """The output-token budget the tokenizer resolves once it knows the prompt's length."""
        return OutputBudget(self.max_tokens, self.DEFAULT_MAX_TOKENS, self.param_names.get("max_tokens", "max_tokens"))

    def sampling_params(self, default_max_tokens: int | None = None) -> SamplingParams:
        """Map to SamplingParams; ``default_max_tokens`` (context - prompt length) applies when unset
        (without it, an unset max_tokens takes DEFAULT_MAX_TOKENS, else SamplingParams' default)."""
        max_tokens = self.max_tokens
        if max_tokens is None:
            if default_max_tokens is None:
                max_tokens = self.DEFAULT_MAX_TOKENS or SamplingParams.max_tokens
            else:
                max_tokens = output_limit(self.DEFAULT_MAX_TOKENS, default_max_tokens)
            if max_tokens < 1:
                p = self.param_names.get("max_tokens", "max_tokens")
                raise bad_request(
                    "The prompt fills the model's context: no room is left for the completion.", p
                )
        sp = SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            seed=self.seed,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            # completions' echo with logprobs: the echoed prompt tokens get theirs too
            prompt_logprobs=bool(getattr(self, "echo", False) and self.logprobs),
        )
        try:
            sp.validate()
        except ValueError as e:
            name, _, why = str(e).partition(":")
            p = self.param_names.get(name, name)
            raise bad_request(f"'{p}':{why}", p) from None
        return sp


# ---------------------------------------------------------------------------------------------
# /v1/chat/completions


@dataclass(kw_only=True)
class ChatRequest(_SamplingRequest):
    """A validated chat request. ``messages`` are plain dicts ready for the chat template: roles
    system/user/assistant/tool ("developer" becomes "system"); content a string, None (assistant with
    tool calls) or a list of text/image_url parts, as the client sent it (the tokenizer worker gives the
    template the shape it reads: mllmd.workers.chat_messages)."""

    model: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "none"
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # response_format beyond text: {"type": "json_object"} or {"type": "json_schema", "schema": text,
    # "strict": bool}
    response_format: dict[str, Any] | None = None

    def output_constraint(self, tool_format: str) -> OutputConstraint | None:
        """The grammar the reply must follow: a forced tool call (tool_choice "required" or a named
        function) in the model's `tool_format`, else the response_format; None when free."""
        if self.tools and (self.tool_choice == "required" or isinstance(self.tool_choice, dict)):
            tools = self.tools
            if isinstance(self.tool_choice, dict):
                tools = [t for t in tools if t["function"]["name"] == self.tool_choice["function"]["name"]]
            schemas = [ToolSchema(t["function"]["name"], json.dumps(t["function"].get("parameters") or
                                                                    {"type": "object"}, ensure_ascii=False))
                       for t in tools]
            return OutputConstraint("tool_calls", tools=schemas, tool_format=tool_format,
                                    parallel=self.parallel_tool_calls and self.tool_choice == "required")
        rf = self.response_format
        if rf is None:
            return None
        if rf["type"] == "json_object":
            return OutputConstraint("json_object")
        return OutputConstraint("json_schema", schema=rf["schema"], strict=rf["strict"])

    def chat_prompt(self) -> ChatPrompt:
        """What the tokenizer worker renders with the chat template. The tools stay in the prompt with
        tool_choice "none" (the model is only not to call them; earlier turns may hold their calls), as
        in transformers' prompt for the same chat and vLLM's default; the reply is not parsed for calls."""
        return ChatPrompt(self.messages, self.tools, self.chat_template_kwargs)

    @property
    def image_urls(self) -> list[str]:
        """Every image URL in message order."""
        return [
            part["image_url"]["url"]
            for m in self.messages
            if isinstance(m.get("content"), list)
            for part in m["content"]
            if part["type"] == "image_url"
        ]


def _parse_content(o: JsonFields, role: str) -> str | list[dict[str, Any]] | None:
    v, p = o.raw("content"), o.param("content")
    if v is None:
        if role == "assistant":
            return None
        raise o.err("content", "is required")
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad_request(f"'{p}' must be a string or an array of content parts (got {show(v)})", p)
    check_count(v, p, MAX_CONTENT_PARTS, "content parts")
    parts: list[dict[str, Any]] = []
    for j, raw in enumerate(v):
        po = JsonFields(raw, f"{p}[{j}]")
        kind = po.get_str("type", required=True)
        if kind == "text":
            parts.append({"type": "text", "text": po.get_str("text", required=True)})
        elif kind == "image_url":
            if role != "user":
                raise po.err(
                    "type", f"'image_url' parts are only allowed in user messages (role is '{role}')"
                )
            if isinstance(po.raw("image_url", True), str):  # {"image_url": "data:..."}: vLLM's short form
                url = po.get_str("image_url", required=True, allow_empty=False)
                parts.append({"type": "image_url", "image_url": {"url": url}})
                continue
            io = po.get_obj("image_url", required=True)
            assert io is not None
            image: dict[str, Any] = {"url": io.get_str("url", required=True, allow_empty=False)}
            detail = io.get_str("detail")
            if detail is not None:
                if detail not in IMAGE_DETAILS:
                    raise io.err("detail", f"must be one of {', '.join(IMAGE_DETAILS)} (got {show(detail)})")
                image["detail"] = detail
            parts.append({"type": "image_url", "image_url": image})
        elif kind in UNSUPPORTED_PART_TYPES:
            raise po.err("type", f"content parts of type '{kind}' are not supported")
        else:
            raise po.err("type", f"must be 'text' or 'image_url' (got {show(kind)})")
    # kept as a list: the tokenizer worker joins a text-only one for a template that renders only strings
    return parts


def _parse_tool_calls(o: JsonFields) -> list[dict[str, Any]] | None:
    calls = o.get_list("tool_calls")
    if not calls:
        return None
    check_count(calls, o.param("tool_calls"), MAX_TOOL_CALLS, "tool calls")
    out = []
    for i, raw in enumerate(calls):
        co = JsonFields(raw, o.param(f"tool_calls[{i}]"))
        if co.raw("type") not in (None, "function"):
            raise co.err("type", f"must be 'function' (got {show(co.raw('type'))})")
        fo = co.get_obj("function", required=True)
        assert fo is not None
        args = fo.raw("arguments")
        if args is None:
            args = "{}"
        elif not isinstance(args, (str, dict)):
            raise fo.err("arguments", f"must be a JSON string (got {show(args)})")
        else:
            check_free_json(args, fo.param("arguments"))
        out.append(
            {
                "id": co.get_str("id", required=True),
                "type": "function",
                "function": {"name": fo.get_str("name", required=True, allow_empty=False), "arguments": args},
            }
        )
    return out


def _parse_message(raw: Any, p: str) -> dict[str, Any]:
    o = JsonFields(raw, p)
    role = o.get_str("role", required=True)
    if role not in CHAT_ROLES:
        raise o.err("role", f"must be one of {', '.join(CHAT_ROLES)} (got {show(role)})")
    msg: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _parse_content(o, role),
    }
    name = o.get_str("name")
    if name is not None:
        msg["name"] = name
    if role == "assistant":
        tool_calls = _parse_tool_calls(o)
        if tool_calls:
            msg["tool_calls"] = tool_calls
        reasoning = o.get_str("reasoning_content")
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
    elif role == "tool":
        msg["tool_call_id"] = o.get_str("tool_call_id", required=True)
    return msg


def _parse_tools(o: JsonFields) -> list[dict[str, Any]] | None:
    tools = o.get_list("tools")
    if not tools:
        return None
    check_count(tools, o.param("tools"), MAX_TOOLS, "tools")
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    schemas: list[tuple[Any, str]] = []
    for i, raw in enumerate(tools):
        to = JsonFields(raw, o.param(f"tools[{i}]"))
        kind = to.get_str("type", required=True)
        if kind != "function":
            raise to.err("type", f"only 'function' tools are supported (got {show(kind)})")
        fo = to.get_obj("function", required=True)
        assert fo is not None
        name = fo.get_str("name", required=True, allow_empty=False)
        assert name is not None
        if len(name) > MAX_TOOL_NAME:
            raise fo.err("name", f"must be at most {MAX_TOOL_NAME} characters (got {len(name)})")
        if name in names:
            raise fo.err("name", f"duplicates another tool's name ({show(name)})")
        names.add(name)
        fn: dict[str, Any] = {"name": name}
        description = fo.get_str("description")
        if description is not None:
            fn["description"] = description
        params = fo.get_obj("parameters")
        if params is not None:
            fn["parameters"] = check_free_json(params.d, params.path)
        if fo.raw("strict") is not None:
            fn["strict"] = fo.get_bool("strict", False)
        out.append({"type": "function", "function": fn})
        if params is not None:
            schemas.append((fn["parameters"], params.path))
    check_schemas(schemas)  # one grammar holds every tool's parameters
    return out


def _parse_tool_choice(o: JsonFields, tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    v = o.raw("tool_choice")
    if v is None:
        return "auto" if tools else "none"
    if isinstance(v, str):
        if v not in TOOL_CHOICES:
            raise o.err(
                "tool_choice", f"must be one of {', '.join(TOOL_CHOICES)} or a function (got {show(v)})"
            )
        if v != "none" and not tools:
            raise o.err("tool_choice", "is only allowed when 'tools' are specified")
        return v
    co = JsonFields(v, o.param("tool_choice"))
    if co.raw("type") != "function":
        raise co.err("type", f"must be 'function' (got {show(co.raw('type'))})")
    fo = co.get_obj("function", required=True)
    assert fo is not None
    name = fo.get_str("name", required=True)
    if name not in {t["function"]["name"] for t in tools or []}:
        raise fo.err("name", f"names no function in 'tools' (got {show(name)})")
    return {"type": "function", "function": {"name": name}}


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _parse_response_format(o: JsonFields) -> dict[str, Any] | None:
    """response_format as OpenAI defines it; None for text. The schema is checked as JSON here and
    compiled by the tokenizer worker (a schema it cannot compile is a 400 from there)."""
    rf = o.get_obj("response_format")
    if rf is None:
        return None
    kind = rf.raw("type", required=True)
    if kind not in RESPONSE_FORMATS:
        raise rf.err("type", f"must be one of {', '.join(RESPONSE_FORMATS)} (got {show(kind)})")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    js = rf.get_obj("json_schema", required=True)
    assert js is not None
    js.get_str("name", required=True, allow_empty=False)
    js.get_str("description")
    schema = js.raw("schema")
    if schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise js.err("schema", f"must be a JSON schema object (got {show(schema)})")
    check_free_json(schema, js.param("schema"))
    check_schemas([(schema, js.param("schema"))])
    strict = js.raw("strict")
    if strict is not None and not isinstance(strict, bool):
        raise js.err("strict", f"must be a boolean (got {show(strict)})")
    return {"type": "json_schema", "schema": json.dumps(schema, ensure_ascii=False), "strict": bool(strict)}


def _read_stream(o: JsonFields) -> tuple[bool, bool]:
    """(stream, include_usage); stream_options is only allowed with stream, as OpenAI requires."""
    stream = o.get_bool("stream", False)
    so = o.get_obj("stream_options")
    if so is None:
        return stream, False
    if not stream:
        raise o.err("stream_options", "is only allowed when 'stream' is true")
    return stream, so.get_bool("include_usage", False)


def _read_template_kwargs(o: JsonFields) -> dict[str, Any]:
    """chat_template_kwargs: template variables only (the template itself comes from the model or the
    administrator's model.chat_template, never from a request)."""
    effort = _read_reasoning_effort(o)
    ctk = o.get_obj("chat_template_kwargs")
    if ctk is None:
        return {} if effort is None else {"enable_thinking": effort}
    check_count(ctk.d, ctk.path, MAX_TEMPLATE_KWARGS, "entries")
    for key in ctk.d:
        if key in RESERVED_TEMPLATE_KWARGS:
            why = ("is not allowed: the chat template comes from the model (or the administrator's "
                   "model.chat_template), never from a request") if key == "chat_template" else (
                   "is not allowed: it is not a template variable but a setting of how the prompt is built")
            raise ctk.err(key, why)
        if not key.isidentifier() or len(key) > MAX_TEMPLATE_KWARG_NAME:
            raise bad_request(f"'{ctk.path}' keys must be identifiers of at most {MAX_TEMPLATE_KWARG_NAME} "
                              f"characters (got {show(key)})", ctk.path)
    if ctk.raw("enable_thinking") is not None:
        ctk.get_bool("enable_thinking", True)
    kwargs = dict(check_free_json(ctk.d, ctk.path))
    if effort is not None and "enable_thinking" not in kwargs:  # the explicit template variable wins
        kwargs["enable_thinking"] = effort
    return kwargs


def _read_reasoning_effort(o: JsonFields) -> bool | None:
    """`reasoning_effort` as the enable_thinking it implies (False for none / minimal); None when absent or
    when it leaves thinking as the template has it (low / medium / high); a 400 naming the allowed values."""
    effort = o.get_str("reasoning_effort")
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise o.err("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)} (got {show(effort)})")
    return REASONING_EFFORTS[effort]


def parse_chat_request(body: Any, limits: Limits = DEFAULT_LIMITS) -> ChatRequest:
    """Validate a /v1/chat/completions body."""
    o = JsonFields(body)
    o.refuse(UNSUPPORTED_CHAT_FIELDS)
    modalities = o.raw("modalities")
    if modalities is not None and modalities != ["text"]:
        raise o.err("modalities", f"only ['text'] is supported (got {show(modalities)})")
    messages = o.get_list("messages", required=True)
    if not messages:
        raise o.err("messages", "must not be empty")
    check_count(messages, "messages", MAX_MESSAGES, "messages")
    response_format = _parse_response_format(o)
    template_kwargs = _read_template_kwargs(o)
    stream, include_usage = _read_stream(o)
    logprobs = o.get_bool("logprobs", False)
    top_logprobs = o.get_int("top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise o.err("top_logprobs", "requires 'logprobs' to be true")
    max_tokens = o.get_int("max_tokens", None, 1, MAX_INT)
    max_completion_tokens = o.get_int("max_completion_tokens", None, 1, MAX_INT)
    tools = _parse_tools(o)
    return ChatRequest(
        model=o.get_str("model"),
        messages=[_parse_message(m, f"messages[{i}]") for i, m in enumerate(messages)],
        stream=stream,
        include_usage=include_usage,
        n=o.get_int("n", 1, 1, MAX_N),
        tools=tools,
        tool_choice=_parse_tool_choice(o, tools),
        parallel_tool_calls=o.get_bool("parallel_tool_calls", True),
        chat_template_kwargs=template_kwargs,
        response_format=response_format,
        max_tokens=max_completion_tokens if max_completion_tokens is not None else max_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs or 0,
        param_names={
            "max_tokens": "max_completion_tokens" if max_completion_tokens is not None else "max_tokens"
        },
        **_read_sampling(o, limits),
    )


# ---------------------------------------------------------------------------------------------
# /v1/completions


@dataclass(kw_only=True)
class CompletionRequest(_SamplingRequest):
    """A validated completions request; ``prompts`` holds one entry (text or token ids) per prompt."""

    model: str | None = None
    prompts: list[str | list[int]] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    echo: bool = False
    # OpenAI's default of 16, shortened where the context has less room.
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = COMPLETION_DEFAULT_MAX_TOKENS


def _check_batch(v: list[Any], p: str) -> None:
    if not v:
        raise bad_request(f"'{p}' must not be empty", p)
    if len(v) > MAX_BATCH:
        raise bad_request(f"'{p}' may hold at most {MAX_BATCH} prompts (got {len(v)})", p)


def _read_prompts(o: JsonFields, key: str, what: str) -> list[str | list[int]]:
    """A string, an array of strings, an array of token ids or an array of arrays of token ids."""
    v, p = o.raw(key, required=True), o.param(key)
    if isinstance(v, str):
        return [as_str(v, p, allow_empty=False)]
    if not isinstance(v, list) or not v:
        raise bad_request(f"'{p}' must be {what} (got {show(v)})", p)
    if isinstance(v[0], (int, float)) and not isinstance(v[0], bool):
        return [as_token_ids(v, p)]
    _check_batch(v, p)
    if isinstance(v[0], str):
        return [as_str(s, f"{p}[{i}]", allow_empty=False) for i, s in enumerate(v)]
    if isinstance(v[0], list):
        return [as_token_ids(ids, f"{p}[{i}]") for i, ids in enumerate(v)]
    raise bad_request(f"'{p}' must be {what} (got an array of {show(v[0])})", p)


def parse_completion_request(body: Any, limits: Limits = DEFAULT_LIMITS) -> CompletionRequest:
    """Validate a /v1/completions body."""
    o = JsonFields(body)
    o.refuse({} if o.raw("suffix") == "" else UNSUPPORTED_COMPLETION_FIELDS)
    prompts = _read_prompts(
        o, "prompt", "a string, an array of strings, or token ids (array or array of arrays)"
    )
    n = o.get_int("n", 1, 1, MAX_N)
    assert n is not None
    if len(prompts) * n > MAX_BATCH:
        raise o.err("n", f"times the number of prompts must be at most {MAX_BATCH} (got {len(prompts) * n})")
    best_of = o.get_int("best_of", None, 1, MAX_N)
    if best_of is not None and best_of != n:
        raise o.err("best_of", f"is not supported (it must equal 'n' = {n}, got {best_of})")
    stream, include_usage = _read_stream(o)
    num_logprobs = o.get_int("logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    return CompletionRequest(
        model=o.get_str("model"),
        prompts=prompts,
        stream=stream,
        include_usage=include_usage,
        n=n,
        echo=o.get_bool("echo", False),
        max_tokens=o.get_int("max_tokens", None, 1, MAX_INT),
        logprobs=num_logprobs is not None,
        top_logprobs=num_logprobs or 0,
        param_names={"top_logprobs": "logprobs"},
        **_read_sampling(o, limits),
    )


# ---------------------------------------------------------------------------------------------
# native /generate


@dataclass(kw_only=True)
class GenerateRequest(_SamplingRequest):
    """A validated native /generate request: one prompt, or a batch when ``is_batch``."""

    texts: list[str] | None = None
    input_ids: list[list[int]] | None = None
    is_batch: bool = False
    stream: bool = False
    rids: list[str] | None = None

    @property
    def prompts(self) -> list[str | list[int]]:
        return list(self.texts if self.texts is not None else self.input_ids or [])

    @property
    def batch_size(self) -> int:
        return len(self.prompts)


def _as_rid(v: Any, p: str) -> str:
    rid = as_str(v, p, allow_empty=False)
    if len(rid) > MAX_RID_LEN:
        raise bad_request(f"'{p}' must be at most {MAX_RID_LEN} characters", p)
    if not rid.isprintable():  # it may reach logs and `mllmctl` tables
        raise bad_request(f"'{p}' must hold printable characters only (got {rid!r})", p)
    return rid


def _read_rids(o: JsonFields, is_batch: bool, size: int) -> list[str] | None:
    v, p = o.raw("rid"), o.param("rid")
    if v is None:
        return None
    if not is_batch:
        return [_as_rid(v, p)]
    if not isinstance(v, list) or len(v) != size:
        raise bad_request(f"'{p}' must be an array of {size} string{'s' if size != 1 else ''} for a batch "
                          f"(got {show(v)})", p)
    rids = [_as_rid(r, f"{p}[{i}]") for i, r in enumerate(v)]
    if len(set(rids)) != len(rids):
        raise bad_request(f"'{p}' must not repeat an id", p)
    return rids


# SGLang's /generate media fields: refused by name (ignoring them would answer about a prompt without its images)
GENERATE_MEDIA_KEYS = ("image_data", "video_data", "audio_data", "input_embeds")


def parse_generate_request(body: Any, limits: Limits = DEFAULT_LIMITS) -> GenerateRequest:
    """Validate a native /generate body (SGLang-style ``text``/``input_ids`` + ``sampling_params``)."""
    o = JsonFields(body)
    o.refuse({key: "is not supported on /generate: send images in image_url parts to /v1/chat/completions"
              for key in GENERATE_MEDIA_KEYS})
    has_text, has_ids = o.raw("text") is not None, o.raw("input_ids") is not None
    if has_text == has_ids:
        raise o.err("text", "or 'input_ids' is required (exactly one of them)")
    texts: list[str] | None = None
    input_ids: list[list[int]] | None = None
    if has_text:
        v = o.raw("text")
        is_batch = isinstance(v, list)
        if is_batch:
            _check_batch(v, "text")
            texts = [as_str(t, f"text[{i}]", allow_empty=False) for i, t in enumerate(v)]
        else:
            texts = [as_str(v, "text", allow_empty=False)]
    else:
        v = o.raw("input_ids")
        is_batch = isinstance(v, list) and bool(v) and isinstance(v[0], list)
        if is_batch:
            _check_batch(v, "input_ids")
            input_ids = [as_token_ids(ids, f"input_ids[{i}]") for i, ids in enumerate(v)]
        else:
            input_ids = [as_token_ids(v, "input_ids")]
    size = len(texts if texts is not None else input_ids or [])
    sp = o.get_obj("sampling_params") or JsonFields({}, "sampling_params")
    for key in sp.d:
        if key not in GENERATE_SAMPLING_KEYS:
            raise sp.err(
                key, f"is not a known sampling parameter (known: {', '.join(GENERATE_SAMPLING_KEYS)})"
            )
    return_logprob = o.get_bool("return_logprob", False)
    top_logprobs_num = o.get_int("top_logprobs_num", 0, 0, MAX_TOP_LOGPROBS) or 0
    if top_logprobs_num > 0 and not return_logprob:
        raise o.err("top_logprobs_num", "requires 'return_logprob' to be true")
    names = {k: sp.param(k) for k in GENERATE_SAMPLING_KEYS}
    return GenerateRequest(
        texts=texts,
        input_ids=input_ids,
        is_batch=is_batch,
        stream=o.get_bool("stream", False),
        rids=_read_rids(o, is_batch, size),
        max_tokens=sp.get_int("max_new_tokens", None, 1, MAX_INT),
        logprobs=return_logprob,
        top_logprobs=top_logprobs_num,
        param_names={
            **names,
            "max_tokens": names["max_new_tokens"],
            "logprobs": "return_logprob",
            "top_logprobs": "top_logprobs_num",
        },
        **_read_sampling(sp, limits, temperature_max=100.0),
    )
