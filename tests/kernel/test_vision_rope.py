"""The vision tower's rotary through the rope kernel (one launch for q and k, float32, one rounding)
gives the tower's torch route: same embeddings and deepstack rows on two images of different grids."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels.testing import kernel_device, skip_reason

import mllmd.models.qwen3_vl_vision as vision_mod
from mllmd.models.qwen3_vl_vision import Qwen3VLVisionModel, VisionTowerConfig

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())


def test_rope_kernel_route_equals_the_torch_route(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = VisionTowerConfig(depth=2, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=48,
                            deepstack_visual_indexes=(0,), num_position_embeddings=64)  # fmt: skip
    torch.manual_seed(7)
    tower = Qwen3VLVisionModel(cfg, dtype=torch.float32, device=DEVICE).eval()
    grids = [(1, 4, 6), (1, 8, 2)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), cfg.patch_dim, device=DEVICE)
    calls: list[bool] = []
    real_rope = vision_mod.rope

    def counted_rope(*args: object, **kw: object) -> object:
        calls.append(bool(kw.get("round_products", True)))
        return real_rope(*args, **kw)  # type: ignore[arg-type]

    with torch.no_grad():
        monkeypatch.setattr(vision_mod, "fused_kernels", lambda x: False)
        want, want_deep = tower(pixels, grids)
        monkeypatch.setattr(vision_mod, "fused_kernels", lambda x: True)
        monkeypatch.setattr(vision_mod, "rope", counted_rope)
        got, got_deep = tower(pixels, grids)
    assert calls == [False] * cfg.depth  # the kernel ran in every block, with one rounding
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_deep[0], want_deep[0], rtol=1e-5, atol=1e-5)
