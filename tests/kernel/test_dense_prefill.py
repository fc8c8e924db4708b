"""Long fresh prompts attend through SDPA over their own K/V (gathered from the pool in token order):
the same attention as the paged extend kernel's reference, and the same greedy tokens and top
log-probabilities through the engine as the extend kernel gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mllmd_kernels import HAS_TRITON, extend_attention_ref, interpreting, triton_available

import mllmd.engine.attention.triton_backend as tb
from mllmd import LLM, SamplingParams
from tests.engine.test_parity import _tokenize

GPU = triton_available() and not interpreting()


@pytest.mark.parametrize("gqa_kwarg", [True, False])  # torch >= 2.5's enable_gqa, or Jetson's repeated heads
def test_dense_attention_equals_the_extend_reference(gqa_kwarg: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if gqa_kwarg and not tb._SDPA_GQA:
        pytest.skip(f"SDPA's enable_gqa is torch >= 2.5 (torch {torch.__version__})")
    monkeypatch.setattr(tb, "_SDPA_GQA", gqa_kwarg)
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, lens = 6, 2, 16, [13, 7]
    total = sum(lens)
    k_buf, v_buf = torch.randn(40, hkv, d, generator=g), torch.randn(40, hkv, d, generator=g)
    slots = torch.randperm(39, generator=g)[:total] + 1  # scattered over the pool, slot 0 unused
    table = torch.zeros(2, 16, dtype=torch.int64)
    table[0, :13], table[1, :7] = slots[:13], slots[13:]
    q = torch.randn(total, hq, d, generator=g)
    lengths = torch.tensor(lens)
    want = extend_attention_ref(q, k_buf, v_buf, table, torch.arange(2), lengths, lengths, 0.3)
    got = tb.dense_causal_attention(q, k_buf, v_buf, slots, [(0, 13), (13, 7)], 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    one = tb.dense_causal_attention(q[:13], k_buf, v_buf, slots[:13], [(0, 13)], 0.3)
    torch.testing.assert_close(one, want[:13], rtol=1e-5, atol=1e-5)


def test_dense_route_follows_the_h200_sweep() -> None:
    """The measured crossovers: 8B (32 heads of 128) wins from 2,048 tokens, VL-2B (16 of 128) from
    4,096, Qwen3.5 (16 of 256) from 1,024; nothing below 1,024."""
    assert not tb.dense_pays(1024, 32, 128) and tb.dense_pays(2048, 32, 128)
    assert not tb.dense_pays(2048, 16, 128) and tb.dense_pays(4096, 16, 128)
    assert tb.dense_pays(1024, 16, 256) and not tb.dense_pays(1023, 16, 256)
    assert not tb.dense_pays(512, 64, 128)


def test_only_head_dim_256_prompts_leave_the_prefill_graph_for_the_dense_route() -> None:
    """prefers_eager: several fresh bf16 prompts where SDPA pays at head_dim 256 run eagerly (the dense
    route); one fresh row keeps its graph (the fresh-row variant takes the route: fresh_route_pays); at
    head_dim 128 the graph stays (its gain beats SDPA's); a prefix hit, a short row or float32 never."""

    class _Pool:
        def __init__(self, dtype: torch.dtype) -> None:
            self.k_buffer = [torch.zeros(1, 1, 1, dtype=dtype)]

    backend = tb.TritonAttentionBackend(_Pool(torch.bfloat16), torch.zeros(1, 1, dtype=torch.int64))  # type: ignore[arg-type]
    assert backend.prefers_eager([0, 0], [1024, 1024], 16, 256) and backend.prefers_eager([0, 0], [2048, 1500], 16, 256)
    assert not backend.prefers_eager([0], [2048], 16, 256)  # one fresh row: its graph's fresh-row variant
    assert backend.fresh_route_pays(1024, 16, 256) and not backend.fresh_route_pays(768, 16, 256)
    assert backend.fresh_route_pays(2048, 32, 128) and not backend.fresh_route_pays(1536, 32, 128)
    assert not backend.prefers_eager([0, 0], [2048, 1000], 16, 256)  # the shortest row decides
    assert not backend.prefers_eager([0, 64], [2048, 2048], 16, 256)  # a prefix hit
    assert not backend.prefers_eager([0], [2048], 32, 128)  # 8B: SDPA pays, but less than the graph
    assert not backend.prefers_eager([], [], 16, 256)
    fp32 = tb.TritonAttentionBackend(_Pool(torch.float32), torch.zeros(1, 1, dtype=torch.int64))  # type: ignore[arg-type]
    assert not fp32.prefers_eager([0, 0], [2048, 2048], 16, 256) and not fp32.fresh_route_pays(2048, 16, 256)


@pytest.mark.skipif(not HAS_TRITON or not (GPU or interpreting()), reason="needs CUDA or the Triton interpreter")
def test_engine_tokens_equal_the_extend_kernel(qwen3_tied: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh prompts (no prefix) of 9+ tokens take the SDPA route when the threshold allows it; prefix
    hits and decodes keep the kernels. Greedy tokens and top-3 log-probabilities equal the route off."""
    device = "cuda" if GPU else "cpu"
    calls: list[int] = []
    real = tb.dense_causal_attention
    monkeypatch.setattr(tb, "dense_causal_attention", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    monkeypatch.setattr(tb, "DENSE_PREFILL_DTYPES", (torch.float32,))
    prompts = [p for p in _tokenize(qwen3_tied) if len(p) >= 9][:3]
    assert len(prompts) >= 2
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    results = {}
    for threshold in (9, 10**9):
        monkeypatch.setattr(tb, "DENSE_PREFILL_MIN_TOKENS", threshold)
        monkeypatch.setattr(tb, "DENSE_PREFILL_MIN_HEAD_TOKENS", 0)
        calls.clear()
        llm = LLM(str(qwen3_tied), device=device, dtype="float32", attention_backend="triton",
                  max_total_tokens=4096, chunked_prefill_size=0)  # fmt: skip
        outs = llm.generate(prompts, greedy) + llm.generate(prompts[:1], greedy)  # the second: a prefix hit
        assert outs[-1].cached_tokens > 0
        results[threshold] = [(o.token_ids, o.top_logprobs) for o in outs]
        if threshold == 9:
            assert calls and sum(calls) >= sum(len(p) for p in prompts), calls  # every fresh prompt
        else:
            assert not calls
    got, want = results[9], results[10**9]
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):  # per step: the top tokens and their logprobs
        for step_a, step_b in zip(a, b, strict=True):
            assert [tok for tok, _ in step_a] == [tok for tok, _ in step_b]
            assert max(abs(x - y) for (_, x), (_, y) in zip(step_a, step_b, strict=True)) < 1e-4
