"""The Responses API (`mllmd.openai.responses_api`, `responses_output`) against the official SDK's types.

Checks that a Responses body translates to the chat request that asks for the same thing (messages,
tools, formats, effort, budget, logprobs), that each refusal is a 400 naming the Responses field (chat's
own refusals renamed), and that every response object and stream event the assembler builds validates
against the installed `openai` SDK's types with no field they lack, in OpenAI's order, whole and streamed
alike and equal to what the chat path makes of the same reply; and that the real SDK client, on a mock
transport, sends bodies that parse and reads our responses, streams and 400s.
"""

from __future__ import annotations

import asyncio
import json
import typing
from typing import Any

import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel

from mllmd.messages import PromptMeta, RequestFailed, TextOutput, TokenLogprob, TopLogprob
from mllmd.openai.errors import APIError
from mllmd.openai.limits import MAX_MESSAGES, MAX_TOOL_CALLS
from mllmd.openai.protocol import parse_chat_request
from mllmd.openai.responses_api import parse_responses_request
from mllmd.openai.responses_output import (
    FAILED_EVENT_PREFIX,
    ResponseAssembler,
    response_full,
    response_stream,
)
from mllmd.openai.serving import ChatOptions, _split_chat
from tests.core.test_openai_responses import _client

EVENT_TYPES: dict[str, type[BaseModel]] = {
    typing.get_args(c.model_fields["type"].annotation)[0]: c for c in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
OPTS = ChatOptions("m", "qwen3", "qwen3")


def extra_fields(m: BaseModel, path: str = "$") -> list[str]:
    """Every key the SDK's models do not declare, recursively (they allow extras: we forbid them here)."""
    out = [f"{path}.{k}" for k in (m.model_extra or {})]
    for name in type(m).model_fields:
        value = getattr(m, name)
        for i, sub in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(sub, BaseModel):
                out += extra_fields(sub, f"{path}.{name}[{i}]" if isinstance(value, list) else f"{path}.{name}")
    return out


def check_response(body: dict[str, Any]) -> Response:
    r = Response.model_validate(json.loads(json.dumps(body)))
    assert extra_fields(r) == []
    return r


def check_event(ev: dict[str, Any]) -> BaseModel:
    m = EVENT_TYPES[ev["type"]].model_validate(json.loads(json.dumps(ev)))
    assert extra_fields(m) == [], ev["type"]
    return m


# ---------------------------------------------------------------------------------------------
# Requests: the chat request each body translates to


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    req = parse_responses_request({"model": "m", "input": "Hi", "instructions": "Be terse."})
    chat = req.chat
    assert chat.messages == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert (chat.model, chat.n, chat.stream, chat.tools, chat.tool_choice) == ("m", 1, False, None, "none")
    assert chat.max_tokens is None and chat.response_format is None and not chat.logprobs
    assert req.echo["text"] == {"format": {"type": "text"}} and req.echo["metadata"] == {}
    assert req.echo["truncation"] == "disabled" and req.echo["reasoning"] == {"effort": None, "summary": None}


def test_items_translate_to_the_chat_messages_of_the_same_conversation():
    image = "data:image/png;base64,iVBORw0KGgo="
    body = {"input": [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Weather here?"},
            {"type": "input_image", "image_url": image, "detail": "original"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "Rain"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Compare."}]},
        {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
    ]}
    calls = [{"id": c, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": x})}}
             for c, x in (("call_1", "Paris"), ("call_2", "Rome"), ("call_3", "Oslo"))]
    want = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather here?"},
                                     {"type": "image_url", "image_url": {"url": image, "detail": "high"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "tool_calls": calls[:2],
         "reasoning_content": "Call the tool."},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "Rain"}]},
        {"role": "assistant", "content": None, "tool_calls": calls[2:], "reasoning_content": "Compare."},
    ]
    req = parse_responses_request({**body, "tools": [WEATHER]})
    assert req.chat.messages == parse_chat_request({"messages": want, "tools": [CHAT_WEATHER]}).messages
    assert req.chat.image_urls == [image]


def test_tools_formats_effort_budget_and_logprobs_map_to_chat_fields():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_responses_request({
        "input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False, "text": {"format": {"type": "json_schema", "name": "t", "schema": schema,
                                                          "strict": True}, "verbosity": "low"},
        "reasoning": {"effort": "none", "summary": "auto"}, "max_output_tokens": 33, "temperature": 0.5,
        "top_p": 0.9, "include": ["message.output_text.logprobs", "reasoning.encrypted_content"],
        "top_logprobs": 3, "seed": 7, "stop": ["END"], "metadata": {"k": "v"}, "user": "u1", "store": True,
        "truncation": "auto", "stream": True, "n": 5, "service_tier": "auto", "max_tool_calls": 3,
    })
    chat = req.chat
    assert chat.tools == parse_chat_request({"messages": [{"role": "user", "content": "x"}],
                                             "tools": [CHAT_WEATHER]}).tools
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format == {"type": "json_schema", "schema": json.dumps(schema), "strict": True}
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.seed, chat.stop) == (33, 0.5, 0.9, 7, ["END"])
    assert chat.logprobs and chat.top_logprobs == 3 and chat.stream and chat.n == 1 and not chat.parallel_tool_calls
    assert chat.output_budget().param == "max_output_tokens"
    assert req.echo["tools"] == [WEATHER]
    assert req.echo["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert req.echo["text"]["format"] == {"type": "json_schema", "name": "t", "schema": schema, "strict": True}
    assert req.echo["reasoning"] == {"effort": "none", "summary": "auto"}
    assert (req.echo["metadata"], req.echo["user"], req.echo["truncation"]) == ({"k": "v"}, "u1", "auto")
    high = parse_responses_request({"input": "x", "reasoning": {"effort": "xhigh"}, "top_logprobs": 2,
                                    "text": {"format": {"type": "json_object"}}})
    assert high.chat.chat_template_kwargs == {} and not high.chat.logprobs  # logprobs need the include
    assert high.chat.response_format == {"type": "json_object"}


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"background": True}, "background"),
    ({"store": "yes"}, "store"),
    ({"input": None}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"content": "hi"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": ""}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x", "detail": "max"}]}]},
     "input[0].content[0].detail"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": ["hi", {"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[1].call_id"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "arguments": "{}"}]},
     "input[1].name"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": 5}]}, "input[1].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c"}]}, "input[1].output"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text"}]}]}, "input[0].content[0].text"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]}]}, "input"),
    ({"input": [{"role": "user", "content": "hi"}] + [{"type": "function_call", "call_id": f"c{i}", "name": "f",
                                                       "arguments": "{}"} for i in range(MAX_TOOL_CALLS + 1)]}, "input"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": "{}"},
                {"type": "function_call_output", "call_id": "d", "output": "x"}]}, "input[2].call_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"tools": [{**WEATHER, "parameters": 5}]}, "tools[0].parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "t", "schema": 5}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "t", "strict": "yes"}}}, "text.format.strict"),
    ({"text": 5}, "text"),
    ({"reasoning": {"effort": "ultra"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"include": [5]}, "include[0]"),
    ({"include": "message.output_text.logprobs"}, "include"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": 5}}, "metadata.k"),
    ({"truncation": "middle"}, "truncation"),
    ({"user": "u" * 513}, "user"),
    ({"text": {"format": {"type": "json_schema", "name": "t", "description": "d" * (128 * 1024)}}}, "text.format"),
    ({"instructions": 5}, "instructions"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"input": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}, "input"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED, ids=[p for _, p in REFUSED])
def test_each_refusal_is_a_400_naming_the_responses_field(fields: dict[str, Any], param: str):
    body = {"model": "m", "input": "hi", **fields}
    with pytest.raises(APIError) as info:
        parse_responses_request({k: v for k, v in body.items() if v is not None})
    e = info.value
    assert e.status == 400 and e.type == "invalid_request_error" and e.param == param, e
    assert f"'{param}'" in e.message or (param == "input[0]" and "'input[0]'" in e.message), e.message


def test_a_worker_refusal_of_a_chat_field_is_renamed():
    req = parse_responses_request({"input": "x", "text": {"format": {"type": "json_schema", "name": "t"}},
                                   "tools": [WEATHER], "max_output_tokens": 9})
    e = req.params.error(APIError(400, "the response_format schema cannot be compiled: x", param="response_format"))
    assert e.param == "text.format" and e.message.startswith("the response_format")  # unquoted: kept
    assert req.params.error(APIError(400, "'tools[0].function.parameters' bad", param="tools[0].function.parameters"
                                     )).message == "'tools[0].parameters' bad"
    assert req.params.name("input") == "input" and req.params.name("model") == "model"


# ---------------------------------------------------------------------------------------------
# Output: the assembler, streamed and whole

THINK_CALL = ('<think>\nLet me see.\n</think>\n\nSure: here.\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris"}}\n</tool_call>')


def outputs(text: str | list[str], step: int = 3, finish: str = "stop", logprobs: bool = False) -> list[TextOutput]:
    """`text` as the detokenizer would send it: `step` characters a token (or these tokens), then the
    end of turn."""
    pieces = text if isinstance(text, list) else [text[i : i + step] for i in range(0, len(text), step)]
    pieces = [*pieces, ""]
    out = []
    for k, piece in enumerate(pieces):
        lp = [TokenLogprob(k, piece, list(piece.encode()), -0.5, [TopLogprob(k, piece, list(piece.encode()), -0.5)])]
        last = k == len(pieces) - 1
        out.append(TextOutput("r", piece, [k], last, finish if last else None, None, None, 10, k + 1, 4,
                              lp if logprobs else None, PromptMeta()))
    return out


class _State:
    def __init__(self, items: list[Any]) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        for item in items:
            self.queue.put_nowait(item)


def stream_chunks(body: dict[str, Any], items: list[Any]) -> list[bytes]:
    asm = ResponseAssembler(parse_responses_request(body), OPTS)

    async def collect() -> list[bytes]:
        return [chunk async for chunk in response_stream([_State(items)], asm)]

    return asyncio.run(collect())


def run_stream(body: dict[str, Any], items: list[Any]) -> list[dict[str, Any]]:
    events = []
    for chunk in stream_chunks(body, items):
        for block in chunk.decode().split("\n\n")[:-1]:
            head, data = block.split("\n")
            ev = json.loads(data[len("data: "):])
            assert head == f"event: {ev['type']}"
            events.append(ev)
    return events


def run_full(body: dict[str, Any], items: list[Any]) -> dict[str, Any]:
    return asyncio.run(response_full([_State(items)], ResponseAssembler(parse_responses_request(body), OPTS)))


def item_events(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


def test_a_stream_validates_in_openai_order_and_ends_with_the_whole_response():
    body = {"model": "m", "input": "Weather?", "tools": [WEATHER], "stream": True}
    events = run_stream(body, outputs(THINK_CALL))
    for ev in events:
        check_event(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = item_events(events)
    assert kinds[:2] == ["created", "in_progress"] and kinds[-1] == "completed"
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    deltas = {"reasoning_text.delta", "output_text.delta", "function_call_arguments.delta"}
    squeezed = [k for i, k in enumerate(kinds) if k not in deltas or kinds[i - 1] != k]
    assert squeezed == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done", "output_item.done",
        "completed",
    ]
    final = check_response(events[-1]["response"])
    assert final.status == "completed" and final.output_text == "Sure: here."
    reasoning, message, call = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me see." and reasoning.summary == []
    assert message.type == "message" and message.status == "completed" and message.id.startswith("msg_")
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == events[-1]["response"]["output"]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [a["id"] for a in added] == [d["id"] for d in done] and all(a["status"] == "in_progress" for a in added)
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Let me see."
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == call.arguments
    assert final.usage.input_tokens == 10 and final.usage.input_tokens_details.cached_tokens == 4
    n = len(outputs(THINK_CALL))
    assert final.usage.output_tokens == n and final.usage.total_tokens == 10 + n
    assert final.usage.output_tokens_details.reasoning_tokens == 8  # from the token ending "<think>" to "</think>"
    tokens = ["<think>", "\nLet", " me see.", "\n", "</think>", "\n\n", "Sure: here."]
    assert check_response(run_full(body, outputs(tokens))).usage.output_tokens_details.reasoning_tokens == 5
    assert final.tools[0].name == "get_weather" and final.tool_choice == "auto" and final.parallel_tool_calls


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_whole_and_streamed_are_the_chat_path_s_reply(step: int):
    body = {"input": "Weather?", "tools": [WEATHER]}
    whole = check_response(run_full(body, outputs(THINK_CALL, step)))
    streamed = check_response(run_stream({**body, "stream": True}, outputs(THINK_CALL, step))[-1]["response"])
    reasoning, content, calls = _split_chat(THINK_CALL, PromptMeta(), parse_responses_request(body).chat, OPTS)
    for r in (whole, streamed):
        assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
        assert r.output[0].content[0].text == reasoning and r.output_text == content
        assert [(o.name, o.arguments) for o in r.output[2:]] == [(c["function"]["name"], c["function"]["arguments"])
                                                                for c in calls]
        assert r.usage == whole.usage


def test_a_reply_cut_by_max_output_tokens_is_incomplete():
    events = run_stream({"input": "x", "stream": True, "max_output_tokens": 5}, outputs("Hello there", finish="length"))
    for ev in events:
        check_event(ev)
    assert events[-1]["type"] == "response.incomplete"
    r = check_response(events[-1]["response"])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.output_text == "Hello there" and r.completed_at is None
    assert r.max_output_tokens == 5


def test_an_empty_reply_is_one_empty_message_and_whitespace_waits_for_text():
    r = check_response(run_full({"input": "x"}, outputs("")))
    assert [o.type for o in r.output] == ["message"] and r.output_text == ""
    assert check_response(run_full({"input": "x"}, outputs("  \n", 1))).output_text == "  \n"
    spaced = run_stream({"input": "x", "stream": True}, outputs("  \nHi", 1))
    assert [e["delta"] for e in spaced if e["type"] == "response.output_text.delta"][:2] == ["  \nH", "i"]


def test_logprobs_with_the_include():
    body = {"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    events = run_stream({**body, "stream": True}, outputs("Hello", 2, logprobs=True))
    for ev in events:
        check_event(ev)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [d["logprobs"][0]["token"] for d in deltas] == ["He", "ll", "o"]
    assert deltas[0]["logprobs"][0] == {"token": "He", "logprob": -0.5, "top_logprobs": [{"token": "He", "logprob": -0.5}]}
    part = check_response(events[-1]["response"]).output[0].content[0]
    assert [lp.token for lp in part.logprobs] == ["He", "ll", "o"] and part.logprobs[0].bytes == [72, 101]
    assert check_response(run_full({"input": "x"}, outputs("Hello", 2, logprobs=True))).output[0].content[0].logprobs == []


def test_a_failure_ends_the_stream_with_response_failed():
    failure = RequestFailed("r", "invalid_request", "the response_format schema cannot be compiled", "response_format")
    body = {"input": "x", "stream": True, "text": {"format": {"type": "json_schema", "name": "t"}}}
    events = run_stream(body, [*outputs("Hi there")[:2], failure])
    for ev in events:
        check_event(ev)
    assert item_events(events)[-1] == "failed"
    r = check_response(events[-1]["response"])
    assert r.status == "failed" and r.error.code == "invalid_prompt" and r.error.param == "text.format"
    assert stream_chunks(body, [*outputs("Hi there")[:2], failure])[-1].startswith(FAILED_EVENT_PREFIX)  # access log
    assert r.output[0].status == "incomplete"
    early = ResponseAssembler(parse_responses_request(body), OPTS).failure_event(RequestFailed("r", "internal", "x"))
    blocks = [json.loads(b.split("\ndata: ")[1]) for b in early.decode().split("\n\n")[:-1]]
    assert [b["type"] for b in blocks] == ["response.created", "response.in_progress", "response.failed"]
    assert blocks[-1]["response"]["error"] == {"code": "server_error", "message": "x"}
    assert early.split(b"\n\n")[-2].startswith(FAILED_EVENT_PREFIX)


# ---------------------------------------------------------------------------------------------
# The real SDK client: what it sends parses, what we send it reads


class Pet(pydantic.BaseModel):
    name: str
    legs: int


def test_sdk_client_sends_what_parses_and_reads_responses_streams_and_errors():
    seen: list[dict[str, Any]] = []
    holder: dict[str, Any] = {}

    def handler(request: Any) -> Any:
        body = json.loads(request.content)
        seen.append(body)
        mod = holder["mod"]
        try:
            req = parse_responses_request(body)
        except APIError as e:
            return mod.Response(e.status, json=e.to_dict())
        text = '{"name": "Rex", "legs": 4}' if req.chat.response_format else THINK_CALL
        asm = ResponseAssembler(req, OPTS)
        if not req.stream:
            return mod.Response(200, json=asyncio.run(response_full([_State(outputs(text))], asm)))

        async def collect() -> bytes:
            return b"".join([c async for c in response_stream([_State(outputs(text))], asm)])

        return mod.Response(200, content=asyncio.run(collect()), headers={"content-type": "text/event-stream"})

    client, holder["mod"] = _client(handler)
    r = client.responses.create(model="m", input="Weather?", instructions="Be brief.", tools=[WEATHER],
                                max_output_tokens=64, temperature=0.2, reasoning={"effort": "low"})
    assert r.output_text == "Sure: here." and r.output[2].name == "get_weather" and r.temperature == 0.2
    # the next turn: the output items back as input, with the tool's result
    follow = [*r.output, {"type": "function_call_output", "call_id": r.output[2].call_id, "output": "Sunny"}]
    r2 = client.responses.create(model="m", input=[{"role": "user", "content": "Weather?"}, *follow], tools=[WEATHER])
    msgs = parse_responses_request(seen[-1]).chat.messages
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["reasoning_content"] == "Let me see." and msgs[1]["tool_calls"][0]["id"] == r.output[2].call_id
    assert r2.status == "completed"
    events = list(client.responses.create(model="m", input="Weather?", tools=[WEATHER], stream=True))
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "Sure: here."
    with client.responses.stream(model="m", input="Weather?", tools=[WEATHER]) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == "Sure: here."
    parsed = client.responses.parse(model="m", input="A pet", text_format=Pet)
    assert parsed.output_parsed == Pet(name="Rex", legs=4)
    assert parse_responses_request(seen[-1]).chat.response_format["strict"] is True
    with pytest.raises(openai.BadRequestError) as info:
        client.with_options(max_retries=0).responses.create(model="m", input="x", previous_response_id="resp_1")
    assert info.value.param == "previous_response_id" and "stateless" in info.value.message


def test_the_openapi_document_describes_what_parses():
    import jsonschema

    from mllmd.openai.openapi import openapi_document

    doc = openapi_document()
    op = doc["paths"]["/v1/responses"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ResponsesRequest"}
    assert "no [DONE]" in op["responses"]["200"]["content"]["text/event-stream"]["description"]
    schema = {**doc["components"]["schemas"]["ResponsesRequest"], "$schema": "https://json-schema.org/draft/2020-12/schema"}
    bodies = [
        {"model": "m", "input": "Hi", "instructions": "Be terse.", "stream": True, "store": False, "metadata": {"k": "v"}},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"},
                                                {"type": "input_image", "image_url": "data:,", "detail": "original"}]},
                   {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]},
                   {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c", "output": "ok"}],
         "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 8,
         "text": {"format": {"type": "json_schema", "name": "t", "schema": {}, "strict": True}},
         "reasoning": {"effort": "xhigh", "summary": "auto"}, "include": ["message.output_text.logprobs"],
         "top_logprobs": 2, "truncation": "auto", "seed": 1, "top_k": 5},
    ]
    for body in bodies:
        jsonschema.validate(body, schema)
        parse_responses_request(body)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"input": "x", "previous_response_id": "resp_1"}, schema)
