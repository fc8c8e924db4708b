"""The attacks of issue 35 as a suite, each against the real daemon (the fixtures of tests/daemon)."""

from __future__ import annotations

from tests.daemon.conftest import daemon_factory, tiny_model, tokenizer  # noqa: F401 (fixtures)
