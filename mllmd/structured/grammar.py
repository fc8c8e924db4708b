"""From an OutputConstraint to a compiled xgrammar grammar, cached by constraint and bounded in time.

xgrammar (not llguidance): its compiled grammars precompute the token masks of most parser states,
so the per-step mask of a row costs tens of microseconds on the host (measured here, Qwen3's 151,936
tokens: 20 mask fills + accepts of a JSON schema in 61 ms including the test's own argmax, against
llguidance's 100 ms a step inside a free string); it has aarch64 wheels for Python 3.10 (Jetson).

Used twice: the tokenizer worker compiles a request's constraint before the request is accepted (a
schema that does not compile is the client's 400, with xgrammar's reason), and the engine compiles
it again for its matchers (the same cache key; a few tens of milliseconds a new schema). Neither
waits for a compilation in its loop: the request waits (parked in the tokenizer worker, deferred in
the engine) while the others go on, since a schema may take seconds to compile (a 20,000-value enum
took 4.5 s on a 2-core machine) and would otherwise stall every stream that runs.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from typing import Any

from mllmd.sampling_params import OutputConstraint, ToolSchema

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_BYTES = 256 << 20  # compiled grammars kept (xgrammar's cache, and ours by constraint)
MAX_CACHED_GRAMMARS = 256
MAX_PARALLEL_CALLS = 4  # calls one constrained reply may hold with parallel_tool_calls

_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")  # "[01:05:58] /project/cpp/x.cc:5082: "


def tool_call_format(tool_call_parser: str | None) -> str:
    """How the model writes a call, from the configured parser: Qwen3.5's XML-ish form for qwen3_5
    (alias qwen3_coder), Hermes-style JSON otherwise (Qwen3, Qwen3-VL)."""
    return "qwen3_xml" if tool_call_parser in ("qwen3_5", "qwen3_coder") else "hermes"


class GrammarError(ValueError):
    """A constraint that cannot be compiled; `param` is the request field to blame."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _param(c: OutputConstraint) -> str:
    """The request field a constraint came from."""
    return "tool_choice" if c.kind == "tool_calls" else "response_format"


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)


def _literal(xgr: Any, text: str) -> Any:
    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))


def _call_schema(tool: ToolSchema) -> dict[str, Any]:
    """Qwen3's (Hermes) call object, keys in the template's order: {"name": ..., "arguments": {...}}."""
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": json.loads(tool.parameters)},
            "required": ["name", "arguments"]}


def _xml_value(xgr: Any, schema: Any) -> Any:
    """A parameter's text in Qwen3.5's XML calls: strings raw (a const or an enum's values, the
    pattern, or any text without '<'), other types as JSON (the tool parser types them back by the
    schema). Strings with length bounds: `_bounded_xml_param`."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        const = schema.get("const")
        enum = [const] if isinstance(const, str) else schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            values = [_literal(xgr, v) for v in enum]
            return values[0] if len(values) == 1 else xgr.Grammar.union(*values)
        pattern = schema.get("pattern")
        if isinstance(pattern, str) and pattern:  # JSON Schema patterns match anywhere unless anchored
            return xgr.Grammar.from_regex(pattern.removeprefix("^").removesuffix("$"))
        return xgr.Grammar.from_regex(r"[^<]*")
    return json_schema_grammar(xgr, json.dumps(schema if isinstance(schema, dict) else {}))


def _length_bounds(schema: Any) -> tuple[int, int | None] | None:
    """(minLength, maxLength or None) of a plain string schema that bounds its length; else None."""
    if not (isinstance(schema, dict) and schema.get("type") == "string") or any(
            k in schema for k in ("const", "enum", "pattern")):  # fmt: skip
        return None
    low, high = schema.get("minLength"), schema.get("maxLength")
    low = low if isinstance(low, int) and not isinstance(low, bool) and low > 0 else 0
    high = high if isinstance(high, int) and not isinstance(high, bool) and high >= low else None
    return (low, high) if low or high is not None else None


def _bounded_xml_param(xgr: Any, key: str, low: int, high: int | None) -> Any:
    """One `<parameter=k>` holding a string of low..high characters, on one line. Written as one EBNF
    with a class that excludes the newline: xgrammar 0.2.9 took 3-6 s to compile a counted repetition
    joined to the closing tag by Grammar.concat, or one whose class takes the tag's leading newline;
    this form compiles in about 0.05 s at any bound."""
    opening = json.dumps(f"<parameter={key}>\n", ensure_ascii=False)
    closing = json.dumps("\n</parameter>\n")
    count = f"{{{low},{'' if high is None else high}}}"
    return xgr.Grammar.from_ebnf(f"root ::= {opening} char{count} {closing}\nchar ::= [^<\\n]")


def _xml_call(xgr: Any, tool: ToolSchema) -> Any:
    """Qwen3.5's call body: `<function=f>\\n` then `<parameter=k>\\nvalue\\n</parameter>\\n` per
    property in the schema's order (the optional ones may be left out), then `</function>`."""
    schema = json.loads(tool.parameters)
    props = schema.get("properties") or {} if isinstance(schema, dict) else {}
    required = set(schema.get("required") or []) if isinstance(schema, dict) else set()
    parts = [_literal(xgr, f"<function={tool.name}>\n")]
    for key, sub in props.items():
        bounds = _length_bounds(sub)
        if bounds is not None:
            param = _bounded_xml_param(xgr, key, *bounds)
        else:
            param = xgr.Grammar.concat(_literal(xgr, f"<parameter={key}>\n"), _xml_value(xgr, sub),
                                       _literal(xgr, "\n</parameter>\n"))
        parts.append(param if key in required else xgr.Grammar.union(_literal(xgr, ""), param))
    parts.append(_literal(xgr, "</function>"))
    return xgr.Grammar.concat(*parts)


# xgrammar (0.2.9) writes a string with minLength / maxLength as a run of one character class,
# `[^"\\\r\n]`, that lets a raw tab or NUL through (invalid JSON: `json.loads` and pydantic refuse it)
# and no escape at all; its unbounded strings (`basic_string`) exclude U+0000-U+001F and allow escapes.
# The bounded class is rewritten to the same characters as basic_string, one escape counting as one.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\] | "\\" [\"\\/bfnrt] | "\\u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]'


def json_schema_grammar(xgr: Any, schema: str, *, strict_mode: bool = True, any_whitespace: bool = False) -> Any:
    """xgrammar's grammar of a JSON schema, its length-bounded strings limited to valid JSON characters."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace, strict_mode=strict_mode)
    text = str(grammar)
    if _BOUNDED_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def build_grammar(xgr: Any, c: OutputConstraint) -> Any:
    """The xgrammar Grammar of a constraint (JSON with no free whitespace for a model to ramble in:
    xgrammar's fixed separators, `", "` and `": "`)."""
    if c.kind == "json_object":
        return json_schema_grammar(xgr, json.dumps({"type": "object"}), strict_mode=False)
    if c.kind == "json_schema":
        assert c.schema is not None
        return json_schema_grammar(xgr, c.schema, strict_mode=c.strict)
    if c.tool_format == "qwen3_xml":
        bodies = [_xml_call(xgr, t) for t in c.tools]
        body = bodies[0] if len(bodies) == 1 else xgr.Grammar.union(*bodies)
    else:
        schema = {"anyOf": [_call_schema(t) for t in c.tools]} if len(c.tools) > 1 else _call_schema(c.tools[0])
        body = json_schema_grammar(xgr, json.dumps(schema))
    call = xgr.Grammar.concat(_literal(xgr, "<tool_call>\n"), body, _literal(xgr, "\n</tool_call>"))
    calls = call
    for _ in range(MAX_PARALLEL_CALLS - 1 if c.parallel else 0):
        calls = xgr.Grammar.union(call, xgr.Grammar.concat(call, _literal(xgr, "\n"), calls))
    return calls


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe; an LRU of compiled grammars by constraint.

    Every compilation runs on one background thread. `compile` waits for it at most `timeout_s`;
    `submit` returns its future, for a caller that must not wait (the tokenizer worker and the
    engine's step loop keep serving other requests meanwhile). A compilation that outlives its wait
    is refused (its thread finishes on its own, and later compilations queue behind it, so a hostile
    schema costs one thread, never more)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_limit_bytes=cache_bytes)
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.cache_bytes = cache_bytes
        self._cached_bytes = 0

    def compile(self, c: OutputConstraint) -> Any:
        """The CompiledGrammar of `c`; GrammarError naming the request field when it cannot be built."""
        hit = self.lookup(c)
        if hit is not None:
            return hit
        future = self.submit(c)
        concurrent.futures.wait([future], timeout=self.timeout_s)
        return self.finish(future, c)

    def lookup(self, c: OutputConstraint) -> Any | None:
        """`c`'s CompiledGrammar if it is cached, else None."""
        key = c.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def submit(self, c: OutputConstraint) -> concurrent.futures.Future[Any]:
        """Compile `c` on the background thread: the future's result is the CompiledGrammar (cached), or
        it raises GrammarError naming the request field. The caller bounds its wait (`timeout_error`)."""
        return self._pool.submit(self._compile_and_cache, c)

    def finish(self, future: concurrent.futures.Future[Any], c: OutputConstraint) -> Any:
        """The outcome of `submit(c)` once it is done or its caller's wait is over: the CompiledGrammar,
        or GrammarError (a compilation still running is refused as too slow, and cancelled if it had
        not started, so that a flood of them does not queue)."""
        if not future.done():
            future.cancel()
            raise self.timeout_error(c)
        return future.result()

    def timeout_error(self, c: OutputConstraint) -> GrammarError:
        param = _param(c)
        return GrammarError(f"the {param} grammar took longer than {self.timeout_s:g} s to compile", param)

    def _compile_and_cache(self, c: OutputConstraint) -> Any:
        hit = self.lookup(c)  # queued behind a compilation of the same constraint
        if hit is not None:
            return hit
        try:
            compiled = self._compiler.compile_grammar(build_grammar(self.xgr, c))
        except GrammarError:
            raise
        except Exception as e:  # xgrammar's RuntimeError / ValueError: the schema's fault
            param = _param(c)
            raise GrammarError(f"the {param} schema cannot be compiled: {_reason(e)}", param) from None
        with self._lock:
            key = c.cache_key()
            if key not in self._cache:
                self._cache[key] = compiled
                self._cached_bytes += compiled.memory_size_bytes
            while len(self._cache) > 1 and (len(self._cache) > MAX_CACHED_GRAMMARS
                                             or self._cached_bytes > self.cache_bytes):
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.memory_size_bytes
        return compiled

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
