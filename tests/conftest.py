"""Shared fixtures: tiny random-weight Qwen3 checkpoints (real configs, real tokenizer), built once."""

from __future__ import annotations

from pathlib import Path

import pytest


def _build(tmp_path_factory: pytest.TempPathFactory, name: str, **kwargs) -> Path:
    from mllmd.testing.checkpoints import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp(name), "Qwen3-0.6B", **kwargs)


@pytest.fixture(scope="session")
def qwen3_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2-layer Qwen3 (hidden 64, GQA 4/2 heads) with tied embeddings, float32."""
    return _build(tmp_path_factory, "qwen3_tied", tie_word_embeddings=True, seed=1)


@pytest.fixture(scope="session")
def qwen3_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shape with a separate lm_head, saved as a sharded checkpoint (index + several files)."""
    return _build(tmp_path_factory, "qwen3_untied", tie_word_embeddings=False, seed=2, max_shard_size="10MB")


@pytest.fixture(scope="session", params=["tied", "untied"])
def qwen3_model(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"qwen3_{request.param}")


@pytest.fixture(autouse=True)
def _release_cuda_memory():
    """On a GPU every engine sizes its KV cache from the free device memory: collect the previous
    test's engines (the model runner and its CUDA graphs form reference cycles) and return their
    cached blocks to the device before the next test measures. Nothing to do without CUDA."""
    yield
    import torch

    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
