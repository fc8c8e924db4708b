"""Incremental detokenization and stop strings, against the real Qwen3 tokenizer's `decode`."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mllmd.detokenizer import (
    DetokenizerState,
    DetokOutput,
    IncrementalDetokenizer,
    StopStringMatcher,
    token_bytes,
    token_text,
)

FFFD = "\ufffd"

SAMPLES = [
    "The quick brown fox jumps over the lazy dog. It's 3:45pm, isn't it?\n\n",
    "Large language models are trained on trillions of tokens; inference is memory-bound.",
    "机器学习是人工智能的一个分支。我们今天讨论大语言模型的推理优化。",
    "龘靐齉爩 𠜎𠜱𠝹𠱓 — rare CJK characters, some outside the BMP.",
    "日本語のテキストも試します。カタカナとひらがな。한국어 문장도 포함합니다.",
    "Emoji: 😀🎉🚀 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 skin 👍🏽 keycap 1️⃣ heart ❤️‍🔥",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n"
    "print({k: v for k, v in zip('abc', [1, 2, 3])})  # dict comprehension\n",
    "    for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++\n\t\tTabs\r\nCRLF",
    "Mixed: naïve café Über straße Ωμέγα привет мир مرحبا שלום नमस्ते ∑∫√∞ ≠ ≤ ≥ → ⇒",
    "<think>\nLet me reason step by step.\n</think>\n\nThe answer is 42.",
    "Ce\u0301sar e\u0301te\u0301 (combining accents) and zero-width joiner a\u200db",
]
SPECIAL_TEXTS = ["<|im_end|>", "<|endoftext|>", "<|im_start|>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    from mllmd.checkpoint.tokenizer import build_qwen_tokenizer

    out: Path = build_qwen_tokenizer(tmp_path_factory.mktemp("qwen3_tokenizer"))
    return AutoTokenizer.from_pretrained(out)


def stream(det: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list[str]:
    """Feed `ids` in chunks of 1..4 tokens (1 without `rng`); return every delta plus the flush."""
    deltas: list[str] = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, 4) if rng else 1
        deltas.append(det.add(ids[i : i + n]))
        i += n
    deltas.append(det.flush())
    return deltas


def random_ids(tok, rng: random.Random, skip: bool) -> list[int]:
    """Real text, sliced at random, with special tokens spliced in at random places."""
    text = "".join(rng.choice(SAMPLES) for _ in range(rng.randint(1, 3)))
    start = rng.randrange(len(text))
    ids = tok.encode(text[start : start + rng.randint(1, 200)], add_special_tokens=False)
    for _ in range(rng.randint(0, 3)):
        ids.insert(rng.randint(0, len(ids)), tok.convert_tokens_to_ids(rng.choice(SPECIAL_TEXTS)))
    # Cut the token stream anywhere, often inside a character.
    a = rng.randrange(len(ids))
    return ids[a : a + rng.randint(1, len(ids))]


# ---- incremental detokenization ------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_concatenate_to_full_decode(tok, skip: bool) -> None:
    rng = random.Random(1234 + skip)
    for _ in range(400):
        ids = random_ids(tok, rng, skip)
        expected = tok.decode(ids, skip_special_tokens=skip)
        deltas = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, rng)
        assert "".join(deltas) == expected, ids
        if FFFD not in expected:
            assert not any(FFFD in d for d in deltas), ids


def test_whole_samples_token_by_token(tok) -> None:
    for skip in (True, False):
        for text in SAMPLES:
            ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
            deltas = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
            assert deltas[-1] == ""  # nothing left over when the text is complete
            assert not any(FFFD in d for d in deltas)


def test_random_token_ids_round_trip(tok) -> None:
    """Arbitrary ids (lone continuation bytes, invalid sequences) still add up to `decode`."""
    rng = random.Random(7)
    vocab = len(tok)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            deltas = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, rng)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), ids


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=80), data=st.data())
def test_any_text_round_trip(tok, text: str, data: st.DataObject) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    cut = data.draw(st.integers(0, len(ids)))
    ids = ids[:cut]
    det = IncrementalDetokenizer(tok)
    deltas = stream(det, ids, random.Random(data.draw(st.integers(0, 2**16))))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


def test_split_characters_are_held_back(tok) -> None:
    """CJK and emoji split across byte-level tokens: no U+FFFD, text appears when complete."""
    text = "龘 𠜎 👨‍👩‍👧‍👦 🇯🇵"
    ids = tok.encode(text, add_special_tokens=False)
    partial = [i for i in ids if "\\x" in token_text(tok, i)]
    assert len(partial) >= 3, "the sample must split characters across tokens"
    det = IncrementalDetokenizer(tok)
    deltas = [det.add([i]) for i in ids]
    assert not any(FFFD in d for d in deltas)
    assert "".join(deltas) == text and det.flush() == ""
    # A token that ends inside a character emits nothing; the one that completes it emits it whole.
    seen = b""
    for i, d in zip(ids, deltas):
        seen += bytes(token_bytes(tok, i))
        try:
            seen.decode("utf-8")
        except UnicodeDecodeError:
            assert d == ""
        else:
            assert d != ""


def test_flush_renders_incomplete_tail(tok) -> None:
    ids = tok.encode("ok 龘", add_special_tokens=False)
    det = IncrementalDetokenizer(tok)
    out = [det.add([i]) for i in ids[:-1]]  # stop one byte-token short of the last character
    assert "".join(out) == "ok" and det.pending_ids
    assert det.flush() == tok.decode(ids[:-1])[len("ok") :]  # " \ufffd" like decode()
    with pytest.raises(RuntimeError):
        det.add([ids[-1]])


def test_multi_token_add_matches_single(tok) -> None:
    ids = tok.encode(SAMPLES[5] + SAMPLES[2], add_special_tokens=False)
    det = IncrementalDetokenizer(tok)
    assert det.add(ids) + det.flush() == tok.decode(ids)
    assert IncrementalDetokenizer(tok).add([]) == ""


def test_prompt_context_is_not_emitted(tok) -> None:
    prompt = tok.encode("<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    out = tok.encode(" Hello 😀 世界", add_special_tokens=False)
    for skip in (True, False):
        det = IncrementalDetokenizer(tok, skip_special_tokens=skip, prompt_ids=prompt)
        assert "".join(stream(det, out)) == tok.decode(out, skip_special_tokens=skip)
    # A prompt that ends inside a character gives no context: the output decodes on its own.
    ids = tok.encode("abc 龘", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, prompt_ids=ids[:-1])
    assert "".join(stream(det, ids[-1:])) == tok.decode(ids[-1:])


def test_recovers_when_the_stream_fails(tok) -> None:
    ids = tok.encode("Hello world, 你好世界", add_special_tokens=False)
    det = IncrementalDetokenizer(tok)
    first = det.add(ids[:2])

    class Broken:
        def step(self, tokenizer, ids):
            raise Exception("Invalid prefix encountered")

    det._stream = Broken()  # type: ignore[assignment]
    rest = stream(det, ids[2:])
    assert first + "".join(rest) == tok.decode(ids)


# ---- stop strings --------------------------------------------------------------------------------


def feed_all(m: StopStringMatcher, chunks: list[str]) -> tuple[str, bool]:
    out = []
    for c in chunks:
        emit, stopped = m.feed(c)
        out.append(emit)
        if stopped:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_stop_spanning_tokens_and_hold_back() -> None:
    m = StopStringMatcher(["###"])
    assert m.feed("Hello #") == ("Hello ", False)
    assert m.held == "#"
    assert m.feed("#") == ("", False)
    assert m.feed("# tail") == ("", True)
    assert m.matched == "###" and m.flush() == ""
    assert m.feed("more") == ("", True)


def test_stop_at_the_very_start() -> None:
    m = StopStringMatcher(["Hello"])
    assert m.feed("Hello world") == ("", True)
    assert m.matched == "Hello"


def test_overlapping_candidate_prefix() -> None:
    for chunks in (["abcabcd"], list("abcabcd"), ["ab", "ca", "bcd"], ["abca", "bc", "d"]):
        m = StopStringMatcher(["abcd"])
        assert feed_all(m, chunks) == ("abc", True), chunks
    m = StopStringMatcher(["abcd"])
    assert m.feed("abca") == ("abc", False) and m.held == "a"


def test_several_stops_earliest_wins() -> None:
    m = StopStringMatcher(["world", "lo"])
    assert m.feed("Hello world") == ("Hel", True) and m.matched == "lo"
    m = StopStringMatcher(["bc", "abc"])  # same end: the earlier start (longer) wins
    assert m.feed("xabc") == ("x", True) and m.matched == "abc"
    # Earliest end, whatever the chunking: "c" appears before "abcd" completes.
    for chunks in (["abcd"], list("abcd")):
        m = StopStringMatcher(["abcd", "c"])
        assert feed_all(m, chunks) == ("ab", True) and m.matched == "c"


def test_flush_releases_held_text() -> None:
    m = StopStringMatcher(["</answer>"])
    assert m.feed("The answer is 42 </ans") == ("The answer is 42 ", False)
    assert m.flush() == "</ans"
    assert m.flush() == ""


def test_include_stop_and_no_stops() -> None:
    m = StopStringMatcher(["END"], include_stop=True)
    assert feed_all(m, ["text E", "N", "D more"]) == ("text END", True)
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False) and m.flush() == ""
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The output of a stream that stops at the first stop string to appear (brute force)."""
    for end in range(1, len(text) + 1):
        hits = [(end - len(s), s) for s in stops if text[:end].endswith(s)]
        if hits:
            start, s = min(hits)
            return text[:start], s
    return text, None


@settings(max_examples=500, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_matching_ignores_chunking(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    m = StopStringMatcher(stops)
    emitted = ""
    seen = ""
    for c in chunks:
        seen += c
        emit, stopped = m.feed(c)
        emitted += emit
        expected, matched = reference_stop(seen, stops)
        if stopped:
            assert (emitted, m.matched) == (expected, matched)
            break
        # Never emit past a possible stop; hold back only the longest tail that could start one.
        assert matched is None and emitted + m.held == seen
        hold = max(
            (
                k
                for k in range(len(seen) + 1)
                if any(s.startswith(seen[len(seen) - k :]) and len(s) > k for s in stops)
            ),
            default=0,
        )
        assert len(m.held) == hold
    else:
        emitted += m.flush()
        assert (emitted, None) == reference_stop(text, stops)


def test_long_stop_strings_cost_linear_memory() -> None:
    """Issue 35: every proper prefix of a 40,000-character stop string used to be kept (727 MiB). Now
    the matcher holds the stop strings themselves and at most one stop string's length of text."""
    import tracemalloc

    stop = "ab" * 20_000
    tracemalloc.start()
    try:
        m = StopStringMatcher([stop, "x" * 40_000])
        for _ in range(2_000):
            emit, stopped = m.feed("ab")
            assert not stopped
        assert len(m.held) <= len(stop) - 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB"
    assert m.held == stop[: len(m.held)] and len(m.held) == 4_000  # all of it could still become the stop
    emit, stopped = m.feed(stop[len(m.held):])
    assert stopped and emit == "" and m.matched == stop


# ---- DetokenizerState: the worker's per-request helper -------------------------------------------


def test_state_stop_across_tokens(tok) -> None:
    text = "Sure! Here is the plan.\n\nObservation: 你好世界 and more text"
    ids = tok.encode(text, add_special_tokens=False)
    for stop in ["Observation:", "\n\nObs", "你好世", "is the plan"]:
        state = DetokenizerState(tok, stop=[stop, "never"])
        outs = [state.add([i]) for i in ids]
        assert outs[-1].stopped and outs[-1].matched_stop == stop
        assert state.text == text[: text.index(stop)]
        assert "".join(o.text_delta for o in outs) == state.text
        # The stop spans 2+ tokens: no single token holds it.
        assert not any(stop in tok.decode([i]) for i in ids)
        assert state.flush() == outs[-1]


def test_state_special_tokens(tok) -> None:
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Hello", add_special_tokens=False) + [end]
    on = DetokenizerState(tok, skip_special_tokens=True)
    assert "".join(on.add([i]).text_delta for i in ids) + on.flush().text_delta == "Hello"
    off = DetokenizerState(tok, skip_special_tokens=False, stop=["<|im_end|>"])
    outs = [off.add([i]) for i in ids]
    assert off.text == "Hello" and outs[-1].stopped and outs[-1].matched_stop == "<|im_end|>"
    off = DetokenizerState(tok, skip_special_tokens=False)
    assert "".join(off.add([i]).text_delta for i in ids) == "Hello<|im_end|>"


def test_state_flush_releases_bytes_and_stop_prefix(tok) -> None:
    ids = tok.encode("answer: 42 ##", add_special_tokens=False)
    state = DetokenizerState(tok, stop=["###"])
    deltas = [state.add([i]).text_delta for i in ids]
    assert "".join(deltas) == "answer: 42 "
    out = state.flush()
    assert out == DetokOutput("##", False, None) and state.text == "answer: 42 ##"
    # Incomplete bytes at the end surface as U+FFFD, exactly like decode().
    ids = tok.encode("x 龘", add_special_tokens=False)[:-1]
    state = DetokenizerState(tok, stop=["zzz"])
    text = "".join(state.add([i]).text_delta for i in ids) + state.flush().text_delta
    assert text == tok.decode(ids) and text.endswith(FFFD)


# ---- token_bytes / token_text (OpenAI logprobs) --------------------------------------------------


def test_token_bytes_ascii_cjk_and_partial(tok) -> None:
    [hello] = tok.encode("Hello", add_special_tokens=False)
    assert bytes(token_bytes(tok, hello)) == b"Hello" and token_text(tok, hello) == "Hello"
    [world] = tok.encode(" world", add_special_tokens=False)
    assert bytes(token_bytes(tok, world)) == b" world"
    [women] = tok.encode("我们", add_special_tokens=False)
    assert bytes(token_bytes(tok, women)) == "我们".encode() and token_text(tok, women) == "我们"
    ids = tok.encode("𝄞", add_special_tokens=False)  # U+1D11E: F0 9D 84 9E over two tokens
    assert len(ids) == 2
    assert [bytes(token_bytes(tok, i)) for i in ids] == [b"\xf0\x9d\x84", b"\x9e"]
    assert token_text(tok, ids[0]) == "\\xf0\\x9d\\x84"
    assert token_text(tok, ids[0], errors="replace") == FFFD
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert bytes(token_bytes(tok, end)) == b"<|im_end|>" and token_text(tok, end) == "<|im_end|>"
    # The backend tokenizer works too.
    assert token_bytes(tok.backend_tokenizer, hello) == token_bytes(tok, hello)


def test_token_bytes_concatenate_to_text(tok) -> None:
    for text in SAMPLES:
        ids = tok.encode(text, add_special_tokens=False)
        joined = b"".join(bytes(token_bytes(tok, i)) for i in ids)
        assert joined.decode("utf-8") == tok.decode(ids)


def test_detokenizer_worker_reset_drops_a_dead_schedulers_requests(tok) -> None:
    """A restarted scheduler sends "reset" first: state registered by the dead one is dropped (its late
    outputs produce nothing), and requests registered afterwards stream as usual."""
    from mllmd.messages import RegisterRequest, ResetRequests, TokenOutput, TokenOutputs
    from mllmd.workers.detokenizer_worker import Detokenizer, handle

    detok = Detokenizer(tok)
    ids = tok.encode("Hello world")
    for rid in ("old-1", "old-2"):
        handle(detok, RegisterRequest(rid, [1, 2], [], True))
    assert handle(detok, ResetRequests()) == [] and not detok.states and not detok.meta
    late = TokenOutput("old-1", ids, False, None, 2, len(ids), 0)
    assert handle(detok, TokenOutputs([late])) == []
    handle(detok, RegisterRequest("new", [1, 2], [], True))
    items = handle(detok, TokenOutputs([TokenOutput("new", ids, True, "length", 2, len(ids), 0)]))
    assert [(i.rid, i.text, i.finished) for i in items] == [("new", "Hello world", True)]
    assert not detok.states


def test_worker_stamps_the_first_output_and_carries_it_to_main(tok) -> None:
    """The detokenizer worker copies the scheduler's FirstTokenTimes onto the first TextOutput with its
    own stamp, also when that output's text is held back (a split character); later outputs carry none."""
    import time

    from mllmd.messages import FirstTokenTimes, RegisterRequest, TokenOutput
    from mllmd.workers.detokenizer_worker import Detokenizer

    det = Detokenizer(tok)
    det.register(RegisterRequest("r", [1, 2], [], True))
    ids = tok.encode("𠜎", add_special_tokens=False)
    assert len(ids) > 1  # its first token alone is part of a character
    times = FirstTokenTimes(1.0, 1.1, 1.2, 1.3, 1.4)
    before = time.perf_counter()
    first = det.process(TokenOutput("r", ids[:1], False, None, 2, 1, 0, first_times=times))
    assert first is not None and first.text == "" and first.first_times is not None
    assert first.first_times.submitted == 1.0 and first.first_times.first_token == 1.4
    assert before <= first.first_times.detokenized <= time.perf_counter()
    later = det.process(TokenOutput("r", [200], True, "length", 2, 2, 0))
    assert later is not None and later.first_times is None
