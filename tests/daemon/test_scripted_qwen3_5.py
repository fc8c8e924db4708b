"""A Qwen3.5 model with the default configuration: the qwen3_5 parsers are chosen from the model, the
reply starts inside the reasoning (the 4B template ends the prompt with an open <think>), and a tool
call opened inside that unclosed reasoning ends it and is parsed as a call.

Scripted output (mllmd/testing/scripted.py): request k gets SCRIPTS[k % 2]; responses are matched to
their script by their reasoning text, so the order requests arrive in does not matter.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from mllmd.testing import checkpoints as ck

from .conftest import DaemonProc, short_tmpdir, start_daemon, stop_and_check

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-qwen3_5"
CALL = ("The user wants the weather.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>")
ANSWER = "Just a greeting.\n</think>\n\nHello!"
SCRIPTS = [CALL, ANSWER]
# reasoning -> (content, tool calls)
EXPECTED: dict[str, tuple[str | None, list[dict[str, Any]]]] = {
    "The user wants the weather.": (None, [{"name": "get_weather", "arguments": {"city": "Paris"}}]),
    "Just a greeting.": ("Hello!", []),
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    model = ck.build_tiny_checkpoint(tmp_path_factory.mktemp("q35") / MODEL, "Qwen3.5-4B",
                                     num_hidden_layers=4, head_dim=32, seed=5)
    script = short_tmpdir() / "script.json"
    script.write_text(json.dumps(SCRIPTS))
    d = start_daemon(model, env={"MLLMD_TESTING_SCRIPT": str(script)}, ready_timeout=180)
    try:
        yield d
    finally:
        stop_and_check(d)


def _check(reasoning: str | None, content: str | None, calls: list[dict[str, Any]], finish: str) -> str:
    assert reasoning in EXPECTED, f"unexpected reasoning {reasoning!r} (content {content!r}, calls {calls})"
    want_content, want_calls = EXPECTED[reasoning]
    assert (content or None) == want_content
    assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls] == want_calls
    assert finish == ("tool_calls" if want_calls else "stop")
    return reasoning


def test_qwen3_5_defaults_non_streaming(daemon: DaemonProc) -> None:
    client = daemon.openai()
    seen = set()
    for _ in SCRIPTS:
        c = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=100).choices[0]
        extra = c.message.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls or []]
        seen.add(_check(extra.get("reasoning_content"), c.message.content, calls, c.finish_reason))
    assert seen == set(EXPECTED)


def test_qwen3_5_defaults_streaming(daemon: DaemonProc) -> None:
    client = daemon.openai()
    seen = set()
    for _ in SCRIPTS:
        reasoning, content, finish = [], [], []
        calls: dict[int, dict[str, Any]] = {}
        for ch in client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=100,
                                                 stream=True):
            if not ch.choices:
                continue
            delta = ch.choices[0].delta
            extra = delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning.append(extra.get("reasoning_content") or "")
            content.append(delta.content or "")
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += (tc.function and tc.function.name) or ""
                entry["arguments"] += (tc.function and tc.function.arguments) or ""
            if ch.choices[0].finish_reason:
                finish.append(ch.choices[0].finish_reason)
        assert len(finish) == 1
        seen.add(_check("".join(reasoning), "".join(content), [calls[i] for i in sorted(calls)], finish[0]))
    assert seen == set(EXPECTED)


def test_qwen3_5_second_turn_after_a_tool_call(daemon: DaemonProc) -> None:
    """The turn after a call, as the openai client sends it (arguments: the JSON string the reply gave):
    Qwen3.5's template iterates over the arguments (`|items`), so the string must reach it as an object
    (it was a 400, "Can only get item pairs from a mapping"); the ids are transformers' for the chat with
    the arguments as an object."""
    from transformers import AutoTokenizer

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny, 20C"}]}]
    r = daemon.openai().chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=100)
    assert r.choices[0].finish_reason in ("stop", "tool_calls")
    with daemon.http() as h:
        got = h.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": TOOLS})
    assert got.status_code == 200, got.text
    as_object = json.loads(json.dumps(messages))
    as_object[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    tokenizer = AutoTokenizer.from_pretrained(str(daemon.model_path))
    want = tokenizer.apply_chat_template(as_object, tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                         return_dict=False)
    assert got.json()["tokens"] == list(want)
    assert r.usage is not None and r.usage.prompt_tokens == len(want)
