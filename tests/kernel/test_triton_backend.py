"""The `triton` attention backend through the whole engine: greedy tokens equal the `torch` backend's
and transformers' (fp32, batch 8 with mixed lengths, chunked prefill 7, radix cache on)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mllmd_kernels import HAS_TRITON, interpreting, triton_available

from mllmd import LLM, SamplingParams
from mllmd.engine.attention import create_attention_backend
from mllmd.engine.memory import KVPool
from tests.engine.test_parity import NEW_TOKENS, _tokenize, hf_greedy

GPU = triton_available() and not interpreting()
CHUNK7 = {"chunked_prefill_size": 7, "max_prefill_tokens": 16}


def _pool(device: str) -> tuple[KVPool, torch.Tensor]:
    pool = KVPool(
        num_layers=1, num_kv_heads=1, head_dim=8, size=4, dtype=torch.float32, device=torch.device(device)
    )
    return pool, torch.zeros(2, 4, dtype=torch.int32, device=device)


def test_backend_factory() -> None:
    pool, table = _pool("cpu")
    assert type(create_attention_backend("auto", "cpu", pool, table)).__name__ == "TorchAttentionBackend"
    if not interpreting():
        with pytest.raises(ValueError, match="attention_backend"):
            create_attention_backend("triton", "cpu", pool, table)
    with pytest.raises(ValueError, match="attention_backend"):
        create_attention_backend("nope", "cpu", pool, table)
    with pytest.raises(ValueError, match="attention_backend: 'flashinfer' needs a CUDA device"):
        create_attention_backend("flashinfer", "cpu", pool, table)
    if GPU:
        pool, table = _pool("cuda")
        backend = create_attention_backend("auto", "cuda", pool, table)
        assert type(backend).__name__ == "TritonAttentionBackend"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and triton")
@pytest.mark.parametrize("scenario", ["chunk7_radix", "no_chunking"])
def test_triton_backend_greedy_equals_torch_and_transformers(qwen3_model: Path, scenario: str) -> None:
    prompts, expected = hf_greedy(qwen3_model)
    extra = CHUNK7 if scenario == "chunk7_radix" else {"chunked_prefill_size": 0}
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    results = {}
    for backend in ("triton", "torch"):
        llm = LLM(str(qwen3_model), device="cuda", dtype="float32", attention_backend=backend,
                  max_total_tokens=20000, **extra)
        assert type(llm.engine.runner.attn_backend).__name__.lower().startswith(backend)
        outs = llm.generate(prompts, greedy)
        # Run the prompts again: radix hits turn the second pass into extends over cached prefixes.
        again = llm.generate(prompts, greedy)
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
        assert sum(o.cached_tokens for o in again) > 0
        assert llm.engine.is_idle_and_clean()
        results[backend] = [o.token_ids for o in outs]
    for i, exp in enumerate(expected):
        assert results["triton"][i] == exp, f"prompt {i}: triton backend diverged from transformers"
    assert results["triton"] == results["torch"]


@pytest.mark.skipif(not (HAS_TRITON and interpreting()) or GPU, reason="interpreter-only smoke test")
def test_triton_backend_under_the_interpreter(qwen3_tied: Path) -> None:
    """CPU development path: a short mixed batch through the Triton kernels in the interpreter."""
    prompts = _tokenize(qwen3_tied)[2:5]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    results = {}
    for backend in ("triton", "torch"):
        llm = LLM(str(qwen3_tied), device="cpu", dtype="float32", attention_backend=backend, **CHUNK7)
        assert type(llm.engine.runner.attn_backend).__name__.lower().startswith(backend)
        results[backend] = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert results["triton"] == results["torch"]


@pytest.mark.skipif(not HAS_TRITON or not (GPU or interpreting()), reason="needs CUDA or the Triton interpreter")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rope_kernel_writes_the_kv_pool_for_the_backend(qwen3_tied: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused RoPE kernel writes each step's K/V into the pool itself (no store_cache launch); the
    backend then only attends. Greedy tokens and top log-probabilities over prefill chunks, radix hits
    and decode steps equal, bit for bit, the route where the backend stores K/V."""
    import mllmd.models.layers.attention as attention_mod
    import mllmd.models.layers.fusion as fusion_mod
    from mllmd.engine.memory import KVPool

    device = "cuda" if GPU else "cpu"
    monkeypatch.setattr(attention_mod, "fused_kernels", lambda x: True)  # the interpreter's RoPE on the CPU
    stores = []
    real_store = KVPool.store
    monkeypatch.setattr(KVPool, "store", lambda self, *a: stores.append(a[0]) or real_store(self, *a))
    prompts = _tokenize(qwen3_tied)[1:4]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(fusion_mod, "ROPE_STORES_KV", fused)
        stores.clear()
        # a fixed KV pool: on a GPU the budget would otherwise be most of the device, twice over
        llm = LLM(str(qwen3_tied), device=device, dtype="float32", attention_backend=backend,
                  max_total_tokens=4096, **CHUNK7)  # fmt: skip
        outs = llm.generate(prompts, greedy) + llm.generate(prompts[:1], greedy)  # the second: a radix hit
        assert outs[-1].cached_tokens > 0 and llm.engine.is_idle_and_clean()
        results[fused] = [(o.token_ids, o.top_logprobs) for o in outs]
        assert (len(stores) == 0) == fused, f"{len(stores)} store_cache calls with fused={fused}"
    assert results[True] == results[False]
