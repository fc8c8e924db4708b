"""Chat-template parity: the prompt ids the tokenizer worker builds for an OpenAI chat request equal
transformers' `apply_chat_template(..., tokenize=True, add_generation_prompt=True)` on the same
conversation in transformers' chat format (tool-call arguments as objects), with each family's real
template and the real tokenizer. The deliberate differences (developer -> system, text-part lists joined
for Qwen3's template, which renders only strings) are the documented conversions."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from mllmd.checkpoint.tokenizer import DATA_DIR, build_qwen_tokenizer
from mllmd.messages import OutputBudget, TokenizeOnly, TokenizeRequest
from mllmd.openai import protocol
from mllmd.sampling_params import SamplingParams
from mllmd.workers.chat_messages import MAX_ARGUMENT_DEPTH
from mllmd.workers.tokenizer_worker import tokenize, tokenize_only

FAMILIES: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": {"tokenizer_config": DATA_DIR / "Qwen3-0.6B" / "tokenizer_config.json"},
    "Qwen3-VL": {"chat_template": DATA_DIR / "Qwen3-VL-2B-Instruct" / "chat_template.from-Qwen3-VL-8B-Instruct.jinja"},
    "Qwen3.5-0.8B": {"vocab": "qwen3_5", "chat_template": DATA_DIR / "Qwen3.5-0.8B" / "chat_template.jinja"},
    "Qwen3.5-4B": {"vocab": "qwen3_5", "chat_template": DATA_DIR / "Qwen3.5-4B" / "chat_template.jinja"},
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"},
        "opts": {"type": "object", "properties": {"units": {"type": "string", "enum": ["c", "f"]},
                                                  "days": {"type": "array", "items": {"type": "integer"}}}}}}}}]  # fmt: skip
# as the OpenAI API and its clients write them: arguments a compact JSON string
CALLS = [{"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city":"Paris","opts":{"units":"c","days":[1,2]}}'}},
         {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]
CONVERSATIONS: dict[str, dict[str, Any]] = {
    "tool-round-trip": {"tools": TOOLS, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": '{"temp": 3}'}]},
        {"role": "assistant", "content": "20C and 3C."}, {"role": "user", "content": "Thanks"}]},
    "tool-pending-with-reasoning": {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": True}, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I need the tool.", "tool_calls": CALLS[:1]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]},
    "text-part-lists": {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": " brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}]},
    # tool_choice "none": no call may come back, but the model still sees the tools it called before
    "tools-with-tool-choice-none": {"tools": TOOLS, "tool_choice": "none", "messages": [
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": CALLS[:1]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]},
    "reasoning-history": {"chat_template_kwargs": {"enable_thinking": False}, "messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "add"},
        {"role": "user", "content": "3+3?"}]},
}
# the template renders no text of a part list (Qwen3's): the worker joins the parts, by design
JOINED = {("Qwen3-0.6B", "text-part-lists"), ("Qwen3-0.6B", "tool-round-trip")}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    from transformers import AutoTokenizer

    out = build_qwen_tokenizer(tmp_path_factory.mktemp("tok"), **FAMILIES[request.param])
    return request.param, AutoTokenizer.from_pretrained(str(out))


def transformers_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """transformers' chat format: tool-call arguments as objects (its chat templating docs)."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def worker_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """The ids the tokenizer worker feeds the model for a /v1/chat/completions body."""
    req = protocol.parse_chat_request(copy.deepcopy(body))
    tr = TokenizeRequest("g", ["r"], req.chat_prompt(), SamplingParams(), OutputBudget())
    return tokenize(tokenizer, tr)[0]


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_prompt_ids_equal_transformers(family: tuple[str, Any], name: str) -> None:
    fam, tokenizer = family
    if (fam, name) in JOINED:
        pytest.skip("Qwen3's template renders a part list as ''; the worker joins it (a deliberate difference)")
    body = CONVERSATIONS[name]
    expected = tokenizer.apply_chat_template(transformers_messages(body["messages"]), tools=body.get("tools"),
                                             tokenize=True, add_generation_prompt=True, return_dict=False,
                                             **body.get("chat_template_kwargs", {}))  # fmt: skip
    got = worker_ids(tokenizer, body)
    assert got == list(expected), f"{tokenizer.decode(got)!r}\n!=\n{tokenizer.decode(expected)!r}"
    # /tokenize answers the ids a generation sees
    req = protocol.parse_chat_request(copy.deepcopy(body))
    assert tokenize_only(tokenizer, TokenizeOnly("t", req.chat_prompt())).ids == got


def test_qwen3_joins_text_parts_with_newlines(family: tuple[str, Any]) -> None:
    """Qwen3's template writes only string contents: a part list reaches it joined (vLLM's string format)."""
    fam, tokenizer = family
    if fam != "Qwen3-0.6B":
        pytest.skip("the other templates render part lists themselves")
    got = tokenizer.decode(worker_ids(tokenizer, CONVERSATIONS["text-part-lists"]))
    assert got == "<|im_start|>system\nBe\n brief.<|im_end|>\n<|im_start|>user\nHello\n there<|im_end|>\n<|im_start|>assistant\n"


def test_arguments_that_are_not_an_object_stay_a_string(family: tuple[str, Any]) -> None:
    fam, tokenizer = family
    if not fam.startswith("Qwen3-"):
        pytest.skip("Qwen3.5's template reads arguments as an object only")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    body = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c", "content": "y"}]}
    assert '"arguments": not json}' in tokenizer.decode(worker_ids(tokenizer, body))


@pytest.mark.parametrize("depth", [MAX_ARGUMENT_DEPTH, 500])
def test_deeply_nested_arguments_cannot_exhaust_the_stack(family: tuple[str, Any], depth: int) -> None:
    """Arguments 500 levels deep, parsed into an object, made the template's rendering raise RecursionError;
    past MAX_ARGUMENT_DEPTH they stay the client's string (Qwen3's template writes it as it came)."""
    fam, tokenizer = family
    if fam != "Qwen3-0.6B":
        pytest.skip("one template shows it")
    args = '{"a":' + "[" * (depth - 1) + "]" * (depth - 1) + "}"
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}
    body = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c", "content": "y"}]}
    text = tokenizer.decode(worker_ids(tokenizer, body))
    if depth <= MAX_ARGUMENT_DEPTH:
        assert '"arguments": {"a": [[' in text  # an object, rendered with tojson
    else:
        assert '"arguments": ' + args in text
