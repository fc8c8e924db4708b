"""Overlap scheduling (scheduler.overlap_schedule): step N+1 is scheduled and launched before step N's
tokens reach the host. The outputs must be exactly those of the synchronous engine: same tokens,
finish reasons, usage counts and logprobs, with stops, length limits, preemption and aborts landing
while a batch is in flight, and all memory returned at the end."""

from __future__ import annotations

from pathlib import Path

import pytest

from mllmd import LLM, SamplingParams
from tests.engine.test_parity import GREEDY, NEW_TOKENS, SCENARIOS, hf_greedy


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_overlap_greedy_equals_transformers(qwen3_model: Path, scenario: str) -> None:
    prompts, expected = hf_greedy(qwen3_model)
    llm = LLM(str(qwen3_model), dtype="float32", overlap_schedule=True, **SCENARIOS[scenario])
    outs = llm.generate(prompts, GREEDY)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.token_ids == exp, f"prompt {i} diverged from transformers"
        assert out.finish_reason == ("stop" if len(exp) < NEW_TOKENS else "length")
    assert llm.engine.is_idle_and_clean()


def test_overlap_preemption_keeps_greedy_output(qwen3_model: Path) -> None:
    prompts, expected = hf_greedy(qwen3_model)
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    llm = LLM(
        str(qwen3_model), dtype="float32", overlap_schedule=True, max_total_tokens=longest + 40,
        chunked_prefill_size=32,
    )
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.preemptions > 0, "the KV pool was meant to be small enough to preempt"
    assert [o.token_ids for o in outs] == expected
    llm.engine.flush_cache()
    assert llm.engine.is_idle_and_clean()


def _run(model: Path, overlap: bool, params: list[SamplingParams], prompts: list[list[int]]) -> list:
    llm = LLM(str(model), dtype="float32", overlap_schedule=overlap)
    outs = llm.generate(prompts, params)
    assert llm.engine.is_idle_and_clean()
    return [(o.token_ids, o.finish_reason, o.logprobs, o.top_logprobs) for o in outs]


def test_overlap_sampling_stops_and_logprobs_match_synchronous(qwen3_model: Path) -> None:
    """Seeded sampling, stop tokens that end a request while its next batch is in flight, short
    length limits, logprobs, and penalties (which need the tokens on the host: no overlap there)."""
    prompts, expected = hf_greedy(qwen3_model)
    stop_at = expected[2][5]  # request 2 stops on its 6th greedy token
    params = [
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(max_tokens=3, temperature=0.0),
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_at]),
        SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=3, logprobs=True, top_logprobs=2),
        SamplingParams(max_tokens=16, temperature=0.7, seed=11, frequency_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=25, temperature=0.9, min_p=0.05, seed=5),
        SamplingParams(max_tokens=9, temperature=0.0, logprobs=True),
    ]
    sync = _run(qwen3_model, False, params, prompts)
    over = _run(qwen3_model, True, params, prompts)
    assert over == sync
    assert sync[2][0][-1] == stop_at and sync[2][1] == "stop" and len(sync[1][0]) == 3


def test_overlap_reports_each_token_once_with_exact_usage(qwen3_model: Path) -> None:
    prompts, _ = hf_greedy(qwen3_model)
    llm = LLM(str(qwen3_model), dtype="float32", overlap_schedule=True)
    engine = llm.engine
    for i, ids in enumerate(prompts[:4]):
        engine.add_request(f"u{i}", ids, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    seen: dict[str, list[int]] = {}
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert -1 not in out.new_token_ids
            seen.setdefault(out.rid, []).extend(out.new_token_ids)
            assert out.completion_tokens == len(seen[out.rid])
            if out.finished:
                finals[out.rid] = out
    assert sorted(finals) == [f"u{i}" for i in range(4)]
    assert all(len(v) == 10 and finals[k].finish_reason == "length" for k, v in seen.items())
    assert engine.is_idle_and_clean()


def test_overlap_abort_while_in_flight_frees_everything(qwen3_model: Path) -> None:
    prompts, _ = hf_greedy(qwen3_model)
    llm = LLM(str(qwen3_model), dtype="float32", overlap_schedule=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts[:3]):
        engine.add_request(f"a{i}", ids, params)
    outs = []
    for _ in range(4):
        outs += engine.step()
    assert engine._inflight is not None, "a batch should be in flight between steps"
    assert engine.abort("a1")
    while engine.has_unfinished():
        outs += engine.step()
    a1 = [o for o in outs if o.rid == "a1"]
    assert a1[-1].finished and a1[-1].finish_reason == "abort"
    assert a1[-1].completion_tokens == sum(len(o.new_token_ids) for o in a1)
    assert all(o.rid != "a1" for o in outs[outs.index(a1[-1]) + 1 :]), "no tokens after the abort"
    engine.flush_cache()
    assert engine.is_idle_and_clean()
