"""OpenAI request parsing (`mllmd.openai.protocol`): valid requests and the 400 for each bad one.

Checks that chat, text-completion and native /generate requests parse with the right defaults,
map every sampling field to `SamplingParams`, normalise chat messages, tools and
`reasoning_effort`, and decode only UTF-8 JSON; and, for a table of malformed requests of each
kind, that the parser answers an OpenAI-shaped 400 whose `param` names the offending field and
whose message mentions it. The fuzz tests of the same parsers are in `test_openai_protocol_fuzz.py`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mllmd.openai.errors import APIError
from mllmd.openai.protocol import (
    MAX_N,
    UNSUPPORTED_CHAT_FIELDS,
    decode_json,
    parse_chat_request,
    parse_completion_request,
    parse_generate_request,
)
from mllmd.sampling_params import SamplingParams

# ---------------------------------------------------------------------------------------------
# Parsing: happy paths

USER = [{"role": "user", "content": "hi"}]


def test_chat_defaults():
    req = parse_chat_request({"model": "m", "messages": USER})
    assert req.model == "m" and req.n == 1 and not req.stream and req.tool_choice == "none"
    sp = req.sampling_params(default_max_tokens=1000)
    assert sp == SamplingParams(max_tokens=1000, temperature=1.0)
    assert req.sampling_params().max_tokens == SamplingParams().max_tokens


def test_chat_maps_sampling_fields():
    req = parse_chat_request(
        {
            "messages": USER,
            "max_tokens": 10,
            "max_completion_tokens": 20,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 40,
            "min_p": 0.1,
            "presence_penalty": 1,
            "frequency_penalty": -1.5,
            "repetition_penalty": 1.1,
            "seed": 42,
            "stop": "###",
            "stop_token_ids": [7, 8],
            "logprobs": True,
            "top_logprobs": 3,
            "logit_bias": {"15": 5, "20": -100},
            "ignore_eos": True,
            "skip_special_tokens": False,
            "user": "ignored",
            "some_vendor_extra": {"x": 1},
            "n": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    sp = req.sampling_params(default_max_tokens=5)
    assert sp.max_tokens == 20  # max_completion_tokens wins
    assert sp.greedy and sp.top_p == 0.5 and sp.top_k == 40 and sp.min_p == 0.1
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (1.0, -1.5, 1.1)
    assert sp.seed == 42 and sp.stop == ["###"] and sp.stop_token_ids == [7, 8]
    assert sp.logprobs and sp.top_logprobs == 3
    assert sp.logit_bias == {15: 5.0, 20: -100.0}
    assert sp.ignore_eos and not sp.skip_special_tokens
    assert req.n == 3 and req.stream and req.include_usage
    assert parse_chat_request({"messages": USER, "max_tokens": 10}).sampling_params(5).max_tokens == 10


def test_chat_messages_normalised():
    req = parse_chat_request(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is"},
                        {"type": "image_url", "image_url": {"url": "file:///a.png", "detail": "low"}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "c1",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "user", "content": "thanks", "name": "bob"},
            ],
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "g", "description": "G"}},
            ],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
            "chat_template_kwargs": {"enable_thinking": False},
            "response_format": {"type": "text"},
        }
    )
    m = req.messages
    assert m[0] == {"role": "system", "content": "be brief"}
    assert m[1]["content"][1] == {"type": "image_url", "image_url": {"url": "file:///a.png", "detail": "low"}}
    assert m[2]["content"] is None and m[2]["tool_calls"][0]["function"]["name"] == "f"
    assert m[3] == {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "tool_call_id": "c1"}  # joined (or not) by the tokenizer worker, for the template
    assert m[4]["name"] == "bob"
    assert req.image_urls == ["file:///a.png"]
    assert [t["function"]["name"] for t in req.tools] == ["f", "g"]
    assert req.tool_choice == {"type": "function", "function": {"name": "g"}}
    assert req.chat_template_kwargs == {"enable_thinking": False}
    assert parse_chat_request({"messages": USER, "tools": req.tools}).tool_choice == "auto"


@pytest.mark.parametrize(("effort", "kwargs", "want"), [
    ("none", None, {"enable_thinking": False}),
    ("minimal", None, {"enable_thinking": False}),
    ("low", None, {}),
    ("medium", None, {}),
    ("high", None, {}),
    (None, None, {}),
    ("none", {"x": 1}, {"x": 1, "enable_thinking": False}),
    ("none", {"enable_thinking": True}, {"enable_thinking": True}),  # the explicit template variable wins
    ("high", {"enable_thinking": False}, {"enable_thinking": False}),
])
def test_reasoning_effort_sets_enable_thinking(effort: str | None, kwargs: dict[str, Any] | None,
                                               want: dict[str, Any]) -> None:
    body: dict[str, Any] = {"messages": USER, "reasoning_effort": effort}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    assert parse_chat_request(body).chat_template_kwargs == want


@pytest.mark.parametrize("effort", ["max", "", "NONE", 1, True])
def test_reasoning_effort_unknown_is_a_400_naming_the_values(effort: Any) -> None:
    with pytest.raises(APIError) as e:
        parse_chat_request({"messages": USER, "reasoning_effort": effort})
    assert e.value.status == 400 and e.value.param == "reasoning_effort"
    if isinstance(effort, str):
        assert "none, minimal, low, medium, high" in e.value.message


def test_completion_parsing():
    req = parse_completion_request({"model": "m", "prompt": "Once"})
    assert req.prompts == ["Once"]
    assert req.sampling_params(default_max_tokens=1000).max_tokens == 16  # OpenAI's default
    assert req.sampling_params(default_max_tokens=4).max_tokens == 4  # shortened by the context
    assert not req.sampling_params().logprobs
    assert parse_completion_request({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse_completion_request({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse_completion_request({"prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    req = parse_completion_request(
        {"prompt": "x", "logprobs": 2, "echo": True, "max_tokens": 5, "suffix": None}
    )
    sp = req.sampling_params(100)
    assert sp.logprobs and sp.top_logprobs == 2 and sp.max_tokens == 5 and req.echo
    assert parse_completion_request({"prompt": "x", "logprobs": 0}).sampling_params().logprobs
    assert parse_completion_request({"prompt": "x", "best_of": 2, "n": 2}).n == 2


def test_generate_parsing():
    req = parse_generate_request(
        {
            "text": "hello",
            "sampling_params": {
                "max_new_tokens": 8,
                "temperature": 0,
                "stop": ["\n"],
                "logit_bias": {"3": 1},
            },
            "stream": True,
            "rid": "r1",
            "return_logprob": True,
            "top_logprobs_num": 2,
        }
    )
    assert req.prompts == ["hello"] and not req.is_batch and req.rids == ["r1"] and req.stream
    sp = req.sampling_params(100)
    assert sp.max_tokens == 8 and sp.greedy and sp.stop == ["\n"] and sp.logit_bias == {3: 1.0}
    assert sp.logprobs and sp.top_logprobs == 2
    batch = parse_generate_request({"input_ids": [[1, 2], [3]], "rid": ["a", "b"]})
    assert batch.is_batch and batch.input_ids == [[1, 2], [3]] and batch.batch_size == 2
    assert batch.sampling_params(50).max_tokens == 50
    single = parse_generate_request({"input_ids": [1, 2]})
    assert not single.is_batch and single.prompts == [[1, 2]]
    assert parse_generate_request({"text": ["a"]}).is_batch


def test_sampling_params_errors_become_api_errors():
    req = parse_chat_request({"messages": USER})
    with pytest.raises(APIError) as info:
        req.sampling_params(default_max_tokens=0)
    assert info.value.status == 400 and info.value.param == "max_tokens"
    req.top_logprobs = 99  # a value only SamplingParams.validate() catches
    with pytest.raises(APIError) as info:
        req.sampling_params(10)
    assert info.value.param == "top_logprobs"
    greq = parse_generate_request({"text": "x"})
    greq.top_p = 0.0
    with pytest.raises(APIError) as info:
        greq.sampling_params(10)
    assert info.value.param == "sampling_params.top_p"


def test_decode_json():
    assert decode_json(b'{"a": 1}') == {"a": 1}
    for bad in (b"{", b"\xff", b'{"a": NaN}', b"[" * 100000):
        with pytest.raises(APIError) as info:
            decode_json(bad)
        assert info.value.status == 400


def test_decode_json_bounds_the_objects_of_a_body():
    """An 8 MB body of `[{},{},...]` decoded to about 400 MB of Python objects before any field was
    checked; more than MAX_JSON_CONTAINERS '{' and '[' are refused unread."""
    from mllmd.openai.limits import MAX_JSON_CONTAINERS

    many = b"[" + b"{}," * MAX_JSON_CONTAINERS + b"{}]"
    with pytest.raises(APIError) as info:
        decode_json(many)
    assert info.value.status == 400 and str(MAX_JSON_CONTAINERS) in info.value.message
    assert len(decode_json(b"[" + b"{}," * (MAX_JSON_CONTAINERS - 2) + b"{}]")) == MAX_JSON_CONTAINERS - 1


def test_decode_json_takes_utf8_only():
    """RFC 8259 8.1: UTF-8 (a BOM is tolerated); UTF-16/32, which json.loads would sniff, are a 400."""
    assert decode_json('{"text": "héllo ☃"}'.encode()) == {"text": "héllo ☃"}
    assert decode_json(b"\xef\xbb\xbf" + b'{"a": 1}') == {"a": 1}
    for enc in ("utf-16", "utf-16-le", "utf-32"):
        with pytest.raises(APIError) as info:
            decode_json('{"a": 1}'.encode(enc))
        assert info.value.status == 400 and "UTF-8" in info.value.message


# ---------------------------------------------------------------------------------------------
# Parsing: bad inputs

M = {"messages": USER}
BAD_CHAT: list[tuple[Any, str | None]] = [
    ([], None),
    ("text", None),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0].image_url",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}]},
        "messages[0].content[0].image_url.url",
    ),
    (
        {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
        "messages[0].content[0].type",
    ),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
        "messages[0].tool_calls[0].function",
    ),
    ({**M, "model": 3}, "model"),
    ({**M, "stream": "yes"}, "stream"),
    ({**M, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**M, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({**M, "n": 0}, "n"),
    ({**M, "n": MAX_N + 1}, "n"),
    ({**M, "max_tokens": -1}, "max_tokens"),
    ({**M, "max_tokens": 0}, "max_tokens"),
    ({**M, "max_tokens": 10**30}, "max_tokens"),
    ({**M, "max_tokens": 1.5}, "max_tokens"),
    ({**M, "max_completion_tokens": "8"}, "max_completion_tokens"),
    ({**M, "temperature": 2.5}, "temperature"),
    ({**M, "temperature": -0.1}, "temperature"),
    ({**M, "temperature": True}, "temperature"),
    ({**M, "temperature": float("nan")}, "temperature"),
    ({**M, "temperature": 10**400}, "temperature"),
    ({**M, "top_p": 0}, "top_p"),
    ({**M, "top_p": 1.5}, "top_p"),
    ({**M, "top_k": -2}, "top_k"),
    ({**M, "min_p": 2}, "min_p"),
    ({**M, "presence_penalty": 3}, "presence_penalty"),
    ({**M, "frequency_penalty": -2.01}, "frequency_penalty"),
    ({**M, "repetition_penalty": 0}, "repetition_penalty"),
    ({**M, "seed": "1"}, "seed"),
    ({**M, "seed": 2**70}, "seed"),
    ({**M, "stop": ""}, "stop"),
    ({**M, "stop": ["a", 1]}, "stop"),
    ({**M, "stop": {"a": 1}}, "stop"),
    ({**M, "stop": ["x"] * 65}, "stop"),
    ({**M, "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({**M, "stop_token_ids": 5}, "stop_token_ids"),
    ({**M, "logprobs": 1}, "logprobs"),
    ({**M, "top_logprobs": 2}, "top_logprobs"),
    ({**M, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**M, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({**M, "logit_bias": {"-5": 1}}, "logit_bias"),
    ({**M, "logit_bias": {"5": 101}}, "logit_bias"),
    ({**M, "logit_bias": {"5": "1"}}, "logit_bias"),
    ({**M, "logit_bias": {"9" * 4400: 1}}, "logit_bias"),
    ({**M, "logit_bias": [1]}, "logit_bias"),
    ({**M, "ignore_eos": "no"}, "ignore_eos"),
    ({**M, "skip_special_tokens": 0}, "skip_special_tokens"),
    ({**M, "tools": {}}, "tools"),
    ({**M, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({**M, "tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({**M, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    (
        {
            **M,
            "tools": [
                {"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "f"}},
            ],
        },
        "tools[1].function.name",
    ),
    (
        {**M, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        "tools[0].function.parameters",
    ),
    ({**M, "tool_choice": "auto"}, "tool_choice"),
    ({**M, "tool_choice": "sometimes"}, "tool_choice"),
    (
        {
            **M,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice.function.name",
    ),
    ({**M, "tool_choice": {"type": "allowed_tools"}}, "tool_choice.type"),
    ({**M, "chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({**M, "chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({**M, "response_format": {"type": "xml"}}, "response_format.type"),
    ({**M, "response_format": {}}, "response_format.type"),
    ({**M, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({**M, "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format.json_schema.name"),
    ({**M, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({**M, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({**M, "response_format": "text"}, "response_format"),
    ({**M, "modalities": ["text", "audio"]}, "modalities"),
    ({**M, "parallel_tool_calls": "x"}, "parallel_tool_calls"),
] + [({**M, key: {"x": 1}}, key) for key in UNSUPPORTED_CHAT_FIELDS]

P = {"prompt": "x"}
BAD_COMPLETION: list[tuple[Any, str | None]] = [
    (None, None),
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt[1]"),
    ({"prompt": [1, "a"]}, "prompt[1]"),
    ({"prompt": [1, -2]}, "prompt[1]"),
    ({"prompt": [[1], []]}, "prompt[1]"),
    ({"prompt": [[1], [2**40]]}, "prompt[1][0]"),
    ({"prompt": [{"a": 1}]}, "prompt"),
    ({"prompt": ["a"] * 300}, "prompt"),
    ({**P, "suffix": "tail"}, "suffix"),
    ({**P, "logprobs": 6}, "logprobs"),
    ({**P, "logprobs": True}, "logprobs"),
    ({**P, "echo": "y"}, "echo"),
    ({**P, "best_of": 3}, "best_of"),
    ({**P, "n": 17}, "n"),
    ({"prompt": ["a"] * 100, "n": 3}, "n"),
    ({**P, "max_tokens": 0}, "max_tokens"),
    ({**P, "temperature": 3}, "temperature"),
    ({**P, "stop": [""]}, "stop"),
    ({**P, "stream_options": {}}, "stream_options"),
]

T = {"text": "x"}
BAD_GENERATE: list[tuple[Any, str | None]] = [
    (1, None),
    ({}, "text"),
    ({"text": "x", "input_ids": [1]}, "text"),
    ({"text": ""}, "text"),
    ({"text": 5}, "text"),
    ({"text": []}, "text"),
    ({"text": ["a", None]}, "text[1]"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": "1 2"}, "input_ids"),
    ({"input_ids": [1, [2]]}, "input_ids[1]"),
    ({"input_ids": [[1], 2]}, "input_ids[1]"),
    ({**T, "sampling_params": []}, "sampling_params"),
    ({**T, "sampling_params": {"max_tokens": 5}}, "sampling_params.max_tokens"),
    ({**T, "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({**T, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({**T, "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
    ({**T, "sampling_params": {"top_k": "5"}}, "sampling_params.top_k"),
    ({**T, "sampling_params": {"stop": [3]}}, "sampling_params.stop"),
    ({**T, "sampling_params": {"stop_token_ids": [1.5]}}, "sampling_params.stop_token_ids[0]"),
    ({**T, "sampling_params": {"logit_bias": {"x": 1}}}, "sampling_params.logit_bias"),
    ({**T, "sampling_params": {"seed": 1.5}}, "sampling_params.seed"),
    ({**T, "sampling_params": {"ignore_eos": 1}}, "sampling_params.ignore_eos"),
    ({**T, "stream": 1}, "stream"),
    ({**T, "rid": 5}, "rid"),
    ({**T, "rid": ""}, "rid"),
    ({**T, "rid": "r" * 300}, "rid"),
    ({**T, "rid": "a\nb"}, "rid"),  # a control character
    ({"text": ["a", "b"], "rid": "r"}, "rid"),
    ({"text": ["a", "b"], "rid": ["r", "r"]}, "rid"),
    ({**T, "return_logprob": "y"}, "return_logprob"),
    ({**T, "top_logprobs_num": 2}, "top_logprobs_num"),
    ({**T, "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
]


def _expect_400(parse, body: Any, param: str | None) -> None:
    with pytest.raises(APIError) as info:
        parse(body)
    e = info.value
    assert (e.status, e.param) == (400, param), e.message
    assert e.type == "invalid_request_error"
    if param is not None:
        assert param.split(".")[-1].split("[")[0] in e.message  # the message names the field
    assert len(e.message) < 400


@pytest.mark.parametrize(("body", "param"), BAD_CHAT, ids=lambda x: json.dumps(x, default=str)[:60])
def test_bad_chat(body: Any, param: str | None) -> None:
    _expect_400(parse_chat_request, body, param)


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETION, ids=lambda x: json.dumps(x, default=str)[:60])
def test_bad_completion(body: Any, param: str | None) -> None:
    _expect_400(parse_completion_request, body, param)


@pytest.mark.parametrize(("body", "param"), BAD_GENERATE, ids=lambda x: json.dumps(x, default=str)[:60])
def test_bad_generate(body: Any, param: str | None) -> None:
    _expect_400(parse_generate_request, body, param)



# ---------------------------------------------------------------------------------------------
# JSON schemas: bounded before one background thread compiles them for every client


def _schema_request(schema: dict[str, Any]) -> dict[str, Any]:
    return {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def _tools_request(parameters: list[dict[str, Any]]) -> dict[str, Any]:
    return {"messages": USER, "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": p}}
                                        for i, p in enumerate(parameters)]}


@pytest.mark.parametrize("pattern", [
    "^([a-z]{1,50}){1,50}$",  # 65 s in xgrammar 0.2.9
    "^(([a-z]{1,5}){1,5}){1,5}$",  # 7 s
    "^(?:x[a-z]{1,16}){2,}$",
    "^[a-z]{2}" + "x" * 1100,  # too long
])
def test_costly_patterns_are_refused(pattern: str) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}
    _expect_400(parse_chat_request, _schema_request(schema), "response_format.json_schema.schema")
    _expect_400(parse_chat_request, _tools_request([schema]), "tools[0].function.parameters")


@pytest.mark.parametrize("pattern", [
    r"^\d{3}-\d{4}$", r"^(\d{3}-){2}\d{4}$", "^([a-z]{1,50})*$", "^([a-z]{1,50})+@x$", "^[a-z]{1,100000}$",
    r"^[{(]x{1,5}[)}]{2,3}$", r"^\({1,3}a{1,3}$", "^(ab){1,3}c{2,}$",
])
def test_ordinary_patterns_pass(pattern: str) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}
    assert parse_chat_request(_schema_request(schema)).response_format is not None


def test_schema_size_is_bounded_over_all_tools() -> None:
    from mllmd.openai.limits import MAX_SCHEMA_NODES

    big_enum = {"type": "object", "properties": {"a": {"enum": list(range(MAX_SCHEMA_NODES))}}}
    _expect_400(parse_chat_request, _schema_request(big_enum), "response_format.json_schema.schema")
    half = {"type": "object", "properties": {"a": {"enum": list(range(MAX_SCHEMA_NODES // 2))}}}
    assert parse_chat_request(_schema_request(half)).response_format is not None
    assert parse_chat_request(_tools_request([half])).tools is not None
    _expect_400(parse_chat_request, _tools_request([half, half]), "tools[1].function.parameters")
