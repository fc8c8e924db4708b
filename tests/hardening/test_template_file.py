"""Issue 35, item 2, the other half: the one template a client cannot send, the administrator can
configure (model.chat_template); the tokenizer worker uses it for every chat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mllmd.config import ConfigError
from mllmd.daemon.config import load_config
from tests.daemon.conftest import start_daemon, stop_and_check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}ANSWER:{% endif %}"


def test_model_chat_template_is_used(tiny_model: Path, tokenizer: Any, tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    d = start_daemon(tiny_model, "--model.chat_template", str(template))
    try:
        with d.http() as h:
            r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello there"}],
                                                     "max_tokens": 1})
            assert r.status_code == 200, r.text
            want = len(tokenizer.encode("<<hello there>>ANSWER:", add_special_tokens=False))
            assert r.json()["usage"]["prompt_tokens"] == want
            r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                     "chat_template_kwargs": {"chat_template": "{{ 1 }}"}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.chat_template"
    finally:
        stop_and_check(d)


@pytest.mark.parametrize("content", [None, "", "x" * ((1 << 20) + 1)])
def test_a_template_file_that_cannot_be_used_is_a_config_error(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "t.jinja"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_config("/dev/null", {"model.chat_template": str(path)}, environ={})
    assert info.value.key == "model.chat_template"
