"""Engine behaviour: prefix reuse, aborts, admission errors, no leaks, seeded sampling."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mllmd import LLM, SamplingParams
from mllmd.engine.request import AdmissionError
from mllmd.testing.engine_steps import run_to_end

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def llm(qwen3_tied: Path) -> LLM:
    return LLM(str(qwen3_tied), dtype="float32", max_total_tokens=4096, context_length=1024)


def _random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 150000) for _ in range(n)]


def test_shared_prefix_computes_only_the_suffix(llm: LLM, qwen3_tied: Path) -> None:
    prefix = _random_ids(200, 1)
    first = prefix + _random_ids(30, 2)
    second = prefix + _random_ids(25, 3)
    assert first[200] != second[200]
    stats = llm.engine.scheduler.stats
    llm.generate([first], GREEDY)
    before = stats.prefill_tokens_computed
    out = llm.generate([second], GREEDY)[0]
    assert out.cached_tokens == 200
    assert stats.prefill_tokens_computed - before == len(second) - 200
    fresh = LLM(str(qwen3_tied), dtype="float32", disable_radix_cache=True)
    assert fresh.generate([second], GREEDY)[0].token_ids == out.token_ids
    assert llm.engine.is_idle_and_clean()


def test_a_prefix_still_being_prefilled_is_shared(qwen3_tied: Path) -> None:
    """A request that arrives while another still prefills the same long prefix (chunks of 64) reuses
    the chunks computed so far instead of computing them again (they enter the prefix cache as each
    chunk ends, as SGLang's cache_unfinished_req); both outputs equal their cold runs, and a third
    request whose prompt was prefilled by both reuses one copy (the second's duplicate slots freed)."""
    prefix = _random_ids(300, 4)
    first, second = prefix + _random_ids(20, 5), prefix + _random_ids(20, 6)
    llm = LLM(str(qwen3_tied), dtype="float32", max_total_tokens=4096, context_length=1024, chunked_prefill_size=64)
    engine, sched = llm.engine, llm.engine.scheduler
    engine.add_request("first", first, GREEDY)
    while sched.waiting or sched.running[0].kv_len < 192:
        engine.step()
    assert sched.running[0].kv_len < len(first) - 1, "the first prompt was meant to be still prefilling"
    engine.add_request("second", second, GREEDY)
    outs, cached = run_to_end(engine)
    assert cached == {"first": 0, "second": 192}
    cold = LLM(str(qwen3_tied), dtype="float32", disable_radix_cache=True)
    assert [outs["first"], outs["second"]] == [o.token_ids for o in cold.generate([first, second], GREEDY)]
    assert engine.is_idle_and_clean()
    # one new prompt prefilled by two requests in the same steps: the second's slots of each chunk
    # duplicate the first's and are freed, it reads the first's from then on
    twin = _random_ids(200, 7)
    before = sched.stats.prefill_tokens_computed
    twins = llm.generate([twin, twin], GREEDY)
    assert sched.stats.prefill_tokens_computed - before == 2 * len(twin)
    assert twins[0].token_ids == twins[1].token_ids == cold.generate([twin], GREEDY)[0].token_ids
    assert engine.is_idle_and_clean()
    held = engine.cache.held_slots()
    assert held.numel() == held.unique().numel() == engine.cache.total_size(), "a KV slot is cached twice"


def test_abort_waiting_and_running_frees_everything(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"abort-{i}", _random_ids(40 + i, 10 + i), params)
    engine.step()  # all four admitted and prefilled
    engine.add_request("abort-waiting", _random_ids(30, 20), params)
    assert engine.abort("abort-1") and engine.abort("abort-waiting")
    assert not engine.abort("no-such-request")
    outs = engine.step()
    aborted = {o.rid for o in outs if o.finish_reason == "abort"}
    assert aborted == {"abort-1", "abort-waiting"}
    for rid in ("abort-0", "abort-2", "abort-3"):
        engine.abort(rid)
    engine.step()
    assert not engine.has_unfinished()
    assert engine.is_idle_and_clean()
    engine.flush_cache()
    assert engine.runner.allocator.available_size() == engine.runner.max_total_tokens


def test_cache_is_released_by_eviction_under_pressure(qwen3_tied: Path) -> None:
    llm = LLM(str(qwen3_tied), dtype="float32", max_total_tokens=300)
    for seed in range(6):  # each leaves ~100 cached tokens; the pool holds 300
        llm.generate([_random_ids(80, seed)], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        assert llm.engine.is_idle_and_clean()
    assert llm.engine.cache.total_size() <= 300


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "needle"),
    [(1000, 100, "1100 tokens exceeds the context length of 1024"), (10, 5000, "context length")],
)
def test_too_long_is_rejected_with_numbers(llm: LLM, prompt_len: int, max_tokens: int, needle: str) -> None:
    with pytest.raises(AdmissionError, match=needle):
        llm.engine.add_request("long", _random_ids(prompt_len, 0), SamplingParams(max_tokens=max_tokens))
    assert not llm.engine.has_unfinished()


def test_request_larger_than_kv_pool_is_rejected(qwen3_tied: Path) -> None:
    llm = LLM(str(qwen3_tied), dtype="float32", max_total_tokens=100)
    with pytest.raises(AdmissionError, match="exceeds the KV cache of 100 tokens"):
        llm.generate([_random_ids(90, 0)], SamplingParams(max_tokens=20))


def test_bad_params_and_tokens_are_rejected(llm: LLM) -> None:
    with pytest.raises(AdmissionError, match="top_p"):
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(top_p=0.0))
    with pytest.raises(AdmissionError, match="prompt token ids"):
        llm.engine.add_request("bad", [1, 10**9], SamplingParams())
    with pytest.raises(AdmissionError, match="empty"):
        llm.engine.add_request("bad", [], SamplingParams())


def test_seeded_sampling_reproduces_whatever_the_batch(llm: LLM) -> None:
    prompt = _random_ids(12, 7)
    p = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], p)[0].token_ids
    others = [_random_ids(5 + i, 50 + i) for i in range(5)]
    batch = llm.generate(others[:2] + [prompt] + others[2:], [SamplingParams(max_tokens=30, temperature=0.8)] * 2 + [p] + [GREEDY] * 3)
    assert batch[2].token_ids == alone
    different = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True))
    assert different[0].token_ids != alone


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    prompt = _random_ids(10, 8)
    ref = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 12
    stop_at = ref.token_ids[5]
    first = ref.token_ids.index(stop_at)
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[: first + 1]


def test_stop_strings_cut_the_text_across_token_boundaries(llm: LLM) -> None:
    prompt = _random_ids(10, 11)
    ref = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert len(ref.text) > 12
    stop = ref.text[8:12]  # four characters, wherever the token boundaries fall
    cut = ref.text.index(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=["#never#", stop]))[0]
    assert out.finish_reason == "stop" and out.text == ref.text[:cut]
    assert len(out.token_ids) < 24 and ref.token_ids[: len(out.token_ids)] == out.token_ids
    missing = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=["#never#"]))[0]
    assert missing.finish_reason == "length" and missing.text == ref.text
    assert llm.engine.is_idle_and_clean()


def test_logprobs_are_returned_per_token(llm: LLM) -> None:
    out = llm.generate([_random_ids(8, 9)], SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=3))[0]
    assert out.logprobs is not None and out.top_logprobs is not None
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids)
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 3 and lp <= 0.0
        assert top[0][0] == tok  # greedy picks the most likely token
        assert abs(top[0][1] - lp) < 1e-5


def test_chat_applies_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0), chat_template_kwargs={"enable_thinking": False})[0]
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert text.startswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert "<think>\n\n</think>" in text


def test_warm_up_leaves_the_engine_as_it_was(llm: LLM) -> None:
    """The warm-up runs prefill and mixed batches on a private pool: outputs and KV state are unchanged."""
    prompt = _random_ids(40, 77)
    before = llm.generate([prompt], GREEDY)[0].token_ids
    free = llm.engine.runner.allocator.available_size()
    llm.engine.runner.warm_up()
    assert llm.engine.runner.allocator.available_size() == free
    llm.engine.flush_cache()
    assert llm.generate([prompt], GREEDY)[0].token_ids == before
    assert llm.engine.is_idle_and_clean()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _engine_with_wait(qwen3_tied: Path, wait_ms: float, **kw) -> tuple[LLM, _Clock]:
    llm = LLM(str(qwen3_tied), dtype="float32", max_total_tokens=4096, prefill_wait_ms=wait_ms, **kw)
    clock = _Clock()
    llm.engine.scheduler.clock = clock
    return llm, clock


def _decode_until_running(engine, rid: str) -> None:
    for _ in range(3):
        engine.step()
    assert engine.reqs[rid].status.name == "RUNNING"


def test_prefill_wait_holds_a_new_prompt_while_others_decode(qwen3_tied: Path) -> None:
    """scheduler.prefill_wait_ms: a prompt arriving while requests decode waits (decode-only steps run)
    until the wait is over; its output is the same as without waiting."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm, clock = _engine_with_wait(qwen3_tied, 20.0)
    engine = llm.engine
    engine.add_request("a", _random_ids(30, 1), params)
    _decode_until_running(engine, "a")
    engine.add_request("b", _random_ids(25, 2), params)
    before = engine.scheduler.stats.prefill_tokens_computed
    for _ in range(3):
        clock.now += 0.005  # 15 ms in all: still inside the 20 ms wait
        engine.step()
    assert engine.reqs["b"].status.name == "WAITING"
    assert engine.scheduler.stats.prefill_tokens_computed == before
    clock.now += 0.006
    tokens_b = [t for o in engine.step() if o.rid == "b" for t in o.new_token_ids]
    assert engine.scheduler.stats.prefill_tokens_computed == before + 25  # b's prefill ran in this step
    while engine.has_unfinished():
        tokens_b += [t for o in engine.step() if o.rid == "b" for t in o.new_token_ids]
    assert engine.is_idle_and_clean()
    alone = LLM(str(qwen3_tied), dtype="float32", max_total_tokens=4096)
    assert tokens_b == alone.generate([_random_ids(25, 2)], params)[0].token_ids


@pytest.mark.parametrize("case", ["long_prompt", "no_free_slot", "nothing_decoding", "off"])
def test_prefill_wait_admits_at_once_when_waiting_cannot_help(qwen3_tied: Path, case: str) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kw = {"max_running_requests": 2} if case == "no_free_slot" else {}
    llm, clock = _engine_with_wait(qwen3_tied, 0.0 if case == "off" else 20.0, chunked_prefill_size=64, **kw)
    engine = llm.engine
    if case != "nothing_decoding":
        engine.add_request("a", _random_ids(30, 1), params)
        _decode_until_running(engine, "a")
    # long_prompt: 70 waiting tokens fill a 64-token chunk; no_free_slot: the one free slot is taken
    engine.add_request("b", _random_ids(70 if case == "long_prompt" else 20, 2), params)
    engine.step()
    assert engine.reqs["b"].status.name == "RUNNING"
