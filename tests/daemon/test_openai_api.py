"""The OpenAI API end to end, driven by the official `openai` client against the real daemon (CPU).

One daemon serves the whole module (see conftest.py). Checks: models list; chat and completions,
streaming and not, with exact usage; n=2; stop strings (matched across token boundaries); seed
reproducibility; logprobs shapes; the same over the Unix socket with httpx; and the Responses API
(whole, streamed, the SDK's stream helper, structured output, refusals naming the field, a stream left
midway aborted).
"""

from __future__ import annotations

import json
import os
import stat
import time
from typing import Any, Literal

import httpx
import pydantic
import pytest

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-qwen3"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story about Paris."}]
PROMPT = "The capital of France is"
IGNORE_EOS = {"ignore_eos": True}


def chat_prompt_tokens(tokenizer: Any, messages: list[dict[str, Any]]) -> int:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return len(ids)


def text_prompt_tokens(tokenizer: Any, prompt: str) -> int:
    return len(tokenizer(prompt)["input_ids"])


@pytest.fixture(scope="module")
def client(daemon: Any) -> Any:
    return daemon.openai()


# ---- models ----------------------------------------------------------------------------------
def test_list_models(client: Any) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    assert isinstance(models.data[0].created, int)


def test_retrieve_model(client: Any) -> None:
    import openai

    m = client.models.retrieve(MODEL)
    assert (m.id, m.object) == (MODEL, "model") and isinstance(m.created, int)
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"


# ---- chat ------------------------------------------------------------------------------------
def test_chat_non_streaming_usage_is_exact(client: Any, tokenizer: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=7, extra_body=IGNORE_EOS)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.finish_reason == "length"
    assert c.message.role == "assistant" and isinstance(c.message.content, str) and c.message.content
    assert r.usage.prompt_tokens == chat_prompt_tokens(tokenizer, MESSAGES)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_streaming_with_usage(client: Any, tokenizer: Any) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=9, stream=True, logprobs=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
    )
    chunks = list(stream)
    assert chunks, "no chunks"
    ids = {ch.id for ch in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    # role chunk first, usage chunk last (choices == []), usage null on all others
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(ch.usage is None for ch in body)
    text = "".join(ch.choices[0].delta.content or "" for ch in body if ch.choices)
    streamed_tokens = sum(len(ch.choices[0].logprobs.content) for ch in body if ch.choices and ch.choices[0].logprobs)
    finish = [ch.choices[0].finish_reason for ch in body if ch.choices and ch.choices[0].finish_reason]
    assert finish == ["length"]
    assert streamed_tokens == 9
    # a token's text and its logprobs travel in one chunk (OpenAI's shape), never as a text chunk then an
    # empty-content chunk with the logprobs; only the finish chunk may carry tokens without text
    for ch in body[1:]:
        c = ch.choices[0]
        has_lp = bool(c.logprobs and c.logprobs.content)
        assert bool(c.delta.content) == has_lp or (c.finish_reason and not c.delta.content), ch
    assert last.usage.completion_tokens == streamed_tokens
    assert last.usage.prompt_tokens == chat_prompt_tokens(tokenizer, MESSAGES)
    assert last.usage.total_tokens == last.usage.prompt_tokens + streamed_tokens
    # the same request without streaming gives the same text (greedy)
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9, temperature=0,
                                          extra_body=IGNORE_EOS)
    greedy = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9, temperature=0, stream=True,
                                            extra_body=IGNORE_EOS)
    assert "".join(ch.choices[0].delta.content or "" for ch in greedy if ch.choices) == full.choices[0].message.content
    assert text  # something was streamed


def test_chat_n2(client: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, n=2, temperature=1.0,
                                       extra_body=IGNORE_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" and c.message.content for c in r.choices)
    assert r.usage.completion_tokens == 10

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, n=2, stream=True,
                                            stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    chunks = list(stream)
    finishes = {ch.choices[0].index: ch.choices[0].finish_reason for ch in chunks
                if ch.choices and ch.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length"}
    roles = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role]
    assert sorted(roles) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_seed_reproducible(client: Any) -> None:
    def run(seed: int) -> str:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0,
                                           seed=seed, extra_body=IGNORE_EOS)
        return r.choices[0].message.content

    a, b, c = run(1234), run(1234), run(4321)
    assert a == b
    assert a != c
    # streaming with the same seed gives the same text too
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0,
                                            seed=1234, stream=True, extra_body=IGNORE_EOS)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == a


def test_chat_logprobs_shape(client: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body=IGNORE_EOS)
    c = r.choices[0]
    content = c.logprobs.content
    assert len(content) == 6 == r.usage.completion_tokens
    for e in content:
        assert isinstance(e.token, str)
        assert isinstance(e.logprob, float) and e.logprob <= 0.0
        assert isinstance(e.bytes, list) and all(isinstance(b, int) and 0 <= b < 256 for b in e.bytes)
        assert len(e.top_logprobs) == 3
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert all(isinstance(t.token, str) and isinstance(t.bytes, list) for t in e.top_logprobs)
        # greedy: the chosen token is the most likely one
        assert e.top_logprobs[0].token == e.token
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert joined == c.message.content

    # without top_logprobs: entries still present, top_logprobs empty
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True,
                                       extra_body=IGNORE_EOS)
    assert len(r.choices[0].logprobs.content) == 3
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    # not asked: null
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, extra_body=IGNORE_EOS)
    assert r.choices[0].logprobs is None


# ---- completions -----------------------------------------------------------------------------
def test_completions_non_streaming_usage_is_exact(client: Any, tokenizer: Any) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body=IGNORE_EOS)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.prompt_tokens == text_prompt_tokens(tokenizer, PROMPT)
    assert r.usage.completion_tokens == 8
    # token-id prompts count exactly as given
    ids = tokenizer(PROMPT)["input_ids"] + [11, 12, 13]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, extra_body=IGNORE_EOS)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 2
    # OpenAI's default of 16 tokens when max_tokens is unset
    r = client.completions.create(model=MODEL, prompt=PROMPT, extra_body=IGNORE_EOS)
    assert r.usage.completion_tokens == 16


def test_completions_streaming_with_usage(client: Any, tokenizer: Any) -> None:
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=11, stream=True, logprobs=1,
                                       stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    chunks = list(stream)
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(ch.usage is None for ch in body)
    tokens = [t for ch in body if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert len(tokens) == 11
    assert last.usage.completion_tokens == 11
    assert last.usage.prompt_tokens == text_prompt_tokens(tokenizer, PROMPT)
    assert [ch.choices[0].finish_reason for ch in body if ch.choices and ch.choices[0].finish_reason] == ["length"]


def test_completions_n2_and_echo(client: Any) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2, extra_body=IGNORE_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 8
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, extra_body=IGNORE_EOS)
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)


def test_completions_echo_of_token_id_prompts(client: Any, tokenizer: Any) -> None:
    """echo returns a token-id prompt as text (as OpenAI does; lm-eval scores token prompts with echo), and
    its logprobs' tokens and offsets describe that text."""
    ids = tokenizer(PROMPT)["input_ids"]
    other = tokenizer("Once upon a time")["input_ids"]

    def echoed(prompt: Any, stream: bool, logprobs: int | None) -> tuple[dict[int, str], dict[int, list[str]]]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=logprobs,
                                      temperature=0, stream=stream, extra_body=IGNORE_EOS)
        texts: dict[int, str] = {}
        tokens: dict[int, list[str]] = {}
        for ch in list(r) if stream else [r]:
            for c in ch.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                tokens[c.index] = tokens.get(c.index, []) + (c.logprobs.tokens if c.logprobs else [])
        return texts, tokens

    for stream in (False, True):
        for logprobs in (None, 1):
            as_text, _ = echoed(PROMPT, stream, logprobs)
            texts, tokens = echoed([ids, other], stream, logprobs)
            assert texts[0] == as_text[0] and texts[0].startswith(PROMPT), (texts, as_text)
            assert texts[1].startswith("Once upon a time"), texts
            if logprobs:
                assert "".join(tokens[0]) == texts[0] and "".join(tokens[1]) == texts[1]


def test_completions_batch_of_prompts(client: Any, tokenizer: Any) -> None:
    """A list of prompts (LangChain and lm-eval send them): n choices each, index = prompt * n + j, each the
    text that prompt gives alone, usage counting every prompt once."""
    prompts = [PROMPT, "Once upon a time", "1, 2, 3,"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0, extra_body=IGNORE_EOS)
             .choices[0].text for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=2, temperature=0, echo=True,
                                  extra_body=IGNORE_EOS)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [p + t for p, t in zip(prompts, alone) for _ in range(2)]
    assert r.usage.prompt_tokens == sum(text_prompt_tokens(tokenizer, p) for p in prompts)
    assert r.usage.completion_tokens == 30
    # token-id prompts, streamed: every choice streams the text its prompt gives alone, and ends once
    ids = [tokenizer(p)["input_ids"] for p in prompts[:2]]
    alone_ids = [client.completions.create(model=MODEL, prompt=i, max_tokens=4, temperature=0, extra_body=IGNORE_EOS)
                 .choices[0].text for i in ids]
    stream = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    chunks = list(stream)
    texts: dict[int, str] = {}
    ends: dict[int, int] = {}
    for ch in chunks[:-1]:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            ends[c.index] = ends.get(c.index, 0) + (c.finish_reason is not None)
    assert texts == {0: alone_ids[0], 1: alone_ids[1]} and ends == {0: 1, 1: 1}
    assert chunks[-1].usage.prompt_tokens == len(ids[0]) + len(ids[1]) and chunks[-1].usage.completion_tokens == 8


def test_completions_batch_with_a_bad_prompt_is_refused_whole(client: Any, daemon: Any) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[PROMPT, "x " * 100_000], max_tokens=4)
    assert err.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[PROMPT] * 200, max_tokens=1, n=2)
    assert err.value.body["param"] == "n" and "256" in err.value.body["message"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=IGNORE_EOS)
    assert r.usage.completion_tokens == 2  # the daemon serves on


def test_completions_seed_reproducible(client: Any) -> None:
    def run(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed,
                                         extra_body=IGNORE_EOS).choices[0].text

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_completions_logprobs_shape(client: Any) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                  extra_body=IGNORE_EOS)
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(isinstance(t, str) for t in lp.tokens)
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs)
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert isinstance(top, dict) and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(x, abs=1e-4)  # greedy: chosen is the most likely
        assert tok in top
    expected = [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert lp.text_offset == expected
    # echo: the prompt's tokens come first, the first without a logprob (as OpenAI's), then the
    # generated ones, whose offsets start after the prompt
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=1, echo=True,
                                  extra_body=IGNORE_EOS)
    lp = r.choices[0].logprobs
    n_prompt = len(lp.tokens) - 3
    assert "".join(lp.tokens[:n_prompt]) == PROMPT and r.choices[0].text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == len(PROMPT)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=1, echo=True,
                                       stream=True, extra_body=IGNORE_EOS)
    streamed: list[Any] = []
    text = ""
    for ch in stream:
        if ch.choices:
            text += ch.choices[0].text
            if ch.choices[0].logprobs:
                streamed += ch.choices[0].logprobs.token_logprobs
    assert text.startswith(PROMPT) and streamed[:n_prompt] == lp.token_logprobs[:n_prompt]


def test_completions_streaming_logprobs_offsets(client: Any) -> None:
    """In a stream, text_offset counts the text already sent (it does not restart in every chunk)."""
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logprobs=1, stream=True,
                                       extra_body=IGNORE_EOS)
    tokens: list[str] = []
    offsets: list[int] = []
    for ch in stream:
        if ch.choices and ch.choices[0].logprobs:
            tokens += ch.choices[0].logprobs.tokens
            offsets += ch.choices[0].logprobs.text_offset
    assert len(tokens) == 8
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(8)]


# ---- stop strings ----------------------------------------------------------------------------
def _pick_stop(tokens: list[str], text: str) -> tuple[str, int]:
    """A 2-character stop string that spans a token boundary, and where it first occurs in text."""
    assert "".join(tokens) == text or "\ufffd" in text
    offset = 0
    candidates = []
    for tok in tokens[:-1]:
        offset += len(tok)
        if offset < 2 or offset >= len(text) - 1:
            continue
        s = text[offset - 1 : offset + 1]
        if "\ufffd" in s or not s.strip():
            continue
        first = text.find(s)
        if first > 0:
            candidates.append((s, first))
    assert candidates, f"no usable stop string in {text!r}"
    return candidates[len(candidates) // 2]


def test_stop_string_completions(client: Any) -> None:
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, logprobs=0,
                                      extra_body=IGNORE_EOS)
    text = first.choices[0].text
    stop, at = _pick_stop(first.choices[0].logprobs.tokens, text)
    second = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop,
                                       extra_body=IGNORE_EOS)
    assert second.choices[0].text == text[:at], (stop, text)
    assert second.choices[0].finish_reason == "stop"
    # streaming, stop given as a list with a string that never occurs
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                       stop=["\u2603never\u2603", stop], stream=True, extra_body=IGNORE_EOS)
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text[:at]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]


def test_stop_string_chat(client: Any) -> None:
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                           logprobs=True, extra_body=IGNORE_EOS)
    text = first.choices[0].message.content
    stop, at = _pick_stop([e.token for e in first.choices[0].logprobs.content], text)
    second = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, stop=[stop],
                                            extra_body=IGNORE_EOS)
    assert second.choices[0].message.content == text[:at], (stop, text)
    assert second.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, stop=stop,
                                            stream=True, extra_body=IGNORE_EOS)
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text[:at]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]
    # the daemon is still serving normally after stop-string aborts
    after = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, extra_body=IGNORE_EOS)
    assert after.usage.completion_tokens == 3


# ---- native /generate ------------------------------------------------------------------------
def test_generate_native(daemon: Any) -> None:
    with daemon.http() as h:
        r = h.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert isinstance(body["text"], str) and body["meta_info"]["completion_tokens"] == 5
        assert body["meta_info"]["finish_reason"]["type"] == "length"
        with h.stream("POST", "/generate", json={"input_ids": [1, 2, 3], "stream": True,
                                                  "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}) as s:
            assert s.status_code == 200
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        final = json.loads(lines[-2][6:])
        assert final["meta_info"]["completion_tokens"] == 4 and final["meta_info"]["prompt_tokens"] == 3


def test_generate_batch_rid_and_logprobs(daemon: Any, tokenizer: Any) -> None:
    """SGLang's /generate: a list of prompts answers a list (each the result its prompt gives alone),
    `rid` comes back as meta_info.id, and return_logprob gives [logprob, token id, text] per token."""
    sp = {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0}
    texts = [PROMPT, "Once upon a time"]
    with daemon.http() as h:
        alone = [h.post("/generate", json={"text": t, "sampling_params": sp}).json()["text"] for t in texts]
        r = h.post("/generate", json={"text": texts, "sampling_params": sp, "rid": ["a-1", "a-2"]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert isinstance(body, list) and [b["text"] for b in body] == alone
        assert [b["meta_info"]["id"] for b in body] == ["a-1", "a-2"]
        assert [b["meta_info"]["prompt_tokens"] for b in body] == [text_prompt_tokens(tokenizer, t) for t in texts]
        r = h.post("/generate", json={"input_ids": [tokenizer(t)["input_ids"] for t in texts], "sampling_params": sp,
                                      "return_logprob": True, "top_logprobs_num": 2})
        for b, text in zip(r.json(), alone):
            meta = b["meta_info"]
            assert b["text"] == text and len(meta["output_token_logprobs"]) == 4
            for (lp, tid, tok), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
                assert isinstance(tid, int) and isinstance(tok, str) and lp <= 0
                assert len(top) == 2 and top[0][1] == tid and top[0][0] == pytest.approx(lp, abs=1e-4)  # greedy
        # streamed batch: each prompt's events carry its index, and each ends with its full text
        with h.stream("POST", "/generate", json={"text": texts, "stream": True, "sampling_params": sp}) as st:
            events = [json.loads(ln[6:]) for ln in st.iter_lines() if ln.startswith("data: {")]
        last = {e["index"]: e["text"] for e in events}
        assert last == {0: alone[0], 1: alone[1]}


def test_generate_rid_is_unique_while_in_flight_and_the_admin_aborts_by_it(daemon: Any) -> None:
    body = {"text": PROMPT, "rid": "mine", "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with daemon.http() as h, h.stream("POST", "/generate", json=body) as st:
        lines = st.iter_lines()
        first = next(json.loads(ln[6:]) for ln in lines if ln.startswith("data: {"))
        assert first["meta_info"]["id"] == "mine"
        with daemon.http() as h2:
            again = h2.post("/generate", json={**body, "stream": False})
        assert again.status_code == 400 and again.json()["error"]["param"] == "rid", again.text
        with daemon.uds_http() as admin:
            listed = admin.get("/admin/requests").json()["requests"]
            assert [q["client_id"] for q in listed] == ["mine"], listed
            r = admin.post("/abort_request", json={"rid": "mine"})
        assert r.status_code == 200 and len(r.json()["aborted"]) == 1, r.text
        rest = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["meta_info"]["finish_reason"]["type"] == "abort"
    with daemon.http() as h:  # released: the id is free again
        r = h.post("/generate", json={**body, "stream": False, "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and r.json()["meta_info"]["id"] == "mine"


# ---- Unix socket -----------------------------------------------------------------------------
def test_unix_socket_mode(daemon: Any) -> None:
    st = os.stat(daemon.uds)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660


def test_unix_socket_httpx(daemon: Any, tokenizer: Any) -> None:
    with daemon.uds_http() as h:
        r = h.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert [m["id"] for m in h.get("/v1/models").json()["data"]] == [MODEL]
        r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4,
                                                 "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert r.json()["usage"]["prompt_tokens"] == chat_prompt_tokens(tokenizer, MESSAGES)
        # raw SSE framing: data lines, a usage chunk, then [DONE]
        with h.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                                       "stream": True, "stream_options": {"include_usage": True},
                                                       "ignore_eos": True}) as s:
            assert s.status_code == 200
            assert s.headers["content-type"].startswith("text/event-stream")
            events = [ln for ln in s.iter_lines() if ln]
        assert all(ln.startswith("data: ") for ln in events)
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 3


def test_unix_socket_openai_client(daemon: Any) -> None:
    with httpx.Client(transport=httpx.HTTPTransport(uds=daemon.uds), timeout=60) as h:
        client = daemon.openai(http_client=h, base_url="http://localhost/v1")
        assert [m.id for m in client.models.list().data] == [MODEL]
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                           extra_body=IGNORE_EOS)
        assert r.usage.completion_tokens == 4
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body=IGNORE_EOS)
        chunks = list(stream)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 4
        c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=IGNORE_EOS)
        assert c.usage.completion_tokens == 2


# ---- the Responses API -----------------------------------------------------------------------
def test_responses_non_streaming(client: Any, tokenizer: Any) -> None:
    from tests.core.test_openai_responses_api import check_response

    raw = client.responses.with_raw_response.create(
        model=MODEL, instructions=MESSAGES[0]["content"], input=MESSAGES[1]["content"], max_output_tokens=7,
        temperature=0, metadata={"k": "v"}, store=False, extra_body=IGNORE_EOS)
    r = check_response(json.loads(raw.text))  # the SDK's type, no field it lacks
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output[0].status == "incomplete"
    assert r.output_text and r.output_text == raw.parse().output_text
    assert r.usage.input_tokens == chat_prompt_tokens(tokenizer, MESSAGES)
    assert r.usage.output_tokens == 7 and r.usage.total_tokens == r.usage.input_tokens + 7
    assert (r.metadata, r.instructions, r.max_output_tokens, r.temperature) == ({"k": "v"}, MESSAGES[0]["content"], 7, 0)
    # the same request on chat: the same text
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=7, temperature=0,
                                          extra_body=IGNORE_EOS)
    assert r.output_text == chat.choices[0].message.content


def test_responses_streaming_events_in_order(client: Any) -> None:
    from tests.core.test_openai_responses_api import check_event

    events = list(client.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=9, temperature=1.0,
                                          stream=True, extra_body={**IGNORE_EOS, "seed": 5}))
    for e in events:
        check_event(e.to_dict())
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 9 and final.status == "incomplete"
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    whole = client.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=9, temperature=1.0,
                                    extra_body={**IGNORE_EOS, "seed": 5})
    assert whole.output_text == text


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int = pydantic.Field(ge=0, le=8)


def test_responses_stream_helper_and_structured_output(client: Any) -> None:
    """text.format json_schema (what the SDK's .parse and .stream send for a pydantic model) constrains the
    random model's reply as on chat, so it ends by itself: the stream helper needs response.completed."""
    texts = []
    for seed in range(2):
        r = client.responses.parse(model=MODEL, input="A pet as JSON.", text_format=Pet, max_output_tokens=48,
                                   temperature=1.0, extra_body={"seed": seed})
        assert r.status == "completed" and isinstance(r.output_parsed, Pet)
        assert r.text.format.type == "json_schema" and r.text.format.name == "Pet"
        texts.append(r.output_text)
    with client.responses.stream(model=MODEL, input="A pet as JSON.", text_format=Pet, max_output_tokens=48,
                                 temperature=1.0, extra_body={"seed": 0}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == texts[0] and isinstance(final.output_parsed, Pet)


@pytest.mark.parametrize(("kw", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "parameters": {"type": "object"}}]}, "tools[0].name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}}, "text.format"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),  # refused by the tokenizer worker: renamed too
    ({"extra_body": {"background": True}}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,iVBO"}]}]},
     "input"),  # chat's image rules: this model takes no images
])
def test_responses_refusals_name_the_field(client: Any, daemon: Any, kw: dict[str, Any], param: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**{"model": MODEL, "input": "Hi", **kw})
    assert err.value.status_code == 400 and err.value.param == param, err.value.body
    assert daemon.health()[0] == 200
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).status in ("completed", "incomplete")


def test_responses_stream_left_midway_is_aborted(daemon: Any) -> None:
    from tests.daemon.test_limits import _aborted_total

    before = _aborted_total(daemon)
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 5000, "stream": True, "ignore_eos": True}
    with daemon.http() as h, h.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        assert next(lines) == "event: response.created"
        while "response.output_text.delta" not in next(lines):
            pass
    deadline = time.monotonic() + 30
    while _aborted_total(daemon) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted_total(daemon) == before + 1
