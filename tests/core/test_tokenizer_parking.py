"""The tokenizer worker with a grammar still compiling: the request waits (parked) while the requests
behind it are tokenized and sent on; it follows once its grammar compiled, or fails with the
compiler's reason, or with the timeout (its compilation cancelled if it had not started)."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path
from typing import Any

import pytest

from mllmd.messages import GenerateRequest, OutputBudget, RequestFailed, TextPrompt, TokenizeRequest, decoder
from mllmd.sampling_params import OutputConstraint, SamplingParams
from mllmd.structured.grammar import GrammarCompiler, GrammarError
from mllmd.workers.tokenizer_worker import Grammars, Parked, finish_parked, handle

CONTEXT = 4096


class _Wctx:
    def __init__(self) -> None:
        self.to_main: list[Any] = []

    def send_main(self, msg: Any) -> None:
        self.to_main.append(msg)


class _Socket:
    def __init__(self) -> None:
        self.sent: list[GenerateRequest] = []

    def send(self, data: bytes) -> None:
        self.sent.append(decoder(GenerateRequest).decode(data))


class _Compiler:
    timeout_s = 60.0
    finish = GrammarCompiler.finish  # the real outcome rule (it calls timeout_error below)

    def timeout_error(self, c: OutputConstraint) -> GrammarError:
        return GrammarError(f"the response_format grammar took longer than {self.timeout_s:g} s to compile",
                            "response_format")


@pytest.fixture
def parts(qwen3_tied: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Grammars, list, _Compiler]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tied)
    grammars = Grammars(tokenizer, len(tokenizer))
    compiler = _Compiler()
    grammars._compiler = compiler  # type: ignore[assignment]
    gates: list[concurrent.futures.Future] = []

    def start(c: OutputConstraint) -> concurrent.futures.Future:
        gates.append(concurrent.futures.Future())
        return gates[-1]

    monkeypatch.setattr(grammars, "start", start)
    return tokenizer, grammars, gates, compiler


def _request(group: str, constrained: bool) -> TokenizeRequest:
    c = OutputConstraint("json_schema", json.dumps({"type": "object"})) if constrained else None
    return TokenizeRequest(group, [group + "-0"], TextPrompt("hello there"), SamplingParams(max_tokens=4, constraint=c),
                           OutputBudget(requested=4), prompt_param="prompt")


def test_a_request_with_a_compiling_grammar_does_not_hold_up_the_next(parts) -> None:
    tokenizer, grammars, gates, _ = parts
    wctx, sched, parked = _Wctx(), _Socket(), []
    handle(_request("json", True), tokenizer, None, None, CONTEXT, wctx, sched, grammars, parked)
    handle(_request("free", False), tokenizer, None, None, CONTEXT, wctx, sched, grammars, parked)
    assert [g.rid for g in sched.sent] == ["free-0"] and len(parked) == 1 and not wctx.to_main
    finish_parked(parked, grammars, CONTEXT, wctx, sched)
    assert len(sched.sent) == 1 and len(parked) == 1  # still compiling
    gates[0].set_result(object())
    finish_parked(parked, grammars, CONTEXT, wctx, sched)
    assert [g.rid for g in sched.sent] == ["free-0", "json-0"] and not parked and not wctx.to_main
    assert sched.sent[1].input_ids == sched.sent[0].input_ids and sched.sent[1].params.constraint is not None


def test_a_parked_request_fails_with_the_compilers_reason_or_the_timeout(parts) -> None:
    tokenizer, grammars, gates, compiler = parts
    wctx, sched, parked = _Wctx(), _Socket(), []
    handle(_request("bad", True), tokenizer, None, None, CONTEXT, wctx, sched, grammars, parked)
    gates[0].set_exception(GrammarError("the response_format schema cannot be compiled: no", "response_format"))
    finish_parked(parked, grammars, CONTEXT, wctx, sched)
    [failed] = wctx.to_main
    assert isinstance(failed, RequestFailed) and failed.rid == "bad" and "cannot be compiled: no" in failed.message
    compiler.timeout_s = 0.0
    handle(_request("slow", True), tokenizer, None, None, CONTEXT, wctx, sched, grammars, parked)
    assert isinstance(parked[0], Parked) and parked[0].stage == "grammar"
    assert parked[0].deadline is not None and parked[0].deadline <= time.monotonic()
    finish_parked(parked, grammars, CONTEXT, wctx, sched)
    assert wctx.to_main[1].rid == "slow" and "took longer than 0 s" in wctx.to_main[1].message
    assert gates[1].cancelled() and not parked and not sched.sent


@pytest.mark.parametrize("text", ["ab " * 4000, "x" * 5000, " " * 9000, "你好，世界。" * 900, "word\n\n" * 2000])
def test_a_prompt_far_over_the_context_is_refused_from_a_prefix(qwen3_tied: Path, text: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """encode_within gives encode's ids, or refuses exactly where the whole prompt leaves no room for a
    completion (so the refusal never turns away a prompt that fits). The floor under which a text is
    always encoded whole (256K characters) is lowered, so that these texts take the prefix route."""
    from transformers import AutoTokenizer

    import mllmd.workers.tokenizer_worker as tw
    from mllmd.sampling_params import InvalidSamplingParam
    from mllmd.workers.tokenizer_worker import encode_within

    monkeypatch.setattr(tw, "PREFIX_MIN_CHARS", 0)

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tied)
    full = tokenizer.encode(text, add_special_tokens=False)
    for context in (64, 256, len(full), len(full) + 1, 4 * len(full)):
        try:
            ids = encode_within(tokenizer, text, context, "prompt")
        except InvalidSamplingParam as e:
            assert len(full) >= context and e.param == "prompt" and f"context length is {context}" in str(e)
        else:
            assert ids == full
    with pytest.raises(InvalidSamplingParam, match="more than [0-9]+ tokens"):  # from a prefix
        encode_within(tokenizer, "ab " * 100_000, 4096, "messages")
    with pytest.raises(InvalidSamplingParam, match="300000 characters"):  # past 64 x 128 characters: unread
        encode_within(tokenizer, "ab " * 100_000, 64, "messages")
    monkeypatch.setattr(tw, "PREFIX_MIN_CHARS", 1 << 18)  # under the floor: encoded whole, so that the
    assert encode_within(tokenizer, text, len(full) // 2, "messages") == full  # refusal names its length


def test_a_text_longer_than_the_context_of_longest_tokens_is_refused_unread(qwen3_tied: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: only a prefix was measured, assuming 8 characters a token; 8 MB of spaces (128 a token in
    Qwen's vocabulary) passed and was encoded whole on the worker's loop (9 s; 46 s for four). A text
    longer than the context times the longest token cannot fit, and is refused without encoding."""
    from transformers import AutoTokenizer

    import mllmd.workers.tokenizer_worker as tw
    from mllmd.sampling_params import InvalidSamplingParam

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tied)
    assert tw._max_token_chars(tokenizer) == 128
    monkeypatch.setattr(tw, "PREFIX_MIN_CHARS", 1000)
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: pytest.fail("encoded"))
    with pytest.raises(InvalidSamplingParam, match="context length is 64") as e:
        tw.encode_within(tokenizer, " " * (64 * 128 + 1), 64, "messages")
    assert e.value.param == "messages"


class _Jobs:
    """TokenizeJobs' thread, held until the test releases each job (None: busy)."""

    max_queued = 2

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls: list[tuple[Any, concurrent.futures.Future]] = []

    def call_later(self, fn: Any) -> concurrent.futures.Future | None:
        if len(self.calls) >= self.max_queued:
            return None
        self.calls.append((fn, concurrent.futures.Future()))
        return self.calls[-1][1]

    def run(self, i: int) -> None:
        fn, f = self.calls[i]
        try:
            f.set_result(fn(self.tokenizer))
        except Exception as e:
            f.set_exception(e)


def test_a_long_prompt_is_encoded_off_the_loop(parts) -> None:
    """A text past LONG_TEXT_CHARS is encoded on the jobs' thread while the requests behind it go on; it
    follows with encode's ids (or its refusal); past max_queued such prompts, a 503 (unavailable)."""
    from mllmd.workers.tokenizer_worker import LONG_TEXT_CHARS

    tokenizer, grammars, _, _ = parts
    jobs = _Jobs(tokenizer)
    wctx, sched, parked = _Wctx(), _Socket(), []
    long_text = "lorem ipsum " + "-" * LONG_TEXT_CHARS  # about 520 tokens (128 dashes a token)

    def request(group: str, text: str) -> TokenizeRequest:
        return TokenizeRequest(group, [group + "-0"], TextPrompt(text), SamplingParams(max_tokens=4),
                               OutputBudget(requested=4), prompt_param="prompt")

    for group, text in (("long", long_text), ("short", "hello there"), ("over", " x" * (LONG_TEXT_CHARS * 2)),
                        ("busy", long_text)):
        handle(request(group, text), tokenizer, None, None, CONTEXT, wctx, sched, grammars, parked, jobs)  # type: ignore[arg-type]
    assert [g.rid for g in sched.sent] == ["short-0"] and [p.stage for p in parked] == ["prompt", "prompt"]
    [busy] = wctx.to_main
    assert busy.rid == "busy" and busy.code == "unavailable"
    jobs.run(1)
    jobs.run(0)
    finish_parked(parked, grammars, CONTEXT, wctx, sched)
    assert [g.rid for g in sched.sent] == ["short-0", "long-0"] and not parked
    assert sched.sent[1].input_ids == tokenizer.encode(long_text, add_special_tokens=False)
    over = wctx.to_main[1]
    assert over.rid == "over" and over.code == "invalid_request" and f"context length is {CONTEXT}" in over.message


class _Vision:
    """The worker's view of a vision model, its image loading held until the test releases it."""

    def __init__(self) -> None:
        self.gates: list[concurrent.futures.Future] = []

    def wants(self, prompt: Any) -> bool:
        return "image" in json.dumps(getattr(prompt, "messages", ""))

    def load_later(self, prompt: Any) -> concurrent.futures.Future:
        self.gates.append(concurrent.futures.Future())
        return self.gates[-1]

    def prompt(self, tokenizer: Any, prompt: Any, kwargs: dict, images: list, encode: Any) -> Any:
        from mllmd.multimodal.chat import VisionPrompt

        return VisionPrompt(encode("user: look"), images, [], "user: look")  # the worker's bounded encode

    def send(self, built: Any) -> list:
        return []


def test_a_request_whose_images_are_loading_does_not_hold_up_the_next(parts) -> None:
    """Images load off the worker's loop: a text request behind an image request goes on at once; the
    image request follows once its images are loaded, or fails with the image rule that refused one."""
    from mllmd.messages import ChatPrompt
    from mllmd.multimodal.image_io import ImageError

    tokenizer, grammars, _, _ = parts
    vision, wctx, sched, parked = _Vision(), _Wctx(), _Socket(), []
    image_msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]

    def image_request(group: str) -> TokenizeRequest:
        return TokenizeRequest(group, [group + "-0"], ChatPrompt(image_msgs), SamplingParams(max_tokens=4),
                               OutputBudget(requested=4))

    for req in (image_request("img"), image_request("bomb"), _request("text", False)):
        handle(req, tokenizer, vision, None, CONTEXT, wctx, sched, grammars, parked)  # type: ignore[arg-type]
    assert [g.rid for g in sched.sent] == ["text-0"] and [p.stage for p in parked] == ["images", "images"]
    vision.gates[0].set_result([])
    vision.gates[1].set_exception(ImageError("image 1: 60000000 pixels exceed server.max_image_pixels", "pixels"))
    finish_parked(parked, grammars, CONTEXT, wctx, sched, vision)  # type: ignore[arg-type]
    assert [g.rid for g in sched.sent] == ["text-0", "img-0"]
    assert sched.sent[1].input_ids == tokenizer.encode("user: look", add_special_tokens=False)
    [failed] = wctx.to_main
    assert failed.rid == "bomb" and "max_image_pixels" in failed.message and failed.param == "messages"
    assert not parked


def test_work_of_a_request_whose_client_left_is_dropped(parts) -> None:
    """Before: main never told the tokenizer worker, so 40 image requests abandoned after 0.3 s kept the
    image thread busy for minutes (a later image request waited 180 s) and the worker's memory grew.
    Now main's AbortRequest(group) drops the group's parked work, cancelling what had not started."""
    from mllmd.messages import ChatPrompt
    from mllmd.workers.tokenizer_worker import drop_parked

    tokenizer, grammars, _, _ = parts
    vision, wctx, sched, parked = _Vision(), _Wctx(), _Socket(), []
    image_msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    for group in ("gone", "kept"):
        handle(TokenizeRequest(group, [group + "-0"], ChatPrompt(image_msgs), SamplingParams(max_tokens=4),
                               OutputBudget(requested=4)), tokenizer, vision, None, CONTEXT, wctx, sched, grammars,
               parked)  # type: ignore[arg-type]
    drop_parked(parked, "gone")
    assert [p.req.group for p in parked] == ["kept"] and vision.gates[0].cancelled()
    drop_parked(parked, "unknown")  # a request already sent on: nothing here
    vision.gates[1].set_result([])
    finish_parked(parked, grammars, CONTEXT, wctx, sched, vision)  # type: ignore[arg-type]
    assert [g.rid for g in sched.sent] == ["kept-0"] and not wctx.to_main


def test_the_image_thread_queue_is_bounded(parts, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most max_queued requests' images wait for the image thread; more are a 503 (unavailable)."""
    import threading

    import mllmd.workers.vision_prompts as vp
    from mllmd.messages import ChatPrompt
    from mllmd.multimodal.image_io import ImageLimits

    tokenizer, grammars, _, _ = parts
    release = threading.Event()
    vision = vp.VisionPrompts(None, None, ImageLimits(), None, max_queued=2)  # type: ignore[arg-type]

    def held(*args: Any) -> None:
        release.wait(10)

    monkeypatch.setattr(vp, "load_part", held)
    monkeypatch.setattr(vp, "process_image", lambda *args: None)
    try:
        wctx, sched, parked = _Wctx(), _Socket(), []
        image_msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
        for group in ("a", "b", "c"):
            handle(TokenizeRequest(group, [group + "-0"], ChatPrompt(image_msgs), SamplingParams(max_tokens=4),
                                   OutputBudget(requested=4)), tokenizer, vision, None, CONTEXT, wctx, sched,
                   grammars, parked)
        assert [p.req.group for p in parked] == ["a", "b"]
        [busy] = wctx.to_main
        assert busy.rid == "c" and busy.code == "unavailable" and "retry" in busy.message
    finally:
        release.set()
        if vision._images is not None:
            vision._images.shutdown(wait=True)
