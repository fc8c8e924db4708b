"""Shared pieces of the multimodal tests: the real Qwen3-VL config folder and encoded test images."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mllmd.testing.checkpoints import find_model_source

VL_SOURCE = "Qwen3-VL-2B-Instruct"


@pytest.fixture(scope="session")
def vl_source() -> Path:
    """Qwen3-VL-2B-Instruct's real config files (shared/models, else the packaged test data)."""
    return find_model_source(VL_SOURCE)


def encode(image: Any, fmt: str, **save_args: Any) -> bytes:
    """A PIL image saved in memory as `fmt`."""
    buf = io.BytesIO()
    image.save(buf, fmt, **save_args)
    return buf.getvalue()


def random_rgb(width: int, height: int, seed: int = 0) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
