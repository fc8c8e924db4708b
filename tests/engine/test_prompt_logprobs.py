"""Prompt logprobs (completions' echo with logprobs): every prompt token after the first gets the
logprob the model gives it, equal to transformers' log-softmax of the same checkpoint, whether the
prompt is prefilled at once or in chunks, and whatever the prefix cache holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mllmd import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."


@pytest.fixture(scope="module")
def reference(qwen3_tied: Path) -> tuple[list[int], torch.Tensor]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3_tied))
    ids = tok.encode(PROMPT, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(str(qwen3_tied), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return ids, lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


@pytest.mark.parametrize("chunk, cap", [(None, None), (7, None), (None, 4)])
def test_prompt_logprobs_equal_transformers(qwen3_tied: Path, reference: tuple[list[int], torch.Tensor],
                                            chunk: int | None, cap: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cap`: the prompt-logprob rows a step may compute (scheduler.PROMPT_LOGPROB_CHUNK, 512)."""
    if cap is not None:
        monkeypatch.setattr("mllmd.engine.scheduler.PROMPT_LOGPROB_CHUNK", cap)
    ids, want = reference
    kw = {"chunked_prefill_size": chunk} if chunk else {}
    llm = LLM(str(qwen3_tied), **kw)
    llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0))  # the prompt is now in the prefix cache
    engine = llm.engine
    engine.add_request("p", ids, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=True, top_logprobs=2))
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.rid == "p" and out.new_token_ids and first is None:
                first = out
    assert first is not None and first.prompt_logprobs is not None
    got = torch.tensor(first.prompt_logprobs)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert first.prompt_top_logprobs is not None and len(first.prompt_top_logprobs) == len(ids) - 1
    assert all(len(t) == 2 and t[0][1] >= t[1][1] for t in first.prompt_top_logprobs)
    assert first.cached_tokens == 0  # the cached copy of the prompt was not used


def test_prompt_logprobs_survive_preemption(qwen3_tied: Path, reference: tuple[list[int], torch.Tensor]) -> None:
    """A KV pool too small for four requests at once preempts some; each still reports every prompt
    token's logprob once, with the right values."""
    ids, want = reference
    llm = LLM(str(qwen3_tied), max_total_tokens=2 * len(ids) + 60, chunked_prefill_size=7)
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=True)
    for i in range(4):
        engine.add_request(f"r{i}", ids, params)
    firsts = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and out.rid not in firsts:
                firsts[out.rid] = out
    assert engine.scheduler.stats.preemptions > 0, "the KV pool was meant to be small enough to preempt"
    assert sorted(firsts) == ["r0", "r1", "r2", "r3"]
    for out in firsts.values():
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids) - 1
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs), want, atol=2e-4, rtol=1e-4)


def test_the_prompt_logprob_rows_of_a_step_are_bounded_for_all_requests_together(
        qwen3_tied: Path, reference: tuple[list[int], torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the cap held per request, so a batch of prompts with echo + logprobs put 512 rows of each
    in one step (16 of them: 8,192 vocabulary-wide float32 rows, 5 GB); now the step's prompt rows,
    all requests together, stay within PROMPT_LOGPROB_CHUNK, and every request still gets them all."""
    monkeypatch.setattr("mllmd.engine.scheduler.PROMPT_LOGPROB_CHUNK", 6)
    ids, want = reference
    llm = LLM(str(qwen3_tied))
    engine = llm.engine
    rows_per_step: list[int] = []
    forward = engine.runner.forward

    def counting(batch: object) -> torch.Tensor:
        rows_per_step.append(sum(count for _, _, count in batch.prompt_spans))  # type: ignore[attr-defined]
        return forward(batch)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.runner, "forward", counting)
    for i in range(4):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True))
    firsts = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and out.rid not in firsts:
                firsts[out.rid] = out
    assert max(rows_per_step) <= 6 and sum(rows_per_step) == 4 * (len(ids) - 1), rows_per_step
    for out in firsts.values():
        assert out.prompt_logprobs is not None
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs), want, atol=2e-4, rtol=1e-4)
