"""OpenAI-compatible API layer: request/response shapes and model-output parsers."""
