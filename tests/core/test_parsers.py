"""Reasoning and tool-call parsers on scripted Qwen3 output, whole and split into random deltas."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mllmd.checkpoint.tokenizer import DATA_DIR
from mllmd.openai.reasoning_parser import (
    ReasoningParser,
    get_reasoning_parser,
    prompt_ends_in_reasoning,
    reasoning_parser_names,
)
from mllmd.openai.tool_parser import (
    ContentDelta,
    Qwen35ToolParser,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    convert_parameter,
    get_tool_parser,
    tool_parser_names,
)
from mllmd.testing.checkpoints import shared_models_dir


def template_file(relpath: str) -> Path:
    """A real model file from shared/models, else the copy packaged in mllmd/checkpoint/data."""
    for root in (shared_models_dir(), DATA_DIR):
        if (root / relpath).is_file():
            return root / relpath
    pytest.skip(f"{relpath} not present")


def _random_chunks(text: str, seed: int, max_size: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, max_size)
        out.append(text[i : i + n])
        i += n
    return out


def splittings(text: str) -> Iterator[list[str]]:
    """The text whole, one character at a time, and 40 random splits (sizes 1..3 and 1..12)."""
    yield [text]
    yield list(text)
    for seed in range(20):
        yield _random_chunks(text, seed, 3)
        yield _random_chunks(text, seed, 12)


# --------------------------------------------------------------------------- reasoning


def stream_reasoning(parser: ReasoningParser, chunks: list[str]) -> tuple[str, str]:
    s = parser.stream()
    r, c = [], []
    for chunk in chunks:
        dr, dc = s.feed(chunk)
        r.append(dr)
        c.append(dc)
    dr, dc = s.flush()
    return "".join(r) + dr, "".join(c) + dc


REASONING_CASES = [
    # (id, model output, starts_in_reasoning, reasoning, content)
    ("think_then_answer", "<think>\nLet me think.\nStep 2.\n</think>\n\nThe answer is 4.", False,
     "Let me think.\nStep 2.", "The answer is 4."),
    ("no_thinking", "Hello there!\nSecond line.", False, None, "Hello there!\nSecond line."),
    ("starts_in_reasoning", "Considering...\n</think>\n\nDone.", True, "Considering...", "Done."),
    ("starts_in_reasoning_with_tag", "<think>\nr\n</think>\n\nc", True, "r", "c"),
    ("empty_think_block", "<think>\n\n</think>\n\nHi", False, "", "Hi"),
    ("empty_block_in_reasoning", "\n</think>\n\nHi", True, "", "Hi"),
    ("unterminated", "<think>\nstill going\nand going", False, "still going\nand going", ""),
    ("unterminated_in_reasoning", "still going <", True, "still going <", ""),
    ("leading_whitespace", "\n <think>\nx\n</think>\n\ny", False, "x", "y"),
    ("tag_lookalikes", "<think>\na < b </thinking> </thin c\n</think>\n\nok <", False,
     "a < b </thinking> </thin c", "ok <"),
    ("blank_lines_kept", "<think>\nA\n\nB\n\n</think>\n\nC\n\nD\n", False, "A\n\nB\n", "C\n\nD\n"),
    ("later_tags_are_content", "<think>\nr\n</think>\n\nsee <think> and </think>", False, "r",
     "see <think> and </think>"),
    ("end_tag_without_reasoning", "a </think> b", False, None, "a </think> b"),
    ("no_newlines", "<think>r</think>c", False, "r", "c"),
    ("unicode", "<think>\n思考 🤔 ü\n</think>\n\n答案 ✓", False, "思考 🤔 ü", "答案 ✓"),
    ("partial_open_tag_at_end", "<thi", False, None, "<thi"),
    ("whitespace_only", "  \n", False, None, "  \n"),
    ("empty", "", False, None, ""),
    ("empty_in_reasoning", "", True, "", ""),
]


@pytest.mark.parametrize(("text", "starts", "reasoning", "content"),
                         [c[1:] for c in REASONING_CASES], ids=[c[0] for c in REASONING_CASES])
def test_reasoning_extract_and_stream(text: str, starts: bool, reasoning: str | None, content: str) -> None:
    parser = get_reasoning_parser("qwen3")(starts_in_reasoning=starts)
    assert parser.extract(text) == (reasoning, content)
    for chunks in splittings(text):
        assert stream_reasoning(parser, chunks) == (reasoning or "", content), chunks


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_REASONING_CASES = [
    # (id, model output, starts_in_reasoning, ends_at_tool_call, reasoning, content)
    ("call_in_unclosed_reasoning", "I need the weather.\n\n" + CALL, True, True, "I need the weather.", CALL),
    ("call_in_unclosed_tagged_reasoning", "<think>\nWeather first.\n" + CALL, False, True, "Weather first.", CALL),
    ("without_tools_it_stays_reasoning", "I need the weather.\n\n" + CALL, True, False,
     "I need the weather.\n\n" + CALL, ""),
    ("call_after_closed_reasoning", "r\n</think>\n\n" + CALL, True, True, "r", CALL),
    ("call_right_away", CALL, True, True, "", CALL),
    ("partial_tag_at_end_stays_reasoning", "thinking <tool_ca", True, True, "thinking <tool_ca", ""),
    ("newlines_kept_without_a_call", "a\n\nb\n\n", True, True, "a\n\nb\n\n", ""),
    ("no_reasoning_section", "plain " + CALL, False, True, None, "plain " + CALL),
]


@pytest.mark.parametrize(("text", "starts", "ends", "reasoning", "content"),
                         [c[1:] for c in TOOL_REASONING_CASES], ids=[c[0] for c in TOOL_REASONING_CASES])
def test_a_tool_call_ends_an_unclosed_reasoning(text: str, starts: bool, ends: bool, reasoning: str | None,
                                                content: str) -> None:
    parser = ReasoningParser(starts, ends_at_tool_call=ends)
    assert parser.extract(text) == (reasoning, content)
    for chunks in splittings(text):
        assert stream_reasoning(parser, chunks) == (reasoning or "", content), chunks


def test_a_tool_call_inside_an_unclosed_thinking_block_is_a_call() -> None:
    """Qwen3.5-4B/9B think by default; a call made before closing `<think>` reaches the client as a call."""
    turn = "The user wants the weather.\n\n" + CALL
    for chunks in splittings(turn):
        dicts, finish = openai_stream(turn, True, get_tool_parser("qwen3")(tools=WEATHER_TOOLS, make_id=counter_ids),
                                      chunks)
        reasoning, content, calls = accumulate(
            [pytest.importorskip("openai").types.chat.ChatCompletionChunk.model_validate(d) for d in dicts])
        assert finish == "tool_calls" and reasoning == "The user wants the weather." and not content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(("size", "thinks"), [("0.8B", False), ("2B", False), ("4B", True), ("9B", True)])
def test_qwen3_5_thinking_defaults_by_size(size: str, thinks: bool) -> None:
    """The 0.8B/2B templates do not think unless asked, 4B/9B do unless told not to; the prompt says
    which (what the tokenizer worker passes on as starts_in_reasoning)."""
    relpath = f"Qwen3.5-{size}/chat_template.jinja"
    messages = [{"role": "user", "content": "hi"}]
    default = _render(relpath, None, messages=messages, add_generation_prompt=True)
    assert prompt_ends_in_reasoning(default) == thinks
    for enable in (True, False):
        prompt = _render(relpath, None, messages=messages, add_generation_prompt=True, enable_thinking=enable)
        assert prompt_ends_in_reasoning(prompt) == enable, (size, enable)


def test_reasoning_streams_eagerly() -> None:
    """Only a possible "\\n</think>" is held back; tags split across deltas are still found."""
    text = "<think>\nabc def ghi\n</think>\n\nxyz"
    s = ReasoningParser().stream()
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>\nabc") == ("abc", "")
    assert s.in_reasoning and not s.reasoning_ended
    assert s.feed(" def ghi\n</thi") == (" def ghi", "")
    assert s.feed("nk>\n") == ("", "")
    assert s.reasoning_ended and not s.in_reasoning
    assert s.feed("\nxyz") == ("", "xyz")
    assert s.flush() == ("", "")
    # One character at a time, what is emitted never lags the input by more than "\n</think>".
    s = ReasoningParser().stream()
    emitted = 0
    for i, ch in enumerate(text[: text.index("</think>")]):
        r, c = s.feed(ch)
        emitted += len(r) + len(c)
        assert (i + 1) - emitted <= len("<think>\n") + len("\n</think>")


def test_prompt_ends_in_reasoning() -> None:
    assert prompt_ends_in_reasoning("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert not prompt_ends_in_reasoning("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert not prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # A literal "<think>" in an earlier user turn does not count.
    assert not prompt_ends_in_reasoning("<|im_start|>user\nsay <think><|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------- tool calls


def counter_ids(i: int) -> str:
    return f"call_{i:04d}"


def call_text(name: str, args: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def stream_tools(parser: ToolCallParser, chunks: list[str]) -> tuple[str, list[ToolCall], list[Any]]:
    """Feed chunks; rebuild content and calls from the deltas the way an OpenAI client does."""
    s = parser.stream()
    events = [e for chunk in chunks for e in s.feed(chunk)] + s.flush()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, dict[str, str]] = {}
    for e in events:
        if isinstance(e, ContentDelta):
            continue
        if e.id is not None:  # the first delta of a call
            assert e.index not in calls and e.index == len(calls) and e.arguments == ""
            calls[e.index] = {"id": e.id, "name": e.name or "", "arguments": ""}
        else:
            assert e.name is None
            calls[e.index]["arguments"] += e.arguments
    assert [c.id for c in s.tool_calls] == [c["id"] for c in calls.values()]
    return content, [ToolCall(c["id"], c["name"], c["arguments"]) for c in calls.values()], events


NESTED_ARGS = {
    "query": {"text": "Zürich – 東京 🚀", "quote": 'say "hi" {not json} \\ back', "empty": {}},
    "tags": ["a", {"b": [1, 2.5, None, True, False]}, []],
    "limit": -3,
}

TOOL_CASES = [
    # (id, model output (content side), content, [(name, arguments)])
    ("single", call_text("get_weather", {"city": "Paris"}), "", [("get_weather", {"city": "Paris"})]),
    ("content_then_multiple",
     "Let me check both.\n" + call_text("a", {"x": 1}) + "\n" + call_text("b", {"y": "z"}),
     "Let me check both.", [("a", {"x": 1}), ("b", {"y": "z"})]),
    ("nested_unicode", "Sure — 好的.\n\n" + call_text("search", NESTED_ARGS), "Sure — 好的.",
     [("search", NESTED_ARGS)]),
    ("no_arguments", '<tool_call>\n{"name": "now"}\n</tool_call>', "", [("now", {})]),
    ("arguments_as_string", '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": [1]}"}\n</tool_call>', "",
     [("f", {"x": [1]})]),
    ("compact_no_newlines", 'x<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>', "x", [("f", {"a": 1})]),
    ("text_after_call", call_text("f", {}) + "\n\nDone <", "Done <", [("f", {})]),
    ("plain_text_lookalikes", "a <b> <tool\nc\n<tool_cal", "a <b> <tool\nc\n<tool_cal", []),
    ("malformed_json",
     'Try:\n<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',
     'Try:\n<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>', []),
    ("malformed_then_valid",
     '<tool_call>\n{"name": f}\n</tool_call>\n' + call_text("g", {"k": "v"}),
     '<tool_call>\n{"name": f}\n</tool_call>', [("g", {"k": "v"})]),
    ("not_an_object", "<tool_call>\n[1, 2]\n</tool_call>", "<tool_call>\n[1, 2]\n</tool_call>", []),
    ("missing_name", '<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    ("arguments_not_object", '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
     '<tool_call>{"name": "f", "arguments": 3}</tool_call>', []),
    ("nan_is_malformed", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
    ("unterminated", 'Hi\n<tool_call>\n{"name": "f", "argu', 'Hi\n<tool_call>\n{"name": "f", "argu', []),
    ("xml_is_not_qwen3_json", "<tool_call>\n<function=f>\n</function>\n</tool_call>",
     "<tool_call>\n<function=f>\n</function>\n</tool_call>", []),
    ("empty", "", "", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), [c[1:] for c in TOOL_CASES], ids=[c[0] for c in TOOL_CASES])
def test_tool_calls_extract_and_stream(text: str, content: str, calls: list[tuple[str, Any]]) -> None:
    parser = get_tool_parser("qwen3")(make_id=counter_ids)
    got_content, got_calls = parser.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert [c.id for c in got_calls] == [counter_ids(i) for i in range(len(calls))]
    for chunks in splittings(text):
        s_content, s_calls, _ = stream_tools(parser, chunks)
        assert (s_content, s_calls) == (got_content, got_calls), chunks


def test_arguments_are_json_text_keeping_unicode() -> None:
    _, [call] = ToolCallParser().extract(call_text("search", NESTED_ARGS))
    assert json.loads(call.arguments) == NESTED_ARGS
    assert "東京 🚀" in call.arguments  # ensure_ascii=False


def test_default_ids_unique() -> None:
    text = "".join(call_text(f"f{i}", {"i": i}) for i in range(50))
    _, calls = ToolCallParser().extract(text)
    ids = [c.id for c in calls]
    assert len(ids) == 50 and len(set(ids)) == 50
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_tool_stream_holds_back_only_a_possible_tag() -> None:
    s = ToolCallParser(make_id=counter_ids).stream()
    assert s.feed("Let me look") == [ContentDelta("Let me look")]
    assert s.feed(" it up.\n<tool") == [ContentDelta(" it up.")]
    assert s.feed('_call>\n{"name": "f", "arguments": {"q": 1}}\n</tool_') == []
    assert s.feed("call>\n") == [ToolCallDelta(0, id="call_0000", name="f", arguments=""),
                                  ToolCallDelta(0, arguments='{"q": 1}')]
    assert s.flush() == []


# --------------------------------------------------------------------------- Qwen3.5 XML form

WEATHER_TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "temp": {"type": ["number", "null"]},
                "zip": {"type": "string"},
                "opts": {"type": "object"},
                "hours": {"type": "array"},
            },
        },
    },
}]

XML_CALL = (
    "Checking.\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    "<parameter=metric>\nTrue\n</parameter>\n<parameter=temp>\n-1.5\n</parameter>\n"
    "<parameter=zip>\n01234\n</parameter>\n<parameter=opts>\n{\"a\": [1, \"<x>\"]}\n</parameter>\n"
    "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=note>\nline 1\n\nline 3\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>"
)


def test_qwen3_5_xml_calls() -> None:
    parser = get_tool_parser("qwen3_5")(tools=WEATHER_TOOLS, make_id=counter_ids)
    content, calls = parser.extract(XML_CALL)
    assert content == "Checking."
    assert [c.name for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0].arguments) == {
        "city": "New York", "days": 3, "metric": True, "temp": -1.5, "zip": "01234",
        "opts": {"a": [1, "<x>"]}, "hours": [1, 2], "note": "line 1\n\nline 3",
    }
    assert calls[1].arguments == "{}"
    for chunks in splittings(XML_CALL):
        assert stream_tools(parser, chunks)[:2] == (content, calls)


def test_qwen3_5_without_schema_keeps_strings() -> None:
    _, [call] = Qwen35ToolParser().extract(XML_CALL.split("\n<tool_call>\n<function=now>")[0])
    args = json.loads(call.arguments)
    assert args["days"] == "3" and args["metric"] == "True" and args["opts"] == {"a": [1, "<x>"]}


@pytest.mark.parametrize("body", [
    "<function=f>\n<parameter=x>\n1\n</parameter>\nstray text\n</function>",  # text between parameters
    "<function=f>\n<parameter=x>\n1\n</parameter>\n<parameter=x>\n2\n</parameter>\n</function>",  # repeated
    "<function=f>\n<parameter=x>\n1\n",  # unclosed
    "<function=>\n</function>",  # no name
    "{not json}",
])
def test_qwen3_5_malformed_stays_content(body: str) -> None:
    text = f"a\n<tool_call>\n{body}\n</tool_call>"
    assert Qwen35ToolParser().extract(text) == (text, [])


def test_qwen3_5_accepts_json_form() -> None:
    _, [call] = Qwen35ToolParser().extract(call_text("f", {"x": 1}))
    assert (call.name, json.loads(call.arguments)) == ("f", {"x": 1})


def test_convert_parameter() -> None:
    assert convert_parameter("7", {"type": "integer"}) == 7
    assert convert_parameter("7.0", {"type": "integer"}) == "7.0"  # does not fit: kept as text
    assert convert_parameter("2e3", {"type": "number"}) == 2000.0
    assert convert_parameter("inf", {"type": "number"}) == "inf"
    assert convert_parameter("false", {"type": "boolean"}) is False
    assert convert_parameter("None", {"anyOf": [{"type": "string"}, {"type": "null"}]}) is None
    assert convert_parameter("[1]", {"type": "string"}) == "[1]"
    assert convert_parameter("[1]", None) == [1]


# --------------------------------------------------------------------------- registry


def test_registry() -> None:
    assert get_reasoning_parser("qwen3") is ReasoningParser
    assert get_tool_parser("qwen3") is ToolCallParser and get_tool_parser("hermes") is ToolCallParser
    assert get_tool_parser("qwen3_5") is Qwen35ToolParser
    assert "qwen3" in reasoning_parser_names() and "qwen3_5" in tool_parser_names()
    with pytest.raises(ValueError, match="'nope'.*qwen3"):
        get_reasoning_parser("nope")
    with pytest.raises(ValueError, match="'nope'.*hermes"):
        get_tool_parser("nope")


# --------------------------------------------------------------------------- OpenAI shapes


def openai_stream(text: str, starts_in_reasoning: bool, tool_parser: ToolCallParser,
                  chunks: list[str]) -> tuple[list[dict[str, Any]], str]:
    """Reasoning parser -> tool parser -> OpenAI chunk dicts, as the server builds them (a request with
    tools: a tool call ends an unclosed reasoning)."""
    reasoning = ReasoningParser(starts_in_reasoning, ends_at_tool_call=True).stream()
    tools = tool_parser.stream()

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "qwen3",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""})]

    def emit(r: str, events: list[Any]) -> None:
        if r:
            out.append(chunk({"reasoning_content": r}))
        for e in events:
            if isinstance(e, ContentDelta):
                out.append(chunk({"content": e.text}))
            else:
                out.append(chunk({"tool_calls": [e.to_openai()]}))

    for piece in chunks:
        r, c = reasoning.feed(piece)
        emit(r, tools.feed(c))
    r, c = reasoning.flush()
    emit(r, tools.feed(c) + tools.flush())
    finish = "tool_calls" if tools.tool_calls else "stop"
    out.append(chunk({}, finish))
    return out, finish


def accumulate(chunks: list[Any]) -> tuple[str, str, list[dict[str, Any]]]:
    """What an OpenAI client rebuilds from validated ChatCompletionChunk objects."""
    reasoning, content, calls = "", "", {}
    for ch in chunks:
        delta = ch.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "type": None, "function": {"name": "", "arguments": ""}})
            if tc.id:
                entry["id"], entry["type"] = tc.id, tc.type
            if tc.function and tc.function.name:
                entry["function"]["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                entry["function"]["arguments"] += tc.function.arguments
    return reasoning, content, [calls[i] for i in sorted(calls)]


REPLY = ("<think>\nThe user wants the weather in two cities; I'll call get_weather twice.\n</think>\n\n"
         "Checking both — 稍等.\n" + call_text("get_weather", {"city": "Paris"}) + "\n"
         + call_text("get_weather", {"city": "東京", "opts": {"units": ["C"]}}))


def test_openai_shapes_validate_and_match_non_streaming() -> None:
    from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageToolCall

    parser = ToolCallParser(make_id=counter_ids)
    reasoning, content = ReasoningParser().extract(REPLY)
    content, calls = parser.extract(content)
    assert reasoning == "The user wants the weather in two cities; I'll call get_weather twice."
    assert content == "Checking both — 稍等." and len(calls) == 2
    message_calls = [ChatCompletionMessageToolCall.model_validate(c.to_openai()) for c in calls]
    assert message_calls[1].function.name == "get_weather"
    assert json.loads(message_calls[1].function.arguments) == {"city": "東京", "opts": {"units": ["C"]}}
    completion = ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "qwen3",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": content, "reasoning_content": reasoning,
            "tool_calls": [c.to_openai() for c in calls]}}],
    })
    assert completion.choices[0].message.tool_calls == message_calls

    for chunks in splittings(REPLY):
        dicts, finish = openai_stream(REPLY, False, parser, chunks)
        assert finish == "tool_calls"
        validated = [ChatCompletionChunk.model_validate(d) for d in dicts]
        s_reasoning, s_content, s_calls = accumulate(validated)
        assert (s_reasoning, s_content) == (reasoning, content)
        assert s_calls == [c.to_openai() for c in calls]


def test_tool_call_delta_shapes() -> None:
    head = ToolCallDelta(1, id="call_x", name="f", arguments="").to_openai()
    assert head == {"index": 1, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert ToolCallDelta(1, arguments='{"a"').to_openai() == {"index": 1, "function": {"arguments": '{"a"'}}


# --------------------------------------------------------------------------- real chat templates


def _render(relpath: str, key: str | None, **kwargs: Any) -> str:
    jinja2 = pytest.importorskip("jinja2")
    source = template_file(relpath).read_text()
    if key is not None:
        source = json.loads(source)[key]

    def raise_exception(msg: str) -> None:
        raise jinja2.TemplateError(msg)

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, **_: json.dumps(x, ensure_ascii=False)  # as transformers does
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(**kwargs)


TEMPLATE_MESSAGES = [
    {"role": "user", "content": "Weather in Paris and 東京?"},
    {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two cities.\n\nTwo calls.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
                    {"type": "function", "function": {"name": "get_weather",
                                                      "arguments": {"city": "東京", "metric": True}}}]},
]


@pytest.mark.parametrize(("model", "key", "tool_parser", "enable_thinking"), [
    ("Qwen3-0.6B/tokenizer_config.json", "chat_template", "qwen3", None),
    ("Qwen3.5-0.8B/chat_template.jinja", None, "qwen3_5", True),
])
def test_round_trip_through_real_template(model: str, key: str | None, tool_parser: str,
                                          enable_thinking: bool | None) -> None:
    """Render an assistant turn with the model's own template; the parsers recover it exactly."""
    kwargs: dict[str, Any] = {"tools": WEATHER_TOOLS}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    prompt = _render(model, key, messages=TEMPLATE_MESSAGES[:1], add_generation_prompt=True, **kwargs)
    full = _render(model, key, messages=TEMPLATE_MESSAGES, **kwargs)
    assert full.startswith(prompt[: prompt.rindex("<|im_start|>assistant\n")])
    turn = full[full.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n") :]
    turn = turn.removesuffix("<|im_end|>\n")
    starts = prompt_ends_in_reasoning(prompt)
    assert starts == bool(enable_thinking)
    if starts:  # the model continues after the prompt's "<think>\n"
        assert turn.startswith("<think>\n") and prompt.endswith("<think>\n")
        turn = turn.removeprefix("<think>\n")
    parser = get_tool_parser(tool_parser)(tools=WEATHER_TOOLS, make_id=counter_ids)
    for chunks in splittings(turn):
        dicts, finish = openai_stream(turn, starts, parser, chunks)
        reasoning, content, calls = accumulate(
            [pytest.importorskip("openai").types.chat.ChatCompletionChunk.model_validate(d) for d in dicts])
        assert finish == "tool_calls"
        assert reasoning == "Two cities.\n\nTwo calls." and content == "Checking both."
        expected = [tc["function"] for tc in TEMPLATE_MESSAGES[1]["tool_calls"]]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (f["name"], f["arguments"]) for f in expected]


def test_thinking_disabled_prompt() -> None:
    """enable_thinking=False puts the empty block in the prompt: the reply is plain content."""
    prompt = _render("Qwen3-0.6B/tokenizer_config.json", "chat_template",
                     messages=TEMPLATE_MESSAGES[:1], add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n") and not prompt_ends_in_reasoning(prompt)
    assert ReasoningParser(prompt_ends_in_reasoning(prompt)).extract("Sunny.") == (None, "Sunny.")


# --------------------------------------------------------------------------- properties

FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n", "\n\n", " ", "<", "</", "<thi",
             "</tool_", "x", "é", "{", "}", '{"name": "f", "arguments": {"a": [1, "b"]}}', '{"name": "g"}',
             "<function=f>", "</function>", "<parameter=p>", "</parameter>", "3"]


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=25), st.lists(st.integers(0, 10_000), max_size=30),
       st.booleans(), st.sampled_from(["qwen3", "qwen3_5"]))
def test_streaming_equals_non_streaming(fragments: list[str], cuts: list[int], starts: bool, name: str) -> None:
    text = "".join(fragments)
    chunks = _split(text, cuts)
    assert "".join(chunks) == text

    for ends in (False, True):
        rparser = ReasoningParser(starts, ends_at_tool_call=ends)
        reasoning, content = rparser.extract(text)
        assert stream_reasoning(rparser, chunks) == (reasoning or "", content)
        if reasoning is None:
            assert content == text  # nothing is lost or rewritten without a reasoning section

    tparser = get_tool_parser(name)(make_id=counter_ids)
    t_content, t_calls = tparser.extract(text)
    assert stream_tools(tparser, chunks)[:2] == (t_content, t_calls)
    if not t_calls:
        assert t_content == text  # framing is only removed around real calls
    for c in t_calls:
        assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize("make_parser", [lambda: ToolCallParser(), lambda: Qwen35ToolParser()])
def test_never_raises_on_garbage(make_parser: Callable[[], ToolCallParser]) -> None:
    rng = random.Random(0)
    alphabet = "<>/{}[]\":,\n =tool_call function parameter name arguments 0123 \\ \x00 é"
    for _ in range(300):
        body = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        text = f"<tool_call>{body}</tool_call>" if rng.random() < 0.7 else body
        content, calls = make_parser().extract(text)
        assert calls or content == text
    deep = "<tool_call>" + '{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"
    assert ToolCallParser().extract(deep) == (deep, [])
