"""Greedy decoding and prefill logits equal Hugging Face transformers on the same random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mllmd import LLM, SamplingParams

PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "请用一句话介绍一下你自己。",
    "In 1905 Albert Einstein published four papers that changed physics: on the photoelectric effect, "
    "Brownian motion, special relativity and the equivalence of mass and energy. Summarise them.",
    "1, 2, 3, 4, 5,",
    "<|im_start|>user\nWrite a haiku about GPUs.<|im_end|>\n<|im_start|>assistant\n",
    "Edge devices such as the Jetson Orin share memory between CPU and GPU; this changes how an "
    "inference server must size its KV cache, because free memory reported by the driver is not the "
    "whole story and the operating system also needs room.",
]
NEW_TOKENS = 64


def _tokenize(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(p) for p in PROMPTS]


_HF_CACHE: dict[Path, tuple[list[list[int]], list[list[int]]]] = {}


def hf_greedy(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, generated ids) from transformers' generate, one prompt at a time, fp32."""
    if model_dir not in _HF_CACHE:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        prompts = _tokenize(model_dir)
        outs = []
        with torch.inference_mode():
            for ids in prompts:
                x = torch.tensor([ids])
                y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False)
                outs.append(y[0, len(ids) :].tolist())
        _HF_CACHE[model_dir] = (prompts, outs)
    return _HF_CACHE[model_dir]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)

SCENARIOS = {
    "radix": {},
    "no_radix": {"disable_radix_cache": True},
    "chunk7": {"chunked_prefill_size": 7, "max_prefill_tokens": 16},
    "no_chunking": {"chunked_prefill_size": 0},
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_batch8_greedy_equals_transformers(qwen3_model: Path, scenario: str) -> None:
    prompts, expected = hf_greedy(qwen3_model)
    llm = LLM(str(qwen3_model), dtype="float32", **SCENARIOS[scenario])
    outs = llm.generate(prompts, GREEDY)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.token_ids == exp, f"prompt {i} diverged from transformers"
        assert out.finish_reason == ("stop" if len(exp) < NEW_TOKENS else "length")
    assert llm.engine.is_idle_and_clean()


def test_batch1_greedy_equals_transformers(qwen3_model: Path) -> None:
    prompts, expected = hf_greedy(qwen3_model)
    llm = LLM(str(qwen3_model), dtype="float32")
    for ids, exp in zip(prompts, expected):
        assert llm.generate([ids], GREEDY)[0].token_ids == exp


def test_preemption_keeps_greedy_output(qwen3_model: Path) -> None:
    prompts, expected = hf_greedy(qwen3_model)
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    llm = LLM(str(qwen3_model), dtype="float32", max_total_tokens=longest + 40, chunked_prefill_size=32)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.preemptions > 0, "the KV pool was meant to be small enough to preempt"
    assert [o.token_ids for o in outs] == expected
    llm.engine.flush_cache()
    assert llm.engine.runner.allocator.available_size() == llm.engine.runner.max_total_tokens


def _hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_prefill_logits_match_transformers(qwen3_model: Path) -> None:
    """All-position logits of a mixed batch, one row of it continuing after a cached prefix."""
    prompts = _tokenize(qwen3_model)
    llm = LLM(str(qwen3_model), dtype="float32", chunked_prefill_size=0)
    engine = llm.engine
    # Cache the first 20 tokens of prompt 4 so that its row below is an extend with a prefix.
    llm.generate([prompts[4][:20]], SamplingParams(max_tokens=1, temperature=0.0))
    for rid, ids in enumerate(prompts[:5]):
        engine.add_request(f"r{rid}", ids, SamplingParams(max_tokens=1, temperature=0.0))
    sched = engine.scheduler.schedule()
    assert sched is not None and len(sched.reqs) == 5
    assert sched.prefix_lens[4] == 20
    batch = engine.runner.prepare(sched)
    batch.logits_indices = torch.arange(batch.num_tokens)
    logits = engine.runner.forward(batch)
    start = 0
    for req, p, n in zip(sched.reqs, sched.prefix_lens, sched.extend_lens):
        ours = logits[start : start + n]
        start += n
        ref = _hf_logits(qwen3_model, req.token_ids)[p : p + n]
        assert _rel(ours, ref) < 1e-4
        assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
