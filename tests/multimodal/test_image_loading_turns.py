"""The tokenizer worker's image thread (VisionPrompts.load_later): requests take turns image by image,
a cancelled load stops before its next image, and server.max_image_pixels is the resize cap."""

from __future__ import annotations

import base64
import threading
from pathlib import Path
from typing import Any

import pytest

from mllmd.daemon.config import load_config
from mllmd.messages import ChatPrompt
from mllmd.workers import vision_prompts

from .conftest import encode, random_rgb


def start(vl_source: Path, **server: Any) -> vision_prompts.VisionPrompts:
    settings = {**load_config("/dev/null", {}).to_dict()["server"], **server}
    return vision_prompts.VisionPrompts.start(str(vl_source), settings, {"tensor_transport_mode": "default"}, "cpu")


def chat(*urls: str) -> ChatPrompt:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "hi"}]
    return ChatPrompt([{"role": "user", "content": parts}])


def url(width: int, height: int, seed: int = 0) -> str:
    return "data:image/png;base64," + base64.b64encode(encode(random_rgb(width, height, seed), "PNG")).decode()


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Any:
    """load_part records the order of the images it loads; the first waits for `release`."""
    order: list[str] = []
    release, started = threading.Event(), threading.Event()
    real = vision_prompts.load_part

    def load_part(part: dict[str, Any], limits: Any, index: int) -> Any:
        tag = part["image_url"]["url"].rsplit("#", 1)[-1]
        order.append(tag)
        if len(order) == 1:
            started.set()
            assert release.wait(30)
        return real({"type": "image_url", "image_url": {"url": part["image_url"]["url"].rsplit("#", 1)[0]}},
                    limits, index)

    monkeypatch.setattr(vision_prompts, "load_part", load_part)
    return order, release, started


def test_requests_take_turns_image_by_image(vl_source: Path, gated: Any) -> None:
    """Before, a request's images were one task: 8 large images held the thread for half a minute
    while another request's one small image waited behind all of them."""
    order, release, started = gated
    vp = start(vl_source)
    try:
        img = url(64, 48)
        a = vp.load_later(chat(*(f"{img}#a{i}" for i in range(1, 4))))
        assert started.wait(30)  # a1 is loading
        b = vp.load_later(chat(f"{img}#b1"))
        release.set()
        assert a is not None and b is not None
        assert len(b.result(30)) == 1 and len(a.result(30)) == 3
        assert order == ["a1", "b1", "a2", "a3"], order
    finally:
        vp.close()


def test_a_cancelled_load_stops_before_its_next_image(vl_source: Path, gated: Any) -> None:
    order, release, started = gated
    vp = start(vl_source)
    try:
        img = url(64, 48)
        a = vp.load_later(chat(*(f"{img}#a{i}" for i in range(1, 5))))
        assert a is not None and started.wait(30)
        assert not a.cancel()  # already running: the future cannot be cancelled, but the load stops
        release.set()
        b = vp.load_later(chat(f"{img}#b1"))
        assert b is not None and len(b.result(30)) == 1
        with pytest.raises(vision_prompts.ImageLoadStopped):
            a.result(30)
        assert order == ["a1", "b1"], order
    finally:
        vp.close()


@pytest.mark.parametrize(("cap", "tokens"), [(None, 972), (16_777_216, 2914), (65_536, 54)])
def test_max_image_pixels_is_the_resize_cap(vl_source: Path, cap: int | None, tokens: int) -> None:
    """A 2000x1500 photo: 972 tokens under the default cap (1,048,576 pixels), the transformers
    processor's 2,914 with the model's own max_pixels, 54 with a cap of 65,536 pixels."""
    vp = start(vl_source, **({} if cap is None else {"max_image_pixels": cap}))
    try:
        load = vp.load_later(chat(url(2000, 1500)))
        assert load is not None
        assert [im.num_tokens for im in load.result(60)] == [tokens]
    finally:
        vp.close()


@pytest.mark.parametrize(("detail", "tokens"), [(None, 972), ("auto", 972), ("high", 972), ("low", 234)])
def test_detail_low_caps_an_image_at_256_tokens(vl_source: Path, detail: str | None, tokens: int) -> None:
    vp = start(vl_source)
    try:
        part: dict[str, Any] = {"url": url(2000, 1500)}
        if detail is not None:
            part["detail"] = detail
        load = vp.load_later(ChatPrompt([{"role": "user", "content": [{"type": "image_url", "image_url": part}]}]))
        assert load is not None
        assert [im.num_tokens for im in load.result(60)] == [tokens]
    finally:
        vp.close()
