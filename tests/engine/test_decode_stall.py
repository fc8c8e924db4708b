"""scheduler.max_decode_stall_ms: while requests decode, a step's tokens are capped by what the steps
cost per token (StepCostModel, learned from the steps' own times), so a long new prompt comes in
shorter chunks; the tokens are those of an uncapped run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mllmd import LLM, SamplingParams
from mllmd.engine.step_cost import (
    AUTO_DECODE_STEPS,
    DECODE_TIMING_EVERY,
    MIN_CAPPED_TOKENS,
    MIN_OBSERVED_TOKENS,
    StepCostModel,
    StepTimer,
    stall_budget_s,
)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 5000) for _ in range(n)]


def capped_engine(
    model: Path, per_token_s: float | None, buckets: list[int] | None = None
) -> tuple[LLM, list[tuple[str, int]]]:
    """An engine with a 5 ms stall budget whose cost model is frozen at `per_token_s` (with the prefill
    graphs' token `buckets` of a GPU, where given); returns it and a log of each scheduled (request,
    tokens) row."""
    llm = LLM(str(model), dtype="float32", device="cpu", max_total_tokens=4096, chunked_prefill_size=512,
              max_decode_stall_ms=5.0)
    cost = llm.engine.step_cost
    assert cost is not None
    assert cost.buckets == []  # on the CPU steps run eagerly: nothing to round to
    cost.seconds_per_token = per_token_s
    if buckets is not None:
        cost.buckets = buckets
    cost.observe = lambda tokens, seconds: None  # type: ignore[method-assign]  # frozen: the test sets it
    rows: list[tuple[str, int]] = []
    real = llm.engine.scheduler.schedule

    def logged():  # type: ignore[no-untyped-def]
        batch = real()
        if batch is not None:
            rows.extend((r.rid, n) for r, n in zip(batch.reqs, batch.extend_lens))
        return batch

    llm.engine.scheduler.schedule = logged  # type: ignore[method-assign]
    return llm, rows


def run(llm: LLM, prompts: dict[str, list[int]], start_b_after: int = 3) -> dict[str, list[int]]:
    engine = llm.engine
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    engine.add_request("a", prompts["a"], GREEDY)
    for _ in range(start_b_after):
        for o in engine.step():
            out[o.rid] += o.new_token_ids
    engine.add_request("b", prompts["b"], GREEDY)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.rid] += o.new_token_ids
    assert engine.is_idle_and_clean()
    return out


def test_a_prompt_arriving_while_others_decode_comes_in_capped_chunks(qwen3_tied: Path) -> None:
    prompts = {"a": ids(30, 1), "b": ids(300, 2)}
    llm, rows = capped_engine(qwen3_tied, 0.05e-3)  # 0.05 ms a token: 100 tokens in 5 ms
    got = run(llm, prompts)
    b_chunks = [n for rid, n in rows if rid == "b" and n > 1]
    assert b_chunks == [99, 99, 99, 3]  # 100 tokens a step, one of them a's decode
    assert rows[0] == ("a", 30)  # nothing decoded yet: a's prompt in one step
    plain = LLM(str(qwen3_tied), dtype="float32", device="cpu", max_total_tokens=4096)
    assert got["b"] == plain.generate([prompts["b"]], GREEDY)[0].token_ids
    assert got["a"] == plain.generate([prompts["a"]], GREEDY)[0].token_ids


def test_the_cap_rounds_down_to_a_graph_bucket(qwen3_tied: Path) -> None:
    """Where mixed steps replay graphs of 96 and 128 tokens, a 100-token cap would run the 128-token
    graph, past the budget: the step takes 96 tokens instead, and pads nothing."""
    prompts = {"a": ids(30, 1), "b": ids(300, 2)}
    llm, rows = capped_engine(qwen3_tied, 0.05e-3, buckets=[16, 32, 64, 96, 128, 192, 256, 384, 512])
    got = run(llm, prompts)
    assert [n for rid, n in rows if rid == "b" and n > 1] == [95, 95, 95, 15]
    plain = LLM(str(qwen3_tied), dtype="float32", device="cpu", max_total_tokens=4096)
    assert got["b"] == plain.generate([prompts["b"]], GREEDY)[0].token_ids


def test_the_cap_leaves_prefill_work_at_least_its_floor(qwen3_tied: Path) -> None:
    llm, rows = capped_engine(qwen3_tied, 1.0)  # a second a token: the budget allows none
    run(llm, {"a": ids(30, 1), "b": ids(100, 2)})
    assert [n for rid, n in rows if rid == "b" and n > 1] == [MIN_CAPPED_TOKENS] * 3 + [4]


def test_no_cap_before_anything_was_measured(qwen3_tied: Path) -> None:
    llm, rows = capped_engine(qwen3_tied, None)
    run(llm, {"a": ids(30, 1), "b": ids(300, 2)})
    assert [n for rid, n in rows if rid == "b" and n > 1] == [300]


def test_steps_teach_the_model_and_off_means_no_timing(qwen3_tied: Path) -> None:
    on = LLM(str(qwen3_tied), dtype="float32", device="cpu", max_total_tokens=4096, max_decode_stall_ms=5.0)
    assert on.engine.step_cost is not None and on.engine.step_cost.seconds_per_token is None
    on.generate([ids(MIN_OBSERVED_TOKENS + 10, 3)], GREEDY)
    assert (on.engine.step_cost.seconds_per_token or 0) > 0
    off = LLM(str(qwen3_tied), dtype="float32", device="cpu", max_total_tokens=4096)
    off.generate([ids(100, 3)], GREEDY)
    assert off.engine.step_cost is None and off.engine._step_timers == []


def test_cost_model_average_and_floor() -> None:
    m = StepCostModel(smoothing=0.5)
    assert m.tokens_within(0.005) is None
    m.observe(MIN_OBSERVED_TOKENS - 1, 1.0)  # too small a step to count
    assert m.seconds_per_token is None
    m.observe(100, 0.010)
    assert m.seconds_per_token == pytest.approx(1e-4)
    m.observe(200, 0.060)
    assert m.seconds_per_token == pytest.approx(2e-4)  # halfway to 3e-4
    assert m.tokens_within(0.005) == MIN_CAPPED_TOKENS  # 25 tokens fit in 5 ms; the floor is 32
    assert m.tokens_within(1.0) == 5000


def test_cost_model_rounds_the_cap_down_to_a_bucket() -> None:
    m = StepCostModel(buckets=[16, 32, 64, 96, 128, 192, 256, 384, 512])
    m.seconds_per_token = 1e-5
    assert m.tokens_within(0.0030) == 256  # 300 tokens fit: the 384-token graph would not
    assert m.tokens_within(0.0019) == 128  # 190
    assert m.tokens_within(0.0060) == 600  # past the last bucket: an eager step, no padding
    m.seconds_per_token = 2.0**-16  # exact in binary: 512 tokens fit exactly
    assert m.tokens_within(512 * 2.0**-16) == 512
    assert m.tokens_within(20 * 2.0**-16) == MIN_CAPPED_TOKENS  # 20 tokens: bucket 16, then the floor


def test_a_graph_step_counts_its_bucket_tokens() -> None:
    """The engine counts a step that replayed a graph at its bucket's tokens (padding is work too)."""
    m = StepCostModel(smoothing=1.0)
    m.observe(128, 0.0064)  # a 100-token step that ran the 128-token graph
    assert m.seconds_per_token == pytest.approx(5e-5)


def test_cpu_step_timer_measures_the_wall_time() -> None:
    import time

    import torch

    t = StepTimer.begin(10, torch.device("cpu"))
    assert t.seconds() is None
    time.sleep(0.01)
    t.stop()
    assert (t.seconds() or 0) >= 0.01


def test_only_steps_with_prefill_work_are_learned_from(qwen3_tied: Path) -> None:
    """Decode-only steps (CUDA graphs on a GPU, another cost per token) do not teach the model, even
    with 64 rows: 64 two-token prompts give one 128-token prefill step, then 64-row decode steps."""
    llm = LLM(str(qwen3_tied), dtype="float32", device="cpu", max_total_tokens=4096, max_running_requests=64,
              max_decode_stall_ms=5.0)
    cost = llm.engine.step_cost
    assert cost is not None
    seen: list[int] = []
    real = cost.observe
    cost.observe = lambda tokens, seconds: (seen.append(tokens), real(tokens, seconds))[1]  # type: ignore[method-assign]
    llm.generate([ids(2, 10 + i) for i in range(64)], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert seen == [128]


# --- max_decode_stall_ms null (the default): on a GPU, twice a decode-only step of the running batch ---


def test_the_auto_budget_is_two_decode_steps_and_needs_one_measured() -> None:
    assert stall_budget_s(None, None) is None  # nothing measured yet: no cap
    assert stall_budget_s(None, 0.007) == pytest.approx(AUTO_DECODE_STEPS * 0.007) == pytest.approx(0.014)
    assert stall_budget_s(5.0, 0.007) == pytest.approx(0.005)  # a configured budget wins
    assert stall_budget_s(0.0, 0.007) is None  # off
    m = StepCostModel(smoothing=0.5)
    m.observe_decode(0.004)
    m.observe_decode(0.008)
    assert m.decode_step_s == pytest.approx(0.006)
    m.observe_decode(0.0)  # an unread timer
    assert m.decode_step_s == pytest.approx(0.006)


def test_default_is_off_on_the_cpu(qwen3_tied: Path) -> None:
    """The default (null) follows measured step times only on a GPU, where steps are timed by the device;
    on the CPU scheduling stays what the configuration says."""
    llm = LLM(str(qwen3_tied), dtype="float32", device="cpu", max_total_tokens=4096)
    assert llm.engine.config.max_decode_stall_ms is None
    assert llm.engine.step_cost is None and llm.engine.scheduler.decode_stall_tokens is None


def test_auto_budget_learns_from_decode_steps(qwen3_tied: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the budget left to the engine (as on a GPU), one decode-only step in DECODE_TIMING_EVERY is
    timed, and the cap is what the per-token cost allows in two of them; a later prompt is cut to it."""
    from mllmd.engine.engine import Engine

    monkeypatch.setattr(Engine, "_stall_cap_on", lambda self: True)
    llm = LLM(str(qwen3_tied), dtype="float32", device="cpu", max_total_tokens=4096, chunked_prefill_size=512)
    engine, cost = llm.engine, llm.engine.step_cost
    assert cost is not None and engine.scheduler.decode_stall_tokens is not None
    seen: list[float] = []
    real = cost.observe_decode
    cost.observe_decode = lambda s: (seen.append(s), real(s))[1]  # type: ignore[method-assign]
    engine.add_request("a", ids(30, 1), SamplingParams(max_tokens=DECODE_TIMING_EVERY + 3, temperature=0.0,
                                                       ignore_eos=True))  # fmt: skip
    while engine.has_unfinished():
        engine.step()
    assert len(seen) == 2 and cost.decode_step_s is not None  # decode steps 1 and 1 + DECODE_TIMING_EVERY
    cost.seconds_per_token = cost.decode_step_s / 50  # as if a token of prefill cost 1/50 of a decode step
    cost.observe = lambda tokens, seconds: None  # type: ignore[method-assign]  # frozen from here
    cost.observe_decode = lambda s: None  # type: ignore[method-assign]
    assert engine._decode_stall_tokens() == 100  # two decode steps' time: 100 tokens
    prompts = {"a": ids(30, 1), "b": ids(300, 2)}
    rows: list[tuple[str, int]] = []
    real_schedule = engine.scheduler.schedule

    def logged():  # type: ignore[no-untyped-def]
        batch = real_schedule()
        if batch is not None:
            rows.extend((r.rid, n) for r, n in zip(batch.reqs, batch.extend_lens))
        return batch

    engine.scheduler.schedule = logged  # type: ignore[method-assign]
    got = run(llm, prompts)
    assert [n for rid, n in rows if rid == "b" and n > 1] == [99, 99, 99, 3]
    plain = LLM(str(qwen3_tied), dtype="float32", device="cpu", max_total_tokens=4096)
    assert got["b"] == plain.generate([prompts["b"]], GREEDY)[0].token_ids
