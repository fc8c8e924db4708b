"""The JSON grammars of structured output accept exactly valid JSON strings: xgrammar 0.2.9 writes a
length-bounded string (minLength / maxLength) as a character class that lets raw control characters
through (a reply pydantic and json.loads refuse) and no escapes; `json_schema_grammar` mends it."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from mllmd.sampling_params import OutputConstraint
from mllmd.structured.grammar import build_grammar, json_schema_grammar

SCHEMA = json.dumps({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 4}, "code": {"type": "string", "minLength": 2},
    "free": {"type": "string"}}, "required": ["name", "code", "free"], "additionalProperties": False})


def accepts(grammar: object, text: str) -> bool:
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["a"])).compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return bool(matcher.accept_string(text)) and matcher.is_terminated()


def reply(name: str, code: str = "xy", free: str = "f") -> str:
    return f'{{"name": "{name}", "code": "{code}", "free": "{free}"}}'


@pytest.mark.parametrize("make", [
    lambda: json_schema_grammar(xgr, SCHEMA),
    lambda: build_grammar(xgr, OutputConstraint("json_schema", SCHEMA, strict=True)),
])
def test_bounded_strings_take_json_characters_only(make) -> None:  # type: ignore[no-untyped-def]
    g = make()
    assert accepts(g, reply("abcd"))
    assert not accepts(g, reply("abcde"))  # maxLength still holds
    for bad in ("a\tb", "a\x00", "a\x1fb", "a\nb"):
        assert not accepts(g, reply(bad)), repr(bad)
        assert not accepts(g, reply("ab", code=bad)), repr(bad)
        assert not accepts(g, reply("ab", free=bad)), repr(bad)  # as the unbounded strings always did
    # escapes are JSON characters: one counts as one character of maxLength
    assert accepts(g, reply('a\\tb\\"')) and json.loads(reply('a\\tb\\"'))["name"] == 'a\tb"'
    assert accepts(g, reply("\\u00e9"))
    assert not accepts(g, reply('a\\tb\\"c'))  # five characters


def test_a_schema_without_bounded_strings_keeps_xgrammars_grammar() -> None:
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    assert str(json_schema_grammar(xgr, schema)) == str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
