"""`auto` parser selection from a model's architecture and chat template (the vendored real configs)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mllmd.checkpoint.tokenizer import DATA_DIR
from mllmd.openai.parser_choice import choose_parsers, choose_reasoning_parser, read_chat_template
from mllmd.openai.reasoning_parser import Qwen35ReasoningParser, ReasoningParser, get_reasoning_parser


def _arch(name: str) -> str:
    return json.loads((DATA_DIR / name / "config.json").read_text())["architectures"][0]


@pytest.mark.parametrize(("model", "reasoning", "tools"), [
    ("Qwen3-0.6B", "qwen3", "qwen3"),
    ("Qwen3-8B", "qwen3", "qwen3"),
    ("Qwen3.5-0.8B", "qwen3_5", "qwen3_5"),
    ("Qwen3.5-4B", "qwen3_5", "qwen3_5"),
    ("Qwen3.5-9B", "qwen3_5", "qwen3_5"),
])
def test_auto_picks_the_family_of_the_model(model: str, reasoning: str, tools: str) -> None:
    assert choose_parsers("auto", "auto", _arch(model), DATA_DIR / model) == (reasoning, tools)


def test_auto_qwen3_vl_instruct_template_has_no_think(tmp_path: Path) -> None:
    """Qwen3-VL Instruct's template writes <tool_call> but no <think>: tools on, reasoning off."""
    src = DATA_DIR / "Qwen3-VL-2B-Instruct"
    shutil.copyfile(next(src.glob("chat_template*.jinja")), tmp_path / "chat_template.jinja")
    assert choose_parsers("auto", "auto", _arch("Qwen3-VL-2B-Instruct"), tmp_path) == (None, "qwen3")
    # the administrator's template file wins over the folder's
    override = tmp_path / "thinking.jinja"
    override.write_text("{{ '<think>' }}{{ '<tool_call>' }}")
    assert choose_parsers("auto", "auto", "Qwen3VLForConditionalGeneration", tmp_path, override) == ("qwen3", "qwen3")


def test_auto_without_a_template_is_none(tmp_path: Path) -> None:
    assert read_chat_template(tmp_path) is None
    assert choose_parsers("auto", "auto", "Qwen3ForCausalLM", tmp_path) == (None, None)


def test_none_and_explicit_settings(tmp_path: Path) -> None:
    model = DATA_DIR / "Qwen3-0.6B"
    assert choose_parsers("none", "none", "Qwen3ForCausalLM", model) == (None, None)
    assert choose_parsers(None, None, "Qwen3ForCausalLM", model) == (None, None)  # null, as before
    assert choose_parsers("qwen3_5", "qwen3", "Qwen3ForCausalLM", tmp_path) == ("qwen3_5", "qwen3")


def test_unknown_architecture_goes_by_the_template(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "<think>"},
                           {"name": "tool_use", "template": "<tool_call><function=f>"}]}))
    assert choose_parsers("auto", "auto", "SomethingElse", tmp_path) == ("qwen3_5", "qwen3_5")
    assert choose_reasoning_parser("auto", "SomethingElse", "<think>") == "qwen3"


def test_qwen3_5_variant_starts_in_reasoning_and_ends_at_a_tool_call() -> None:
    cls = get_reasoning_parser("qwen3_5")
    assert cls is Qwen35ReasoningParser and issubclass(cls, ReasoningParser) and cls.name == "qwen3_5"
    parser = cls(starts_in_reasoning=True, ends_at_tool_call=True)
    assert parser.extract("Need the weather.\n<tool_call>\n{}") == ("Need the weather.", "<tool_call>\n{}")
    assert parser.extract("Thought.\n</think>\n\nAnswer.") == ("Thought.", "Answer.")
