"""Qwen3 thinking and tool-call parsing end to end, on scripted model output.

The daemon runs with MLLMD_TESTING_SCRIPT (see mllmd/testing/scripted.py): the scheduler's sampler
emits the scripts below in turn (request k gets script k mod 3), then EOS. Each response is matched
to its script by its reasoning text, so the tests do not depend on the order requests arrive in;
sending three requests in a row covers every script. The daemon runs with the default configuration:
the parsers are chosen from the model (`auto`), nothing is configured. The Responses API gets the same
parsing as output items (reasoning, message, function_call), and its function-call round trip renders
the prompt the same chat conversation does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .conftest import short_tmpdir, start_daemon, stop_and_check

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-qwen3"
TOOL = (
    '<think>\nI should call a tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris"}}\n</tool_call>'
)
ANSWER = "<think>\nThe user says hi.\nSo I greet them.\n</think>\n\nHello! How can I help? \u00e9\u4f60\u597d"
TWO_TOOLS = (
    '<think>\nTwo cities.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}\n'
    "</tool_call>"
)
SCRIPTS = [TOOL, ANSWER, TWO_TOOLS]
# reasoning text -> (script, expected content, expected tool calls)
EXPECTED: dict[str, tuple[str, str | None, list[dict[str, Any]]]] = {
    "I should call a tool.": (TOOL, None, [{"name": "get_weather", "arguments": {"city": "Paris"}}]),
    "The user says hi.\nSo I greet them.": (ANSWER, "Hello! How can I help? \u00e9\u4f60\u597d", []),
    "Two cities.": (TWO_TOOLS, None, [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                      {"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}]),
}
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                       "required": ["city"]},
    },
}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def scripted(tiny_model: Path) -> Any:
    d = short_tmpdir()
    script = d / "script.json"
    script.write_text(json.dumps(SCRIPTS))
    # no parser options: a Qwen3 model gets the qwen3 reasoning and tool-call parsers by default (auto)
    daemon = start_daemon(tiny_model, env={"MLLMD_TESTING_SCRIPT": str(script)})
    yield daemon
    stop_and_check(daemon)


@pytest.fixture(scope="module")
def client(scripted: Any) -> Any:
    return scripted.openai()


def _check(reasoning: str | None, content: str | None, calls: list[dict[str, Any]], finish: str,
           completion_tokens: int | None, tokenizer: Any) -> str:
    assert reasoning in EXPECTED, f"unexpected reasoning {reasoning!r} (content {content!r})"
    script, want_content, want_calls = EXPECTED[reasoning]
    assert (content or None) == want_content
    assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls] == want_calls
    assert all(c["id"] and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    assert finish == ("tool_calls" if want_calls else "stop")
    if completion_tokens is not None:  # the script, then EOS
        assert completion_tokens == len(tokenizer.encode(script, add_special_tokens=False)) + 1
    return script


def test_scripted_non_streaming(client: Any, tokenizer: Any) -> None:
    seen = set()
    for _ in range(len(SCRIPTS)):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200)
        c = r.choices[0]
        reasoning = (c.message.model_extra or {}).get("reasoning_content")
        assert (c.message.model_extra or {}).get("reasoning") == reasoning  # both names, same text
        calls = [{"id": t.id, "type": t.type, "name": t.function.name, "arguments": t.function.arguments}
                 for t in c.message.tool_calls or []]
        seen.add(_check(reasoning, c.message.content, calls, c.finish_reason, r.usage.completion_tokens, tokenizer))
    assert seen == set(SCRIPTS)


def test_scripted_streaming(client: Any, tokenizer: Any) -> None:
    seen = set()
    for _ in range(len(SCRIPTS)):
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                stream=True, stream_options={"include_usage": True})
        reasoning, content = [], []
        calls: dict[int, dict[str, Any]] = {}
        finish = []
        usage = None
        n_chunks = 0
        for ch in stream:
            n_chunks += 1
            if ch.usage is not None:
                usage = ch.usage
            if not ch.choices:
                continue
            delta = ch.choices[0].delta
            extra = delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")  # both names, same text
            if extra.get("reasoning_content"):
                reasoning.append(extra["reasoning_content"])
            if delta.content:
                content.append(delta.content)
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "type": None, "name": "", "arguments": ""})
                if tc.id:
                    assert entry["id"] is None, "a tool call's id is sent once"
                    entry["id"], entry["type"] = tc.id, tc.type
                if tc.function and tc.function.name:
                    entry["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
            if ch.choices[0].finish_reason:
                finish.append(ch.choices[0].finish_reason)
        assert len(finish) == 1, finish
        assert usage is not None
        text = "".join(reasoning)
        ordered = [calls[i] for i in sorted(calls)]
        assert sorted(calls) == list(range(len(calls)))
        seen.add(_check(text, "".join(content) or None, ordered, finish[0], usage.completion_tokens, tokenizer))
        assert n_chunks > 3  # really streamed in pieces
    assert seen == set(SCRIPTS)


def test_scripted_without_tools_keeps_text(client: Any) -> None:
    """Without `tools` the tool-call markup stays in the content; reasoning is still split off."""
    seen = set()
    for _ in range(len(SCRIPTS)):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200)
        c = r.choices[0]
        reasoning = (c.message.model_extra or {}).get("reasoning_content")
        assert reasoning in EXPECTED
        script = EXPECTED[reasoning][0]
        seen.add(script)
        assert not c.message.tool_calls
        assert c.finish_reason == "stop"
        assert c.message.content == script.split("</think>\n\n", 1)[1]
    assert seen == set(SCRIPTS)


def test_scripted_tool_choice_none(client: Any) -> None:
    seen = set()
    for _ in range(len(SCRIPTS)):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=200)
        c = r.choices[0]
        assert not c.message.tool_calls and c.finish_reason == "stop"
        seen.add(EXPECTED[(c.message.model_extra or {}).get("reasoning_content")][0])
    assert seen == set(SCRIPTS)


def test_scripted_completions_are_raw(scripted: Any) -> None:
    """/v1/completions does no parsing: the text is the script verbatim (special tags included)."""
    seen = set()
    with scripted.http() as h:
        for _ in range(len(SCRIPTS)):
            r = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 200})
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
            assert text in SCRIPTS
            seen.add(text)
    assert seen == set(SCRIPTS)


def test_thinking_is_split_by_default(scripted: Any) -> None:
    """With no configuration, a Qwen3 model's thinking comes back as reasoning_content and reasoning
    (the same text), apart from the content, streamed and not, over plain HTTP (no SDK in between)."""
    want = {r: w for r, (_, w, calls) in EXPECTED.items() if not calls}  # the answer script
    with scripted.http(timeout=60) as http:
        full = stream = None
        for _ in range(len(SCRIPTS)):  # one of each three requests gets the answer script
            msg = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}).json()
            msg = msg["choices"][0]["message"]
            if msg.get("reasoning_content") in want:
                full = msg
        for _ in range(len(SCRIPTS)):
            body = http.post("/v1/chat/completions",
                             json={"model": MODEL, "messages": MESSAGES, "stream": True}).text
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in body.splitlines()
                      if line.startswith("data: {") and '"choices":[{' in line]
            assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
            text = "".join(d.get("reasoning_content") or "" for d in deltas)
            if text in want:
                stream = (text, "".join(d.get("content") or "" for d in deltas))
    assert full is not None and stream is not None
    reasoning = full["reasoning_content"]
    assert full["reasoning"] == reasoning and full["content"] == want[reasoning]
    assert "<think>" not in full["content"] and "</think>" not in full["content"]
    assert stream == (reasoning, want[reasoning])


def test_reasoning_effort_none_turns_thinking_off(client: Any, tokenizer: Any) -> None:
    """reasoning_effort none / minimal render the prompt as enable_thinking=False does (Qwen3's empty
    think block); low / medium / high leave it as the template has it; an unknown value is a 400."""
    import openai

    def prompt_tokens(**kw: Any) -> int:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, **kw)
        return int(r.usage.prompt_tokens)

    def rendered(**kw: Any) -> int:
        text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kw)
        return len(tokenizer.encode(text, add_special_tokens=False))

    off, on = rendered(enable_thinking=False), rendered()
    assert off != on
    assert prompt_tokens(reasoning_effort="none") == prompt_tokens(reasoning_effort="minimal") == off
    assert prompt_tokens(reasoning_effort="high") == prompt_tokens(reasoning_effort="low") == on
    assert prompt_tokens(reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == on
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, reasoning_effort="max")  # type: ignore[arg-type]
    assert "reasoning_effort" in str(e.value)


# ---- the Responses API: the same parsers, as output items --------------------------------------
FLAT_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


def _items(r: Any) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """(reasoning, text, calls) of a Response, checking the order of its items."""
    kinds = [o.type for o in r.output]
    assert kinds == sorted(kinds, key=["reasoning", "message", "function_call"].index), kinds
    reasoning = [o.content[0].text for o in r.output if o.type == "reasoning"]
    calls = [{"id": o.call_id, "type": "function", "name": o.name, "arguments": o.arguments}
             for o in r.output if o.type == "function_call"]
    assert all(o.id.startswith("fc_") for o in r.output if o.type == "function_call")
    return (reasoning[0] if reasoning else None), (r.output_text or None), calls


def test_responses_scripted_whole_and_streamed(client: Any, tokenizer: Any) -> None:
    from tests.core.test_openai_responses_api import check_event

    seen = set()
    for stream in (False, True):
        for _ in range(len(SCRIPTS)):
            if stream:
                events = list(client.responses.create(model=MODEL, input=MESSAGES, tools=FLAT_TOOLS, stream=True))
                for e in events:
                    check_event(e.to_dict())
                assert [e.sequence_number for e in events] == list(range(len(events)))
                r = events[-1].response
                assert [e.item for e in events if e.type == "response.output_item.done"] == r.output
                thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
                assert thinking == r.output[0].content[0].text
            else:
                r = client.responses.create(model=MODEL, input=MESSAGES, tools=FLAT_TOOLS, max_output_tokens=200)
            assert r.status == "completed"
            reasoning, text, calls = _items(r)
            finish = "tool_calls" if calls else "stop"
            seen.add((stream, _check(reasoning, text, calls, finish, r.usage.output_tokens, tokenizer)))
            assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert seen == {(s, script) for s in (False, True) for script in SCRIPTS}


def test_responses_function_tool_round_trip(client: Any, scripted: Any, tokenizer: Any) -> None:
    """The output items go back as input with the tools' results: the prompt is the one the same chat
    conversation renders (the reasoning item as the assistant turn's reasoning_content)."""
    for _ in range(len(SCRIPTS)):
        first = client.responses.create(model=MODEL, input=MESSAGES, tools=FLAT_TOOLS)
        reasoning, _, calls = _items(first)
        if calls:
            break
    assert calls, "two scripts of three call a tool"
    results = [{"type": "function_call_output", "call_id": c["id"], "output": f"Sunny {i}"} for i, c in enumerate(calls)]
    second = client.responses.create(model=MODEL, input=[*MESSAGES, *first.output, *results], tools=FLAT_TOOLS)
    assert second.status == "completed"
    chat = [*MESSAGES, {"role": "assistant", "content": None, "reasoning_content": reasoning, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]},
        *[{"role": "tool", "tool_call_id": r["call_id"], "content": r["output"]} for r in results]]
    with scripted.http() as h:
        count = h.post("/tokenize", json={"model": MODEL, "messages": chat, "tools": TOOLS}).json()["count"]
    assert second.usage.input_tokens == count
    assert count > first.usage.input_tokens + len(tokenizer.encode(reasoning))  # the reasoning is in the prompt
    # reasoning.effort none renders the prompt with thinking off, as chat's reasoning_effort does
    off = client.responses.create(model=MODEL, input=MESSAGES, reasoning={"effort": "none"}, max_output_tokens=1)
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.usage.input_tokens == len(tokenizer.encode(text, add_special_tokens=False))
