"""Turn `<tool_call>` blocks in a Qwen3 reply into OpenAI `tool_calls`.

Qwen3 (`tool_call_parser: qwen3`, alias `hermes`) writes Hermes-style JSON calls, as its chat
template renders them::

    Some text\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>\\n<tool_call>\\n...

Qwen3.5 (`tool_call_parser: qwen3_5`, alias `qwen3_coder`) writes an XML-ish form::

    <tool_call>\\n<function=f>\\n<parameter=x>\\n1\\n</parameter>\\n</function>\\n</tool_call>

Rules, identical for `ToolCallParser.extract` and `StreamingToolCalls` (whatever the deltas):

* A block `<tool_call>BODY</tool_call>` is a tool call when BODY parses (`parse_body`); otherwise
  the whole block, tags included, stays content verbatim. So does an unterminated `<tool_call>`.
  Parsing never raises.
* The `\\n`s right before a valid call's `<tool_call>` and right after its `</tool_call>` are
  framing (the template's separators) and are dropped; all other text is content, verbatim.
* `arguments` is JSON text of an object, re-serialised with `json.dumps(..., ensure_ascii=False)`.
* Ids come from `make_id(index)` (index of the call in the reply); the default is `call_` + 24
  random hex digits.

Streaming: content is passed through at once, except a trailing run of `\\n`s and a possible
partial `<tool_call>` tag, which are held until the next delta decides them. A call is announced
only once its `</tool_call>` has arrived and the body has parsed (that is what keeps "malformed
stays content" true while streaming); it then yields two deltas, as OpenAI streams calls: first
`index`, `id`, `type`, `function.name` and `function.arguments: ""`, then `index` and the
arguments text. Clients concatenate `arguments` per `index`.

When a reply has tool calls and ended naturally, the server reports `finish_reason: "tool_calls"`.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One complete call; `arguments` is JSON text."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """`message.tool_calls[i]` in OpenAI shape."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of call `index`: the header (id and name set) or an arguments fragment."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """`delta.tool_calls[i]` in OpenAI shape."""
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass(frozen=True)
class ContentDelta:
    """Plain reply text that is certain not to belong to a tool call."""

    text: str


ToolStreamEvent = ContentDelta | ToolCallDelta


def random_call_id(index: int = 0) -> str:
    """`call_` + 24 random hex digits (the index is ignored)."""
    return "call_" + secrets.token_hex(12)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 if none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _loads(text: str) -> Any:
    """Strict `json.loads` (no NaN/Infinity); raises ValueError on any failure."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError as e:
        raise ValueError("JSON nested too deeply") from e


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def parse_json_call(body: str) -> tuple[str, str] | None:
    """`{"name": str, "arguments": {...}}` -> (name, arguments JSON), or None when malformed.

    `parameters` is accepted for `arguments`; missing or null arguments mean `{}`; arguments given
    as a JSON string are decoded. Anything else that is not an object is malformed.
    """
    try:
        obj = _loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = _loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name.strip(), _dumps(args)


_FUNCTION_RE = re.compile(r"\A\s*<function=([^>\n]+)>(.*)</function>\s*\Z", re.S)
_PARAMETER_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_INT_RE = re.compile(r"-?\d+")


def _schema_types(schema: Mapping[str, Any]) -> list[str]:
    """JSON-schema type names a parameter allows (from `type` and `anyOf`/`oneOf`)."""
    types: list[str] = []
    t = schema.get("type")
    if isinstance(t, str):
        types.append(t)
    elif isinstance(t, list):
        types.extend(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            if isinstance(sub, Mapping):
                types.extend(_schema_types(sub))
    return types


def _convert_as(value: str, type_name: str) -> tuple[bool, Any]:
    """Try to read the parameter text as one JSON-schema type; (ok, value)."""
    v = value.strip()
    if type_name == "string":
        return True, value
    if type_name == "integer" and _INT_RE.fullmatch(v):
        return True, int(v)
    if type_name == "number":
        if _INT_RE.fullmatch(v):
            return True, int(v)
        try:
            f = float(v)
        except ValueError:
            return False, None
        return (True, f) if math.isfinite(f) else (False, None)
    if type_name == "boolean" and v.lower() in ("true", "false"):  # Jinja renders True/False
        return True, v.lower() == "true"
    if type_name == "null" and v in ("null", "None"):
        return True, None
    if type_name in ("object", "array"):
        try:
            obj = _loads(v)
        except ValueError:
            return False, None
        if isinstance(obj, dict if type_name == "object" else list):
            return True, obj
    return False, None


def convert_parameter(value: str, schema: Mapping[str, Any] | None) -> Any:
    """Type an XML parameter's text by its JSON schema.

    Declared types are tried in order (`string` last); a value that fits none stays a string.
    Without a schema the value is a string, unless it is a JSON object or array.
    """
    types = _schema_types(schema) if schema else []
    if not types:
        if value.strip()[:1] in ("{", "["):
            ok, obj = _convert_as(value, "object" if value.strip()[0] == "{" else "array")
            if ok:
                return obj
        return value
    for t in sorted(types, key=lambda t: t == "string"):
        ok, obj = _convert_as(value, t)
        if ok:
            return obj
    return value


def _parameter_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """function name -> `parameters.properties` from OpenAI `tools` (malformed entries skipped)."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = props if isinstance(props, Mapping) else {}
    return out


def parse_xml_call(body: str, schemas: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[str, str] | None:
    """`<function=f><parameter=x>\\nv\\n</parameter></function>` -> (name, arguments JSON) or None.

    One `\\n` after `<parameter=x>` and one before `</parameter>` are the template's framing and are
    removed; values are typed with `convert_parameter` against `schemas[name]` when known. Only
    whitespace may sit between parameters; a repeated parameter name is malformed.
    """
    m = _FUNCTION_RE.match(body)
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    if not name:
        return None
    props = (schemas or {}).get(name, {})
    args: dict[str, Any] = {}
    pos = 0
    for p in _PARAMETER_RE.finditer(inner):
        key = p.group(1).strip()
        if inner[pos : p.start()].strip() or not key or key in args:
            return None
        value = p.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        schema = props.get(key)
        args[key] = convert_parameter(value, schema if isinstance(schema, Mapping) else None)
        pos = p.end()
    if inner[pos:].strip():
        return None
    return name, _dumps(args)


# Streaming states.
_TEXT = 0
_CALL = 1  # inside `<tool_call>`, waiting for `</tool_call>`
_AFTER_CALL = 2  # just after a valid call: drop leading "\n"s


class StreamingToolCalls:
    """Incremental extractor: `feed(delta) -> [ContentDelta | ToolCallDelta, ...]`, then `flush()`.

    `tool_calls` lists the calls completed so far.
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._state = _TEXT
        self._buf = ""
        self._newlines = ""  # "\n"s held before the open `<tool_call>`
        self._scan = 0  # where to resume looking for `</tool_call>` in the buffer
        self.tool_calls: list[ToolCall] = []

    def feed(self, delta: str) -> list[ToolStreamEvent]:
        """Consume a text delta; return the events that became certain, in reply order."""
        self._buf += delta
        return self._process(final=False)

    def flush(self) -> list[ToolStreamEvent]:
        """End of the reply: release held text (an unterminated call becomes content)."""
        return self._process(final=True)

    def _process(self, final: bool) -> list[ToolStreamEvent]:
        events: list[ToolStreamEvent] = []

        def content(text: str) -> None:
            if not text:
                return
            if events and isinstance(events[-1], ContentDelta):
                events[-1] = ContentDelta(events[-1].text + text)
            else:
                events.append(ContentDelta(text))

        start, end = self._parser.start_tag, self._parser.end_tag
        while True:
            buf = self._buf
            if self._state == _TEXT:
                idx = buf.find(start)
                if idx >= 0:
                    before = buf[:idx].rstrip("\n")
                    content(before)
                    self._newlines = buf[len(before) : idx]
                    self._buf = buf[idx + len(start) :]
                    self._scan = 0
                    self._state = _CALL
                    continue
                if final:
                    content(buf)
                    self._buf = ""
                    break
                sure = buf[: len(buf) - _partial_suffix(buf, start)].rstrip("\n")
                content(sure)
                self._buf = buf[len(sure) :]
                break
            if self._state == _CALL:
                idx = buf.find(end, self._scan)
                if idx < 0:
                    if final:
                        content(self._newlines + start + buf)
                        self._buf = ""
                        self._state = _TEXT
                        break
                    self._scan = max(0, len(buf) - len(end) + 1)
                    break
                body = buf[:idx]
                self._buf = buf[idx + len(end) :]
                parsed = self._parser.parse_body(body)
                if parsed is None:
                    content(self._newlines + start + body + end)
                    self._state = _TEXT
                else:
                    index = len(self.tool_calls)
                    call = ToolCall(self._parser.make_id(index), parsed[0], parsed[1])
                    self.tool_calls.append(call)
                    events.append(ToolCallDelta(index, id=call.id, name=call.name, arguments=""))
                    events.append(ToolCallDelta(index, arguments=call.arguments))
                    self._state = _AFTER_CALL
                self._newlines = ""
                continue
            # _AFTER_CALL
            self._buf = buf.lstrip("\n")
            if not self._buf:
                break
            self._state = _TEXT
        return events


class ToolCallParser:
    """Qwen3 Hermes-style JSON tool calls; `extract` for whole replies, `stream()` for deltas.

    `tools` are the request's OpenAI tool definitions (used by the XML form to type parameters);
    `make_id(index)` names calls (default `random_call_id`).
    """

    name: ClassVar[str] = "qwen3"
    start_tag: ClassVar[str] = TOOL_CALL_START
    end_tag: ClassVar[str] = TOOL_CALL_END

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None,
                 make_id: Callable[[int], str] | None = None) -> None:
        self.tools = list(tools or ())
        self.make_id = make_id or random_call_id

    def parse_body(self, body: str) -> tuple[str, str] | None:
        """The text between the tags -> (name, arguments JSON), or None when it is not a call."""
        return parse_json_call(body)

    def stream(self) -> StreamingToolCalls:
        """A fresh streaming extractor for one reply."""
        return StreamingToolCalls(self)

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """Split a whole reply into `(content, tool_calls)`."""
        s = self.stream()
        events = s.feed(text) + s.flush()
        return "".join(e.text for e in events if isinstance(e, ContentDelta)), s.tool_calls


class Qwen35ToolParser(ToolCallParser):
    """Qwen3.5 / Qwen3-Coder `<function=...><parameter=...>` calls (JSON bodies also accepted)."""

    name: ClassVar[str] = "qwen3_5"

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None,
                 make_id: Callable[[int], str] | None = None) -> None:
        super().__init__(tools, make_id)
        self._schemas = _parameter_schemas(self.tools)

    def parse_body(self, body: str) -> tuple[str, str] | None:
        """XML form first, then the Qwen3 JSON form."""
        return parse_xml_call(body, self._schemas) or parse_json_call(body)


_TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "qwen3": ToolCallParser,
    "hermes": ToolCallParser,
    "qwen3_5": Qwen35ToolParser,
    "qwen3_coder": Qwen35ToolParser,
}


def tool_parser_names() -> list[str]:
    """Names accepted by `get_tool_parser`."""
    return sorted(_TOOL_PARSERS)


def get_tool_parser(name: str) -> type[ToolCallParser]:
    """The tool-call parser class registered as `name`; ValueError naming unknown names."""
    try:
        return _TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool_call_parser {name!r}; known: {', '.join(tool_parser_names())}") from None
