"""A model folder's chat template cannot make the tokenizer worker spend unbounded time or memory.

Before: transformers rendered `{{ 'x' * 10**10 }}` (a 10 GB string) and two nested loops of
range(99999) as they were: the tokenizer worker stalled until its heartbeat timed out (about 10 s,
then a restart) on every chat request. Jinja's sandbox itself still holds (no `__class__`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from mllmd.workers import template_limits

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from mllmd.checkpoint.tokenizer import build_qwen_tokenizer

    out = Path(tmp_path_factory.mktemp("tok"))
    build_qwen_tokenizer(out)
    assert template_limits.install()
    return AutoTokenizer.from_pretrained(str(out))


def render(tokenizer: Any, template: str) -> str:
    return str(tokenizer.apply_chat_template(MESSAGES, chat_template=template, tokenize=False))


@pytest.mark.parametrize("template", [
    "{{ 'x' * 10**10 }}", "{{ 10**10 * 'x' }}", "{{ [0] * 10**9 }}", "{% set n = 10**10 %}{{ 'ab' * n }}",
    "{{ ((10 ** 1000) ** 1000) ** 1000 }}", "{{ 2 ** 100000 }}",
    "{% set ns = namespace(n=10 ** 1000) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
])  # fmt: skip
def test_huge_values_are_refused(tokenizer: Any, template: str) -> None:
    with pytest.raises(template_limits.TemplateLimitError):
        render(tokenizer, template)


def test_a_template_that_never_ends_is_stopped(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(template_limits, "MAX_RENDER_SECONDS", 0.5)
    start = time.monotonic()
    with pytest.raises(template_limits.TemplateLimitError, match="ran for more than"):
        render(tokenizer, "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}")
    assert time.monotonic() - start < 5


def test_the_sandbox_still_holds(tokenizer: Any) -> None:
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        render(tokenizer, "{{ ''.__class__.__mro__[1].__subclasses__() }}")


def test_real_templates_render_as_before(tokenizer: Any) -> None:
    """Qwen3's own template, repetition and powers within the bounds."""
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert render(tokenizer, "{{ '-' * 3 }}{{ 2 ** 10 }}{{ 3 * 4 }}{{ 2.0 ** 0.5 > 1 }}") == "---102412True"
