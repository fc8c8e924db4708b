"""Grammar-constrained decoding in the engine (offline LLM, tiny random-weight Qwen3 on the CPU).

The token mask: greedy and sampled rows, overlap scheduling (the mask of step N+1 after step N's
token) giving the tokens of the plain loop, constrained and free rows in one batch, a grammar that
starts only after a reasoning block's end token, the logprobs of the raw logits, and the device-side
bitmask application against xgrammar's own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from mllmd import LLM, SamplingParams
from mllmd.sampling_params import OutputConstraint, ToolSchema
from mllmd.structured.mask import apply_token_bitmask, bitmask_words

SCHEMA = json.dumps({"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 20},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["color", "n", "tags"],
    "additionalProperties": False})
PROMPTS = ["hello", "tell me a story", "x"]


@pytest.fixture(scope="module")
def llm(qwen3_tied: Path) -> LLM:
    return LLM(str(qwen3_tied))


def constrained(temperature: float, seed: int | None = None, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=64, temperature=temperature, seed=seed,
                          constraint=OutputConstraint("json_schema", SCHEMA), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_rows_write_valid_json(llm: LLM, temperature: float) -> None:
    outs = llm.generate(PROMPTS, constrained(temperature, seed=7))
    for o in outs:
        assert o.finish_reason == "stop", o.text
        value = json.loads(o.text)
        assert value["color"] in ("red", "green", "blue") and 0 <= value["n"] <= 20 and len(value["tags"]) <= 3


def test_overlap_scheduling_gives_the_same_tokens(qwen3_tied: Path, llm: LLM) -> None:
    """With overlap the engine takes step N's tokens before it samples step N+1 of a grammar row."""
    overlapped = LLM(str(qwen3_tied), overlap_schedule=True)
    assert overlapped.engine.overlap
    params = [constrained(1.0, seed=s) for s in range(3)] + [SamplingParams(max_tokens=20, temperature=1.0, seed=9)]
    prompts = PROMPTS + ["free"]
    want = [o.token_ids for o in llm.generate(prompts, params)]
    got = [o.token_ids for o in overlapped.generate(prompts, params)]
    assert got == want


def test_a_free_row_is_unchanged_beside_constrained_rows(llm: LLM) -> None:
    free = SamplingParams(max_tokens=16, temperature=1.0, seed=3)
    alone = llm.generate(["free"], free)[0].token_ids
    mixed = llm.generate(["a", "free", "b"], [constrained(1.0, seed=1), free, constrained(0.0)])
    assert mixed[1].token_ids == alone
    assert json.loads(mixed[0].text) and json.loads(mixed[2].text)


def test_the_grammar_starts_after_the_reasoning_end_token(llm: LLM) -> None:
    """Until `starts_after_token` the row is free (a +100 bias makes it that token); then JSON."""
    end = llm.tokenizer.encode(" banana", add_special_tokens=False)
    assert len(end) == 1
    c = OutputConstraint("json_schema", SCHEMA, starts_after_token=end[0])
    out = llm.generate(["x"], SamplingParams(max_tokens=64, temperature=0, logit_bias={end[0]: 100.0},
                                             constraint=c))[0]
    assert out.token_ids[0] == end[0]
    assert out.finish_reason == "stop"
    json.loads(llm.tokenizer.decode(out.token_ids[1:-1] if out.token_ids[-1] in llm.engine.info.eos_token_ids
                                    else out.token_ids[1:]))
    # without the start token the same bias cannot reach the reply: the grammar masks it from the first step
    now = llm.generate(["x"], SamplingParams(max_tokens=64, temperature=0, logit_bias={end[0]: 100.0},
                                             constraint=OutputConstraint("json_schema", SCHEMA)))[0]
    assert end[0] not in now.token_ids


def test_tool_call_constraint_writes_one_call(llm: LLM) -> None:
    params = json.dumps({"type": "object", "properties": {"q": {"enum": ["x", "y"]}}, "required": ["q"]})
    c = OutputConstraint("tool_calls", tools=[ToolSchema("search", params)])
    out = llm.generate(["call it"], SamplingParams(max_tokens=64, temperature=1.0, seed=2, constraint=c))[0]
    assert out.finish_reason == "stop"
    assert out.text.startswith("<tool_call>\n") and out.text.endswith("\n</tool_call>")
    call = json.loads(out.text[len("<tool_call>\n"):-len("\n</tool_call>")])
    assert call["name"] == "search" and call["arguments"]["q"] in ("x", "y")


def test_logprobs_are_those_of_the_raw_logits(llm: LLM) -> None:
    """The chosen token's logprob is the model's, not renormalised over the allowed tokens."""
    out = llm.generate(["x"], SamplingParams(max_tokens=6, temperature=0, logprobs=True,
                                             constraint=OutputConstraint("json_object")))[0]
    assert out.text.startswith("{")
    assert out.logprobs is not None and out.logprobs[0] < -1.0  # '{' is not a free model's likely first token


def test_bad_constraints_are_refused_at_admission(llm: LLM) -> None:
    from mllmd.engine.request import AdmissionError

    with pytest.raises(AdmissionError, match="objec"):
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(
            max_tokens=4, constraint=OutputConstraint("json_schema", '{"type": "objec"}')))


def test_bitmask_application_matches_xgrammar() -> None:
    xgr = pytest.importorskip("xgrammar")
    vocab = 1000
    gen = torch.Generator().manual_seed(0)
    full = torch.randint(-(2**31), 2**31 - 1, (5, bitmask_words(vocab)), dtype=torch.int32, generator=gen)
    logits = torch.randn(5, vocab, generator=gen)
    rows = torch.tensor([4, 0, 2])
    ours = logits.clone()
    apply_token_bitmask(ours, full[rows], rows)  # ours: one bitmask row per constrained row
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, full, vocab_size=vocab, indices=rows.tolist())
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])


def test_qwen3_5_xml_tool_call_constraint_parses_back_to_valid_arguments(llm: LLM) -> None:
    """Qwen3.5's `<function=...><parameter=...>` form: what the grammar lets through, its tool parser
    turns into arguments that validate against the tool's schema (an enum, a bounded integer, a
    string's minLength / maxLength and pattern)."""
    from mllmd.openai.tool_parser import Qwen35ToolParser

    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                               "code": {"type": "string", "minLength": 2, "maxLength": 4},
                                               "zip": {"type": "string", "pattern": "^[0-9]{3}$"},
                                               "note": {"type": "string"}}, "required": ["city", "days", "code", "zip"]}
    tool = {"type": "function", "function": {"name": "weather", "parameters": schema}}
    c = OutputConstraint("tool_calls", tools=[ToolSchema("weather", json.dumps(schema))], tool_format="qwen3_xml")
    stopped = 0
    for seed in range(6):
        out = llm.generate(["w"], SamplingParams(max_tokens=128, temperature=1.0, seed=seed, constraint=c))[0]
        if out.finish_reason != "stop":
            assert "<parameter=note" in out.text  # only the free-text parameter may run on
            continue
        stopped += 1
        content, calls = Qwen35ToolParser([tool]).extract(out.text)
        assert content == "" and len(calls) == 1, out.text
        args = json.loads(calls[0].arguments)
        assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7
        assert 2 <= len(args["code"]) <= 4 and re.fullmatch("[0-9]{3}", args["zip"]), args
    assert stopped


def _gated_compiler(engine: object, monkeypatch: pytest.MonkeyPatch) -> tuple[object, list, object]:
    """The engine's compiler with `submit` held: each compilation waits until the test releases it."""
    import concurrent.futures

    compiler = engine._compiler()  # type: ignore[attr-defined]
    real_submit = compiler.submit
    gates: list = []

    def submit(c: OutputConstraint) -> concurrent.futures.Future:
        gate: concurrent.futures.Future = concurrent.futures.Future()
        gates.append((gate, c))
        return gate

    monkeypatch.setattr(compiler, "submit", submit)
    monkeypatch.setattr(engine, "defer_grammars", True)
    return compiler, gates, real_submit


def _schema(n: int) -> OutputConstraint:
    """A schema no earlier test compiled (the compiler caches by constraint)."""
    return OutputConstraint("json_schema", json.dumps({"type": "object", "properties": {"k": {"enum": [f"v{n}", "w"]}},
                                                       "required": ["k"], "additionalProperties": False}))


def test_a_compiling_grammar_waits_off_the_step_loop(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """With defer_grammars (the scheduler worker's setting) a request whose grammar is still compiling
    does not hold up the step loop: a running request keeps decoding; once the compilation ends, a
    step queues the request (take_admitted) and its reply follows the grammar."""
    engine = llm.engine
    compiler, gates, real_submit = _gated_compiler(engine, monkeypatch)
    assert engine.add_request("free", [1, 2, 3], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    c = _schema(1)
    assert engine.add_request("json", [4, 5, 6], SamplingParams(max_tokens=48, temperature=0.0, constraint=c)) is False
    free_tokens = 0
    for _ in range(4):
        for o in engine.step():
            assert o.rid == "free"
            free_tokens += len(o.new_token_ids)
    assert free_tokens >= 3 and engine.compiling_grammars == 1 and "json" not in engine.reqs
    assert engine.take_admitted() == [] and engine.take_refused() == []
    gate, constraint = gates[0]
    gate.set_result(real_submit(constraint).result())
    tokens: list[int] = []
    admitted: list[str] = []
    while engine.has_unfinished() or engine.compiling_grammars:
        outs = engine.step()
        admitted += engine.take_admitted()
        tokens += [t for o in outs if o.rid == "json" for t in o.new_token_ids]
    assert admitted == ["json"] and engine.compiling_grammars == 0
    assert json.loads(llm.tokenizer.decode(tokens, skip_special_tokens=True))["k"] in ("v1", "w")


def test_a_deferred_grammar_that_fails_or_times_out_is_refused(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compilation that fails is the request's refusal with the compiler's reason; one that outlives
    the compile timeout is refused naming the timeout, and cancelled if it had not started; an abort
    while compiling drops the request without an output."""
    from mllmd.structured.grammar import GrammarError

    engine = llm.engine
    compiler, gates, _ = _gated_compiler(engine, monkeypatch)
    params = SamplingParams(max_tokens=8, temperature=0.0, constraint=_schema(2))
    assert engine.add_request("fails", [1, 2], params) is False
    gates[0][0].set_exception(GrammarError("the response_format schema cannot be compiled: bad", "response_format"))
    assert engine.step() == []
    [(rid, err)] = engine.take_refused()
    assert rid == "fails" and "cannot be compiled: bad" in str(err) and err.param == "response_format"
    monkeypatch.setattr(compiler, "timeout_s", 0.0)
    assert engine.add_request("slow", [1, 2], SamplingParams(max_tokens=8, constraint=_schema(3))) is False
    assert engine.step() == []
    [(rid, err)] = engine.take_refused()
    assert rid == "slow" and "took longer than 0 s to compile" in str(err) and gates[1][0].cancelled()
    monkeypatch.setattr(compiler, "timeout_s", 60.0)
    assert engine.add_request("gone", [1, 2], SamplingParams(max_tokens=8, constraint=_schema(4))) is False
    assert engine.abort("gone") and engine.compiling_grammars == 0
    gates[2][0].set_result(None)
    assert engine.step() == [] and engine.take_admitted() == [] and engine.take_refused() == []
    assert not engine.has_unfinished()


def test_the_scheduler_worker_registers_a_deferred_request_once_it_is_queued(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler worker tells the detokenizer about a request only when the engine queues it (so
    before its first output), and fails one whose grammar the engine refused; an abort forgets it."""
    from mllmd.messages import AbortRequest, GenerateRequest, RegisterRequest, RequestFailed, decoder
    from mllmd.structured.grammar import GrammarError
    from mllmd.workers.scheduler_worker import RequestClock, admit_deferred, handle

    engine = llm.engine
    _, gates, real_submit = _gated_compiler(engine, monkeypatch)
    to_main: list = []
    detok: list = []

    class Wctx:
        def send_main(self, msg: object) -> None:
            to_main.append(msg)

    class Sock:
        def send(self, data: bytes) -> None:
            detok.append(decoder(RegisterRequest).decode(data))

    wctx, sock, clock, deferred = Wctx(), Sock(), RequestClock(), {}
    for rid, n in (("ok", 5), ("bad", 6), ("dropped", 7)):
        msg = GenerateRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, constraint=_schema(n)))
        handle(msg, engine, wctx, sock, None, clock, deferred)  # type: ignore[arg-type]
    assert sorted(deferred) == ["bad", "dropped", "ok"] and detok == []
    handle(AbortRequest("dropped"), engine, wctx, sock, None, clock, deferred)  # type: ignore[arg-type]
    gates[0][0].set_result(real_submit(gates[0][1]).result())
    gates[1][0].set_exception(GrammarError("the response_format schema cannot be compiled: x", "response_format"))
    engine.step()
    admit_deferred(engine, wctx, sock, clock, deferred)  # type: ignore[arg-type]
    assert [r.rid for r in detok] == ["ok"] and not deferred
    assert [(m.rid, m.code) for m in to_main if isinstance(m, RequestFailed)] == [("bad", "invalid_request")]
    while engine.has_unfinished():
        engine.step()
