"""Structured outputs: grammars built from OutputConstraints (xgrammar), per-request matchers, and
the token mask applied to a step's logits on the device."""
