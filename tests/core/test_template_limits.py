"""A model folder's chat template cannot make the tokenizer worker spend unbounded time or memory.

Before: transformers rendered `{{ 'x' * 10**10 }}` (a 10 GB string) and two nested loops of
range(99999) as they were: the tokenizer worker stalled until its heartbeat timed out (about 10 s,
then a restart) on every chat request. Jinja's sandbox itself still holds (no `__class__`)."""

from __future__ import annotations

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
    # sizes given to filters, str methods and formats (each built a 10 GB string)
    "{{ 'x'|center(10**10) }}", "{{ 'x'|indent(10**10, true) }}", "{{ [1]|batch(10**10, 0)|list }}",
    "{{ messages|tojson(indent=10**10) }}", "{{ 'x'.ljust(10**10) }}", "{{ 'x'.zfill(10**10) }}",
    "{{ '\t'.expandtabs(10**10) }}", "{{ '%10000000000s' % 'x' }}", "{{ '%*s' % (10**10, 'x') }}",
    "{{ '{:>10000000000}'.format('x') }}", "{{ '{:>{}}'.format('x', 10**10) }}", "{{ '%s'|format('x'.rjust(10**10)) }}",
])  # fmt: skip
def test_huge_values_are_refused(tokenizer: Any, template: str) -> None:
    with pytest.raises(template_limits.TemplateLimitError):
        render(tokenizer, template)


def test_a_template_that_never_ends_is_stopped(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """10^10 iterations: only the deadline ends it (no wall-clock assertion: the error says it was that)."""
    monkeypatch.setattr(template_limits, "MAX_RENDER_SECONDS", 0.5)
    with pytest.raises(template_limits.TemplateLimitError, match="ran for more than 0.5 s"):
        render(tokenizer, "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}")


def test_the_sandbox_still_holds(tokenizer: Any) -> None:
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        render(tokenizer, "{{ ''.__class__.__mro__[1].__subclasses__() }}")


def test_real_templates_render_as_before(tokenizer: Any) -> None:
    """Qwen3's own template, repetition and powers within the bounds."""
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert render(tokenizer, "{{ '-' * 3 }}{{ 2 ** 10 }}{{ 3 * 4 }}{{ 2.0 ** 0.5 > 1 }}") == "---102412True"
    # big numbers where they are not sizes, and sizes within the bounds
    assert render(tokenizer, "{{ '%d' % 1733600000 }} {{ '{}'.format(10**12) }} {{ 10**12 % 7 }} {{ 'x'|center(5) }}"
                  " {{ 'ab'.ljust(4, '.') }} {{ '%5s' % 'x' }} {{ '{:>3}'.format(1) }}") == (
        "1733600000 1000000000000 1   x   ab..     x   1")


def test_the_main_thread_is_stopped_by_an_alarm_at_no_cost_per_line(tmp_path: Path) -> None:
    """The tokenizer worker renders generation requests in its main thread, where nothing else uses
    SIGALRM: the deadline is an alarm there (a trace function made every render 3-4x slower), and it
    stops a template that never ends; the alarm is disarmed after a render that ends in time.
    (pytest-timeout holds SIGALRM in this process, so a child process shows it.)"""
    import subprocess
    import sys

    code = f"""
import signal, time
from transformers import AutoTokenizer
from mllmd.checkpoint.tokenizer import build_qwen_tokenizer
from mllmd.workers import template_limits
build_qwen_tokenizer({str(tmp_path)!r})
template_limits.install()
template_limits.MAX_RENDER_SECONDS = 0.5
tok = AutoTokenizer.from_pretrained({str(tmp_path)!r})
assert template_limits._alarm_is_free()
msgs = [{{"role": "user", "content": "hi"}}]
assert tok.apply_chat_template(msgs, tokenize=False).startswith("<|im_start|>user")
assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
try:
    tok.apply_chat_template(msgs, chat_template="{{% for i in range(99999) %}}{{% for j in range(99999) %}}{{% endfor %}}{{% endfor %}}", tokenize=False)
except template_limits.TemplateLimitError as e:
    print("stopped:", e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "stopped: the chat template ran for more than 0.5 s" in out.stdout, out.stdout
