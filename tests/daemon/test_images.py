"""Images through the daemon: the official openai client sends image_url parts (data URLs, allowed local
paths and file:// URLs) to a tiny random Qwen3-VL, and gets the tokens the offline engine gives for the
same chat; refusals (a path outside server.media_dirs, a remote URL, too many images, too many bytes,
bad base64, an image in a system message, images for a text-only model) are 400s naming the rule; no
shared-memory segment is left behind; /admin/status names the tensor transport in use."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from mllmd.ctl import render_status
from mllmd.multimodal.shm import segments as shm_segments
from mllmd.testing import checkpoints as ck
from tests.daemon.conftest import DaemonProc, start_daemon, stop_and_check

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 12


def smooth(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    chans = [np.sin(x / (7 + 5 * rng.random()) + rng.random() * 6) + np.cos(y / (9 + 4 * rng.random())) for _ in range(3)]
    return Image.fromarray(((np.stack(chans, -1) + 2) * 63).clip(0, 255).astype(np.uint8))


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(raw).decode()


def chat(*urls: str, question: str = "What is in the picture?") -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ck.build_tiny_checkpoint(tmp_path_factory.mktemp("vl") / "tiny-qwen3-vl", "Qwen3-VL-2B-Instruct", seed=3,
                                    extra_overrides={"vision_config": {"depth": 2, "deepstack_visual_indexes": [1]}})


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(an allowed media folder holding a.png, a folder outside it holding secret.png)."""
    root = tmp_path_factory.mktemp("media")
    inside, outside = root / "allowed", root / "private"
    inside.mkdir()
    outside.mkdir()
    (inside / "a.png").write_bytes(png(smooth(64, 48, 1)))
    (outside / "secret.png").write_bytes(png(smooth(64, 48, 1)))
    return inside, outside


@pytest.fixture(scope="module")
def daemon(vl_model: Path, media: tuple[Path, Path]) -> Iterator[DaemonProc]:
    d = start_daemon(vl_model, "--server.media_dirs", f"[{media[0]}]", "--server.max_images_per_request", "3",
                     "--server.max_image_bytes", "200000", ready_timeout=180)
    try:
        yield d
    finally:
        stop_and_check(d)


@pytest.fixture(scope="module")
def offline(vl_model: Path) -> Any:
    """The in-process engine on the same weights: what the daemon must answer."""
    from mllmd import LLM

    return LLM(str(vl_model))


def greedy(client: openai.OpenAI, messages: list[dict[str, Any]], model: str = "tiny-qwen3-vl", **kw: Any) -> Any:
    return client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **kw)


def offline_text(offline: Any, messages: list[dict[str, Any]]) -> tuple[str, int]:
    from mllmd import SamplingParams

    out = offline.chat(messages, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    return out.text, len(out.prompt_token_ids)


def refusal(client: openai.OpenAI, messages: list[dict[str, Any]], model: str = "tiny-qwen3-vl") -> str:
    with pytest.raises(openai.BadRequestError) as e:
        greedy(client, messages, model)
    return str(e.value)


def test_data_url_image_equals_the_offline_engine(daemon: DaemonProc, offline: Any) -> None:
    messages = chat(data_url(png(smooth(64, 48, 1))))
    r = greedy(daemon.openai(), messages)
    want, prompt_tokens = offline_text(offline, messages)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens == MAX_TOKENS
    assert prompt_tokens > 12, "the image's tokens are in the prompt"


def test_two_images_streamed_and_n2(daemon: DaemonProc, offline: Any) -> None:
    messages = chat(data_url(png(smooth(64, 48, 2))), data_url(png(smooth(40, 72, 3))), question="Compare them.")
    want, _ = offline_text(offline, messages)
    stream = greedy(daemon.openai(), messages, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    r = greedy(daemon.openai(), messages, n=2)
    assert [c.message.content for c in r.choices] == [want, want]


def test_local_paths_inside_media_dirs(daemon: DaemonProc, offline: Any, media: tuple[Path, Path]) -> None:
    same_pixels = chat(data_url((media[0] / "a.png").read_bytes()))
    want, _ = offline_text(offline, same_pixels)
    path = str(media[0] / "a.png")
    for url in (path, "file://" + path):
        assert greedy(daemon.openai(), chat(url)).choices[0].message.content == want


def test_refusals_name_the_rule(daemon: DaemonProc, media: tuple[Path, Path]) -> None:
    client = daemon.openai()
    secret = str(media[1] / "secret.png")
    missing = str(media[0] / "missing.png")
    outside, absent = refusal(client, chat(secret)), refusal(client, chat(missing))
    assert "server.media_dirs" in outside and "server.media_dirs" in absent
    assert outside.replace(secret, "P") == absent.replace(missing, "P"), "a client must not tell outside from missing"
    assert "server.allow_remote_images" in refusal(client, chat(f"{daemon.base_url}/health"))
    ok = data_url(png(smooth(16, 16, 4)))
    assert "server.max_images_per_request" in refusal(client, chat(ok, ok, ok, ok))
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 300, 3), dtype=np.uint8))
    assert "server.max_image_bytes" in refusal(client, chat(data_url(png(noise))))
    assert "image.base64" in refusal(client, chat("data:image/png;base64,@@@not-base64@@@"))
    system_image = [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": ok}}]},
                    {"role": "user", "content": "hi"}]
    assert "user messages" in refusal(client, system_image)
    assert greedy(client, chat(ok)).choices[0].finish_reason == "length", "the daemon still serves"


def test_short_forms_types_and_odd_paths(daemon: DaemonProc, offline: Any, media: tuple[Path, Path]) -> None:
    """image_url as a plain string (vLLM's short form) is the same image; a data URL must say an image
    type (or none, or application/octet-stream); a path with a NUL is a media_dirs refusal, not a
    "could not build the prompt"."""
    client = daemon.openai()
    raw = png(smooth(64, 48, 1))
    want, _ = offline_text(offline, chat(data_url(raw)))
    short = [{"role": "user", "content": [{"type": "image_url", "image_url": data_url(raw)},
                                          {"type": "text", "text": "What is in the picture?"}]}]
    assert greedy(client, short).choices[0].message.content == want
    for kind in ("", "application/octet-stream", "image/jpeg"):  # the bytes say what the image is
        url = f"data:{kind};base64," + base64.b64encode(raw).decode()
        assert greedy(client, chat(url)).choices[0].message.content == want, kind
    err = refusal(client, chat("data:text/plain;base64," + base64.b64encode(raw).decode()))
    assert "image.url" in err and "text/plain" in err
    for url in (str(media[0] / "a.png") + "\x00x", "file://" + str(media[0] / "a.png") + "%00x"):
        assert "server.media_dirs" in refusal(client, chat(url)), url


def test_placeholders_in_token_prompts_name_their_field(daemon: DaemonProc) -> None:
    """Image or video pad tokens in a token-id prompt (no images can come with one) are a 400 naming
    the field that held the prompt; /generate's image_data is refused by name, not ignored."""
    import httpx

    image_pad, video_pad, start, end = 151655, 151656, 151652, 151653
    h = httpx.Client(base_url=daemon.base_url, timeout=60)
    for ids in ([start, image_pad, image_pad, end, 9707], [start, video_pad, video_pad, end, 9707]):
        r = h.post("/v1/completions", json={"model": "tiny-qwen3-vl", "prompt": ids, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = h.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids", r.text
    assert "video" in r.json()["error"]["message"]
    r = h.post("/generate", json={"text": "hi", "image_data": data_url(png(smooth(16, 16, 4))),
                                  "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_data", r.text


def test_responses_images_refused_name_the_rule_and_the_field(daemon: DaemonProc, media: tuple[Path, Path]) -> None:
    """/v1/responses input_image parts follow the chat rules (they are the chat code), refused naming the
    Responses field: too many, not an image, bad base64, outside server.media_dirs, not in a user
    message. A streamed image request left after its first event is aborted (no segment is left: the
    test below)."""
    import httpx

    ok = data_url(png(smooth(16, 16, 4)))

    def ask(*urls: str, **fields: Any) -> dict[str, Any]:
        parts = [{"type": "input_image", "image_url": u} for u in urls]
        return {"model": "tiny-qwen3-vl", "max_output_tokens": 2,
                "input": [{"role": "user", "content": [*parts, {"type": "input_text", "text": "What is it?"}]}],
                **fields}

    refused = [
        (ask(ok, ok, ok, ok), "input", "server.max_images_per_request"),
        (ask(ok, ok, ok, ok, stream=True), "input", "server.max_images_per_request"),
        (ask("data:text/plain;base64,aGk="), "input", "image.url"),
        (ask("data:image/png;base64," + base64.b64encode(b"not a png").decode()), "input", "image.format"),
        (ask("data:image/png;base64,@@@", stream=True), "input", "image.base64"),
        (ask(str(media[1] / "secret.png")), "input", "server.media_dirs"),
        (ask("file:///etc/passwd"), "input", "server.media_dirs"),
        ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": ok}]}]},
         "input[0].content[0].type", "user messages"),
        ({"input": [{"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image",
                                                                                 "image_url": ok}]}]},
         "input[2].output[0].type", "user messages"),
    ]
    with httpx.Client(base_url=daemon.base_url, timeout=60) as h:
        for body, param, words in refused:
            r = h.post("/v1/responses", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], (param, err)
        r = h.post("/v1/responses", json=ask(ok))
        assert r.status_code == 200 and r.json()["usage"]["input_tokens"] > 12, r.text
        with h.stream("POST", "/v1/responses", json=ask(ok, max_output_tokens=100, stream=True)) as s:
            assert s.status_code == 200
            first = next(ln for ln in s.iter_lines() if ln.startswith("data: "))
            assert '"response.created"' in first


def test_status_names_the_transport_and_no_segment_is_left(daemon: DaemonProc) -> None:
    with daemon.uds_http() as c:
        status = c.get("/admin/status").json()
    model = status["model"]
    assert model["takes_images"] is True
    assert model["tensor_transport"] == {"mode": "default", "fallback_reason": None}
    assert "images:   tensor transport default" in render_status(status).splitlines()
    pids = set(daemon.workers().values())
    left = [s for s in shm_segments() if any(s.startswith(f"mllmd_{p}_") for p in pids)]
    assert not left, f"shared-memory segments left behind: {left}"


def test_images_for_a_text_only_model_are_refused(tiny_model: Path) -> None:
    d = start_daemon(tiny_model)
    try:
        client = d.openai()
        err = refusal(client, chat(data_url(png(smooth(16, 16, 5)))), tiny_model.name)
        assert "images are not supported by the loaded model" in err
    finally:
        stop_and_check(d)
