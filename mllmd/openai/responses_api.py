"""The Responses API's request (POST /v1/responses), translated onto the chat path.

A Responses body is rewritten as the chat completions body that asks for the same generation, and
`protocol.parse_chat_request` validates that: sampling fields, limits, tools, structured-output formats,
images and template variables follow the chat rules because they are the chat code. A refusal from the
chat parser is reported under the Responses field it came from (`ParamMap`: `input[2].content[0].text`,
not `messages[3].content[0].text`).

The mapping: `instructions` is a system message first; `input` a string (one user message) or items:
messages (roles user / system / developer / assistant; `input_text`, `output_text` and `input_image`
parts), `function_call` items (the tool calls of the assistant turn they follow), `function_call_output`
items (tool messages; each answers a function_call before it) and `reasoning` items (the next assistant
turn's `reasoning_content`). Flat `function` tools become chat's nested ones, `text.format` the
`response_format`, `max_output_tokens` `max_tokens`, `reasoning.effort` chat's `reasoning_effort` (none /
minimal turn thinking off), and the `message.output_text.logprobs` include asks for logprobs
(`top_logprobs` alternatives).

The server is stateless: nothing is stored, whatever `store` says (the response does not claim to be
stored: the SDK's `Response` has no `store` field). So `previous_response_id`, `conversation`, saved
`prompt`s, `background: true` and `item_reference` input items are refused with a 400 naming the field,
as are hosted tools and input types other than the above. Unknown fields are ignored, as on chat; the
chat extensions (`seed`, `stop`, `top_k`, `min_p`, penalties, `logit_bias`, `ignore_eos`,
`chat_template_kwargs`, ...) pass through. `truncation: "auto"` is accepted and served as "disabled": an
input longer than the context is a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mllmd.openai.errors import APIError, bad_request
from mllmd.openai.fields import JsonFields, show
from mllmd.openai.limits import DEFAULT_LIMITS, MAX_MESSAGES, Limits, check_count
from mllmd.openai.protocol import ChatRequest, parse_chat_request
from mllmd.sampling_params import MAX_TOP_LOGPROBS

# Responses fields that are chat fields of the same name and meaning, and the chat extensions
PASSED_THROUGH = (
    "model", "temperature", "top_p", "parallel_tool_calls", "stream", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias",
    "skip_special_tokens", "chat_template_kwargs",
)  # fmt: skip
STATELESS = "this server is stateless: it stores no responses"
REFUSED_FIELDS: dict[str, str] = {
    "previous_response_id": f"is not supported: {STATELESS}; send the whole conversation in 'input'",
    "conversation": f"is not supported: {STATELESS} or conversations; send the whole conversation in 'input'",
    "prompt": "(a saved prompt) is not supported: send the instructions and input themselves",
}
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PARTS = ("input_text", "output_text")
UNSUPPORTED_PARTS = ("refusal", "input_file", "input_audio")
TRUNCATIONS = ("disabled", "auto")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# effort -> chat's reasoning_effort: Qwen3 thinks or not, so the efforts above high think as high does
EFFORTS = {"xhigh": "high", "max": "high"}
SUMMARIES = ("auto", "concise", "detailed")  # accepted; the reasoning is returned whole, never summarised
IMAGE_DETAILS = {"original": "high"}  # an image is never sent above server.max_image_pixels anyway
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds
# What the response repeats of the request and no other bound limits (the prompt's fields are bounded by
# the context): a stream repeats it three times, and a client that does not read its reply has the
# daemon hold that for as long as it keeps the connection (a 7.5 MB `user` held 26 MB a connection)
MAX_USER = MAX_METADATA_VALUE  # characters of `user` (OpenAI's safety_identifier takes 64)
MAX_FORMAT_JSON = 128 * 1024  # characters of `text.format` as JSON: its name, description and schema


class ParamMap:
    """Where each chat field came from in the Responses body, to name it in errors."""

    def __init__(self) -> None:
        self._pairs: dict[str, str] = {}

    def add(self, chat: str, responses: str) -> None:
        self._pairs[chat] = responses

    def name(self, param: str | None) -> str | None:
        """The Responses name of chat field `param` (by its longest mapped prefix; unmapped: itself)."""
        if param is None:
            return None
        cut = len(param)
        while cut > 0:
            head = param[:cut]
            if head in self._pairs:
                return self._pairs[head] + param[cut:]
            cut = max(param.rfind(".", 0, cut), param.rfind("[", 0, cut))
        return param

    def error(self, e: APIError) -> APIError:
        """`e` naming the Responses field, in its param and where its message quotes the chat name."""
        renamed = self.name(e.param)
        if renamed == e.param:
            return e
        message = e.message.replace(f"'{e.param}'", f"'{renamed}'")
        return APIError(e.status, message, e.type, renamed, e.code, e.retry_after)


@dataclass
class ResponsesRequest:
    """A validated Responses request: the chat request it translates to, how to name its fields in
    errors, and the request fields a response object repeats (`echo`)."""

    chat: ChatRequest
    params: ParamMap
    echo: dict[str, Any] = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        return self.chat.stream


class _Input:
    """Input items -> chat messages, recording where each came from."""

    def __init__(self, params: ParamMap) -> None:
        self.messages: list[dict[str, Any]] = []
        self.params = params
        self.reasoning: str | None = None  # a reasoning item's text, for the next assistant turn
        self.call_ids: set[str] = set()  # of the function_call items so far

    def _append(self, msg: dict[str, Any], source: str) -> str:
        """Add a chat message; returns its chat path."""
        path = f"messages[{len(self.messages)}]"
        self.messages.append(msg)
        self.params.add(path, source)
        if msg["role"] != "assistant":
            self.reasoning = None  # its turn ended without a reply: it belongs to no later one
        return path

    def _assistant(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
            self.reasoning = None
        return msg

    def item(self, raw: Any, p: str) -> None:
        o = JsonFields(raw, p)
        kind = o.raw("type")
        if kind is None and o.raw("role") is not None:
            kind = "message"
        if kind == "message":
            self.message(o)
        elif kind == "function_call":
            self.function_call(o)
        elif kind == "function_call_output":
            self.function_call_output(o)
        elif kind == "reasoning":
            self.reasoning = _reasoning_text(o)
        elif kind == "item_reference":
            raise o.err("type", f"'item_reference' is not supported: {STATELESS} or items; send the item itself")
        elif kind is None:
            raise o.err("type", "is required")
        else:
            raise o.err("type", f"must be one of {', '.join(ITEM_TYPES)} (got {show(kind)}): input items of "
                                "other types are not supported")

    def message(self, o: JsonFields) -> None:
        role = o.get_str("role", required=True)
        if role not in MESSAGE_ROLES:
            raise o.err("role", f"must be one of {', '.join(MESSAGE_ROLES)} (got {show(role)})")
        path = f"messages[{len(self.messages)}]"
        msg = {"role": role, "content": self.content(o.raw("content"), f"{path}.content", o.param("content"))}
        self._append(self._assistant(msg) if role == "assistant" else msg, o.path)

    def content(self, v: Any, chat_path: str, p: str) -> Any:
        """A string as it is; a list of Responses parts as chat parts (anything else: chat's error)."""
        if not isinstance(v, list):
            return v
        return [self.part(raw, f"{chat_path}[{j}]", f"{p}[{j}]") for j, raw in enumerate(v)]

    def part(self, raw: Any, chat_path: str, p: str) -> dict[str, Any]:
        po = JsonFields(raw, p)
        kind = po.get_str("type", required=True)
        if kind in TEXT_PARTS:
            return {"type": "text", "text": po.raw("text")}
        if kind == "input_image":
            return self.image(po, chat_path)
        if kind in UNSUPPORTED_PARTS:
            raise po.err("type", f"content parts of type '{kind}' are not supported")
        raise po.err("type", f"must be one of {', '.join((*TEXT_PARTS, 'input_image'))} (got {show(kind)})")

    def image(self, po: JsonFields, chat_path: str) -> dict[str, Any]:
        if po.raw("image_url") is None and po.raw("file_id") is not None:
            raise po.err("file_id", "is not supported (there is no Files API here): send the image in "
                                    "'image_url', as a data URL or a path inside server.media_dirs")
        image: dict[str, Any] = {"url": po.raw("image_url", required=True)}
        detail = po.raw("detail")
        if detail is not None:
            image["detail"] = IMAGE_DETAILS.get(detail, detail) if isinstance(detail, str) else detail
        self.params.add(f"{chat_path}.image_url.url", po.param("image_url"))
        self.params.add(f"{chat_path}.image_url", po.path)
        return {"type": "image_url", "image_url": image}

    def function_call(self, o: JsonFields) -> None:
        """A call of the assistant turn it follows (or of a new assistant turn)."""
        if not self.messages or self.messages[-1]["role"] != "assistant" or self.reasoning is not None:
            self._append(self._assistant({"role": "assistant", "content": None}), o.path)
        k = len(self.messages) - 1
        calls = self.messages[k].setdefault("tool_calls", [])
        self.params.add(f"messages[{k}].tool_calls", "input")  # the turn's calls: function_call items in a row
        call = f"messages[{k}].tool_calls[{len(calls)}]"
        if isinstance(o.raw("call_id"), str):
            self.call_ids.add(o.raw("call_id"))
        calls.append({"id": o.raw("call_id"), "type": "function",
                      "function": {"name": o.raw("name"), "arguments": o.raw("arguments")}})
        for chat, ours in ((call, o.path), (f"{call}.id", o.param("call_id")), (f"{call}.function", o.path),
                           (f"{call}.function.name", o.param("name")),
                           (f"{call}.function.arguments", o.param("arguments"))):
            self.params.add(chat, ours)

    def function_call_output(self, o: JsonFields) -> None:
        """A tool message: the output of a function_call earlier in the input (as OpenAI requires;
        the model would read the result of a call it never made)."""
        call_id = o.raw("call_id")
        if isinstance(call_id, str) and call_id not in self.call_ids:
            raise o.err("call_id", f"matches no function_call before it in 'input' (got {show(call_id)}): "
                                   "send the function_call item whose output this is first")
        path = f"messages[{len(self.messages)}]"
        msg = {"role": "tool", "tool_call_id": o.raw("call_id"),
               "content": self.content(o.raw("output"), f"{path}.content", o.param("output"))}
        self._append(msg, o.path)
        self.params.add(f"{path}.tool_call_id", o.param("call_id"))
        self.params.add(f"{path}.content", o.param("output"))


def _reasoning_text(o: JsonFields) -> str | None:
    """A reasoning item's text: its reasoning_text parts, else its summary (None when it has neither)."""
    for key in ("content", "summary"):
        parts = o.get_list(key) or []
        texts = [JsonFields(raw, f"{o.param(key)}[{j}]").get_str("text", required=True)
                 for j, raw in enumerate(parts)]
        if texts:
            return "\n\n".join(t for t in texts if t is not None)
    return None


def _messages(o: JsonFields, params: ParamMap) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages."""
    ins = _Input(params)
    params.add("messages", "input")
    instructions = o.get_str("instructions")
    if instructions is not None:
        ins._append({"role": "system", "content": instructions}, "instructions")
    v = o.raw("input", required=True)
    if isinstance(v, str):
        ins._append({"role": "user", "content": v}, "input")
    elif isinstance(v, list):
        check_count(v, "input", MAX_MESSAGES, "items")
        for i, raw in enumerate(v):
            ins.item(raw, f"input[{i}]")
        if v and not ins.messages:  # reasoning items only: chat's "must not be empty" would puzzle
            raise o.err("input", "holds no message, function_call or function_call_output: reasoning items "
                                 "are only context for the assistant turn after them")
    else:
        raise o.err("input", f"must be a string or an array of input items (got {show(v)})")
    return ins.messages


def _tools(o: JsonFields, params: ParamMap) -> list[dict[str, Any]] | None:
    """Flat function tools as chat's nested ones; hosted tools are refused."""
    tools = o.get_list("tools")
    if tools is None:
        return None
    out = []
    for i, raw in enumerate(tools):
        to = JsonFields(raw, f"tools[{i}]")
        kind = to.get_str("type", required=True)
        if kind != "function":
            raise to.err("type", f"only 'function' tools are supported (got {show(kind)})")
        out.append({"type": "function", "function": {k: to.d[k] for k in ("name", "description", "parameters",
                                                                          "strict") if k in to.d}})
        params.add(f"tools[{i}].function", to.path)
    return out


def _tool_choice(o: JsonFields, params: ParamMap) -> Any:
    """{"type": "function", "name"} as chat's {"type": "function", "function": {"name"}}."""
    v = o.raw("tool_choice")
    if isinstance(v, dict) and v.get("type") == "function":
        params.add("tool_choice.function", "tool_choice")
        return {"type": "function", "function": {"name": v.get("name")}}
    return v  # a string, or what chat refuses (naming tool_choice.type)


def _text_format(o: JsonFields, params: ParamMap) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(chat's response_format, the text config the response repeats) of `text.format`."""
    text = o.get_obj("text")
    fmt = text.get_obj("format") if text is not None else None
    if fmt is None:
        return None, {"type": "text"}
    params.add("response_format", fmt.path)
    kind = fmt.raw("type", required=True)
    if kind != "json_schema":
        return {"type": kind}, {"type": kind}
    params.add("response_format.json_schema", fmt.path)
    schema: dict[str, Any] = {k: fmt.d[k] for k in ("name", "description", "schema", "strict") if k in fmt.d}
    size = len(json.dumps(schema, ensure_ascii=False))
    if size > MAX_FORMAT_JSON:
        raise bad_request(f"'{fmt.path}' is {size} characters of JSON; at most {MAX_FORMAT_JSON} (the response "
                          "repeats it)", fmt.path)
    echo = {**schema, "type": "json_schema", "schema": schema.get("schema") or {}, "strict": bool(schema.get("strict"))}
    return {"type": "json_schema", "json_schema": schema}, echo


def _reasoning(o: JsonFields, params: ParamMap) -> tuple[str | None, dict[str, Any]]:
    """(chat's reasoning_effort, the reasoning config the response repeats)."""
    ro = o.get_obj("reasoning")
    if ro is None:
        return None, {"effort": None, "summary": None}
    effort = ro.get_str("effort")
    params.add("reasoning_effort", ro.param("effort"))
    summary = ro.get_str("summary")
    if summary is not None and summary not in SUMMARIES:
        raise ro.err("summary", f"must be one of {', '.join(SUMMARIES)} (got {show(summary)})")
    return (EFFORTS.get(effort, effort) if effort is not None else None), {"effort": effort, "summary": summary}


def _metadata(o: JsonFields) -> dict[str, str]:
    mo = o.get_obj("metadata")
    if mo is None:
        return {}
    check_count(mo.d, mo.path, MAX_METADATA, "entries")
    for key in mo.d:
        if len(key) > MAX_METADATA_KEY:
            raise bad_request(f"'{mo.path}' keys must be at most {MAX_METADATA_KEY} characters", mo.path)
        value = mo.get_str(key, required=True)
        if value is not None and len(value) > MAX_METADATA_VALUE:
            raise mo.err(key, f"must be at most {MAX_METADATA_VALUE} characters")
    return dict(mo.d)


def _logprobs(o: JsonFields) -> tuple[bool, int | None]:
    """(logprobs asked for by `include`, top_logprobs); other includes name items this server never
    makes (hosted tools, encrypted reasoning) and have no effect."""
    include = o.get_list("include") or []
    for j, v in enumerate(include):
        if not isinstance(v, str):
            raise bad_request(f"'include[{j}]' must be a string (got {show(v)})", f"include[{j}]")
    top = o.get_int("top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    return LOGPROBS_INCLUDE in include, top


def _check_state_fields(o: JsonFields) -> None:
    """Refuse what needs stored state or a background worker; check the flags that need neither."""
    o.refuse(REFUSED_FIELDS)
    o.get_bool("store", True)  # accepted either way: nothing is ever stored
    if o.get_bool("background", False):
        raise o.err("background", f"must be false: background responses are not supported ({STATELESS})")
    truncation = o.get_str("truncation")
    if truncation is not None and truncation not in TRUNCATIONS:
        raise o.err("truncation", f"must be one of {', '.join(TRUNCATIONS)} (got {show(truncation)})")


def parse_responses_request(body: Any, limits: Limits = DEFAULT_LIMITS) -> ResponsesRequest:
    """Validate a /v1/responses body by translating it to chat and parsing that."""
    o = JsonFields(body)
    _check_state_fields(o)
    params = ParamMap()
    chat: dict[str, Any] = {k: o.d[k] for k in PASSED_THROUGH if k in o.d}
    chat["messages"] = _messages(o, params)
    chat["tools"] = _tools(o, params)
    chat["tool_choice"] = _tool_choice(o, params)
    chat["response_format"], text_echo = _text_format(o, params)
    chat["reasoning_effort"], reasoning_echo = _reasoning(o, params)
    chat["max_tokens"] = o.raw("max_output_tokens")
    params.add("max_tokens", "max_output_tokens")
    logprobs, top_logprobs = _logprobs(o)
    if logprobs:
        chat.update(logprobs=True, top_logprobs=top_logprobs)
        params.add("logprobs", "include")
    metadata, user = _metadata(o), o.get_str("user")
    if user is not None and len(user) > MAX_USER:
        raise o.err("user", f"must be at most {MAX_USER} characters (got {len(user)})")
    try:
        req = parse_chat_request({k: v for k, v in chat.items() if v is not None}, limits)
    except APIError as e:
        raise params.error(e) from None
    req.param_names["max_tokens"] = "max_output_tokens"  # the output budget's refusals name it
    echo = {
        "instructions": o.raw("instructions"), "max_output_tokens": req.max_tokens, "metadata": metadata,
        "parallel_tool_calls": req.parallel_tool_calls, "reasoning": reasoning_echo,
        "temperature": req.temperature, "text": {"format": text_echo}, "tool_choice": _echo_tool_choice(req),
        "tools": [_echo_tool(t["function"]) for t in req.tools or []], "top_logprobs": top_logprobs or 0,
        "top_p": req.top_p, "truncation": o.raw("truncation") or "disabled", "user": user,
    }  # fmt: skip
    return ResponsesRequest(req, params, echo)


def _echo_tool(fn: dict[str, Any]) -> dict[str, Any]:
    """A chat tool in the Responses' flat shape."""
    return {"type": "function", "name": fn["name"], "description": fn.get("description"),
            "parameters": fn.get("parameters"), "strict": fn.get("strict")}


def _echo_tool_choice(req: ChatRequest) -> Any:
    choice = req.tool_choice
    return {"type": "function", "name": choice["function"]["name"]} if isinstance(choice, dict) else choice
