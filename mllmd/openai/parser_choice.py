"""Which reasoning and tool-call parsers serve a model: `auto` reads them off the model itself.

A default install must split a Qwen3 model's `<think>` reasoning and `<tool_call>` blocks without
configuration, so `server.reasoning_parser` / `server.tool_call_parser` default to `auto`:

* the family comes from config.json's architecture (Qwen3, Qwen3-VL -> `qwen3`; Qwen3.5 -> `qwen3_5`);
  an architecture we do not know falls back to the template's markup (`<function=` is Qwen3.5's
  XML tool-call form);
* a parser is chosen only if the chat template (the administrator's `model.chat_template`, else the
  model's own) writes its markup: no `<think>` -> no reasoning parser (Qwen3-VL Instruct), no
  `<tool_call>` -> no tool-call parser. A model without a template gets neither.

`none` turns a parser off; an explicit name is used as given. This module reads only small text
files (no torch), for the main process.
"""

from __future__ import annotations

import json
from pathlib import Path

from mllmd.openai.reasoning_parser import THINK_START
from mllmd.openai.tool_parser import TOOL_CALL_START

AUTO = "auto"
NONE = "none"

# config.json architectures -> parser family
_FAMILIES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3",
    "Qwen3VLForConditionalGeneration": "qwen3",
    "Qwen3VLMoeForConditionalGeneration": "qwen3",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
}
_XML_CALL = "<function="  # Qwen3.5 / Qwen3-Coder tool-call bodies


def read_chat_template(tokenizer_dir: str | Path, override: str | Path | None = None) -> str | None:
    """The template text the tokenizer worker will render with: the override file, else the folder's
    `chat_template.jinja`, `chat_template.json` or `tokenizer_config.json` entry (all named templates of
    a list joined, since a `tool_use` one may carry the tool markup); None when there is none."""
    if override:
        try:
            return Path(override).read_text(encoding="utf-8")
        except OSError:
            return None
    root = Path(tokenizer_dir)
    try:
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    except OSError:
        pass
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            value = json.loads((root / name).read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = [t.get("template") for t in value if isinstance(t, dict)]
            joined = "\n".join(t for t in texts if isinstance(t, str))
            if joined:
                return joined
    return None


def model_family(architecture: str | None, template: str | None) -> str:
    """`qwen3` or `qwen3_5` for the model (the template's markup decides for unknown architectures)."""
    if architecture in _FAMILIES:
        return _FAMILIES[architecture]
    return "qwen3_5" if template and _XML_CALL in template else "qwen3"


def choose_reasoning_parser(setting: str | None, architecture: str | None, template: str | None) -> str | None:
    """The reasoning parser name for `server.reasoning_parser` = `setting`, or None for none."""
    if setting is None or setting == NONE:
        return None
    if setting != AUTO:
        return setting
    if not template or THINK_START not in template:
        return None
    return model_family(architecture, template)


def choose_tool_parser(setting: str | None, architecture: str | None, template: str | None) -> str | None:
    """The tool-call parser name for `server.tool_call_parser` = `setting`, or None for none."""
    if setting is None or setting == NONE:
        return None
    if setting != AUTO:
        return setting
    if not template or TOOL_CALL_START not in template:
        return None
    return model_family(architecture, template)


def choose_parsers(reasoning: str | None, tools: str | None, architecture: str | None,
                   tokenizer_dir: str | Path, override: str | Path | None = None) -> tuple[str | None, str | None]:
    """(reasoning parser, tool-call parser) for a model, reading its template only when a setting is auto."""
    template = None
    if AUTO in (reasoning, tools):
        template = read_chat_template(tokenizer_dir, override)
    return (choose_reasoning_parser(reasoning, architecture, template),
            choose_tool_parser(tools, architecture, template))
