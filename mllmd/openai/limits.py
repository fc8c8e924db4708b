"""What a request body may hold: the JSON rules and the size of every field, checked at parse time.

Everything a client sends is bounded before a request is registered or leaves the main process: the
body's nesting depth, the number of messages, content parts, tools, tool calls, stop strings and
logit_bias entries, the length of each stop string and tool name, and the free-form JSON that is
passed on as it is (tool parameter schemas, chat_template_kwargs, tool call arguments): there every
integer must fit the 64-bit range the inter-process messages carry. Two bounds are configurable
(`server.max_json_depth`, `server.max_stop_length`: `Limits`); the others are fixed here, far above
what any real client sends. Every violation is a 400 whose message names the field and the bound.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from mllmd.openai.errors import bad_request

MAX_MESSAGES = 10_000  # messages per chat request
MAX_CONTENT_PARTS = 1_024  # content parts per message
MAX_TOOLS = 256  # tools per request
MAX_TOOL_CALLS = 256  # tool calls per assistant message
MAX_TOOL_NAME = 64  # characters of a function name (OpenAI's limit)
MAX_LOGIT_BIAS = 2_048  # logit_bias entries
MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs entries
MAX_TEMPLATE_KWARG_NAME = 64  # characters of a chat_template_kwargs name
# Objects and arrays in one body: each costs the main process about 60 bytes once decoded, so an 8 MB
# body of `[{},{},...]` grew to about 400 MB (2.4 GB for six at once) before any field was checked.
# Counted in the text, strings included, before decoding; far above what a real request holds.
MAX_JSON_CONTAINERS = 1 << 18
# Free-form JSON is forwarded as msgpack, whose integers are 64-bit (signed or unsigned).
FREE_INT_MIN, FREE_INT_MAX = -(1 << 63), (1 << 64) - 1

# apply_chat_template's own parameters: a chat_template_kwargs entry of these names would not be a
# template variable but change how the prompt is built (`chat_template` would run the client's Jinja).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "conversation", "messages", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})  # fmt: skip


@dataclass(frozen=True)
class Limits:
    """The configurable bounds (server.max_json_depth, server.max_stop_length)."""

    max_json_depth: int = 64
    max_stop_length: int = 1024


DEFAULT_LIMITS = Limits()

_CONTAINERS = (list, dict)


def depth_exceeds(value: Any, max_depth: int) -> bool:
    """True if `value` nests objects/arrays deeper than `max_depth` (the top-level container is depth 1).

    Iterative (no recursion), and a container of scalars only is skipped in C (a body of a million
    token ids costs one `set(map(type, ...))`)."""
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, _CONTAINERS) else []
    while stack:
        v, depth = stack.pop()
        if depth > max_depth:
            return True
        items = v.values() if isinstance(v, dict) else v
        types = set(map(type, items))
        if list in types or dict in types:
            stack.extend((x, depth + 1) for x in items if isinstance(x, _CONTAINERS))
    return False


def decode_json(body: bytes, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode a request body; invalid JSON (or NaN / Infinity, a lone surrogate, nesting deeper than
    `limits.max_json_depth`) is a 400. JSON between systems is UTF-8 (RFC 8259, section 8.1): UTF-16/32
    bodies are refused; a UTF-8 byte-order mark is tolerated. msgspec's decoder (C) rather than
    json.loads: several times faster on large bodies, and it refuses what json.loads lets through
    (lone surrogates, 1e400 as infinity), which could not be forwarded to the workers."""
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = "\0"
    if "\0" in text:  # never in JSON text (control characters are escaped); UTF-16/32 ASCII has NULs
        raise bad_request("The JSON body of your request must be encoded as UTF-8.") from None
    if len(text) > MAX_JSON_CONTAINERS and text.count("{") + text.count("[") > MAX_JSON_CONTAINERS:
        raise bad_request(
            f"The JSON body of your request holds more than {MAX_JSON_CONTAINERS} objects and arrays "
            "(counting '{' and '[' anywhere in it)."
        )
    try:
        value = msgspec.json.decode(text)
    except RecursionError:
        value = None
        deep = True
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        raise bad_request("We could not parse the JSON body of your request (it must be valid JSON).") from None
    else:
        deep = depth_exceeds(value, limits.max_json_depth)
    if deep:
        raise bad_request(
            f"The JSON body of your request nests objects and arrays deeper than {limits.max_json_depth} "
            "levels (server.max_json_depth)."
        )
    return value


def check_free_json(value: Any, p: str) -> Any:
    """Free-form JSON passed on as it is: every integer must fit in 64 bits (the depth was bounded when
    the body was decoded). Returns `value`."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, int) and not isinstance(v, bool):
            if not FREE_INT_MIN <= v <= FREE_INT_MAX:
                raise bad_request(f"'{p}' holds an integer outside the 64-bit range", p)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return value


# JSON schemas (response_format, tool parameters) become grammars that one background thread compiles
# for every client; these bounds keep any one compilation to about a second on a 2-core machine.
MAX_SCHEMA_NODES = 8_192  # JSON values in a request's schemas together (a 100,000-value enum: minutes)
MAX_SCHEMA_PATTERN = 1_024  # characters of a "pattern" regex
_COUNTED = re.compile(r"\{(\d*)(,?)(\d*)\}")


def check_schemas(schemas: list[tuple[Any, str]]) -> None:
    """Bound what compiling `schemas` ((schema, its param) pairs) can cost: MAX_SCHEMA_NODES values in
    all, and every "pattern" short and free of a ranged repetition inside another one (xgrammar took
    65 s for ^([a-z]{1,50}){1,50}$, 5 s for {1,16} in {1,16}; exact counts and * or + around a range
    cost little)."""
    nodes = 0
    for schema, p in schemas:
        stack = [schema]
        while stack:
            v = stack.pop()
            nodes += 1
            if nodes > MAX_SCHEMA_NODES:
                raise bad_request(f"'{p}': the request's JSON schemas may hold at most {MAX_SCHEMA_NODES} "
                                  "values in all (each key, item and value counts)", p)  # fmt: skip
            if isinstance(v, dict):
                pattern = v.get("pattern")
                if isinstance(pattern, str):
                    _check_pattern(pattern, p)
                stack.extend(v.values())
            elif isinstance(v, list):
                stack.extend(v)


def _check_pattern(pattern: str, p: str) -> None:
    if len(pattern) > MAX_SCHEMA_PATTERN:
        raise bad_request(f"'{p}' holds a pattern of {len(pattern)} characters (at most {MAX_SCHEMA_PATTERN})", p)
    groups = [False]  # per open group: whether a ranged repetition ({m,n} with n > m, or {m,}) is inside
    closed = False  # the atom before a quantifier is the group just closed (with its flag)
    closed_ranged = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i, closed = i + 2, False
            continue
        if c == "[":  # a class: skip to its end ("]" first in it is literal)
            j = i + 1 + (pattern[i + 1 : i + 2] == "^")
            j += pattern[j : j + 1] == "]"
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i, closed = j + 1, False
            continue
        if c == "(":
            groups.append(False)
            i, closed = i + 1, False
            continue
        if c == ")" and len(groups) > 1:
            closed_ranged = groups.pop()
            groups[-1] = groups[-1] or closed_ranged
            i, closed = i + 1, True
            continue
        m = _COUNTED.match(pattern, i) if c == "{" else None
        if m is not None:
            low, comma, high = m.groups()
            ranged = bool(comma) and (not high or int(high) > int(low or 0))
            if ranged and closed and closed_ranged:
                raise bad_request(f"'{p}' holds a pattern with a ranged repetition inside another one "
                                  f"({pattern[:60]!r}): its grammar would take minutes to compile", p)  # fmt: skip
            groups[-1] = groups[-1] or ranged
            i, closed = m.end(), False
            continue
        i, closed = i + 1, False


def check_count(v: list[Any] | dict[Any, Any], p: str, limit: int, what: str) -> None:
    if len(v) > limit:
        raise bad_request(f"'{p}' may hold at most {limit} {what} (got {len(v)})", p)
