"""M-RoPE positions equal transformers' get_rope_index; the rotation equals its text rotary + apply_rotary_pos_emb."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mllmd.models.mrope import MRotaryEmbedding, decode_positions, mrope_axis_map, mrope_positions

IMAGE_PAD = 151655


def hf_rope_index(ids: list[int], types: list[int], grids: list[list[int]]) -> tuple[torch.Tensor, int]:
    """transformers' Qwen3VLModel.get_rope_index on one sequence (it needs only the merge size from self)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)))
    fake.get_vision_position_ids = functools.partial(Qwen3VLModel.get_vision_position_ids, fake)
    positions, deltas = Qwen3VLModel.get_rope_index(
        fake,
        torch.tensor([ids]),
        mm_token_type_ids=torch.tensor([types]),
        image_grid_thw=torch.tensor(grids) if grids else None,
    )
    return positions[:, 0], int(deltas[0, 0])


def prompt(layout: list[Any], seed: int = 0) -> tuple[list[int], list[int], list[list[int]]]:
    """ids, token types and grids for a layout of text lengths (int) and image grids (list)."""
    rng = random.Random(seed)
    ids: list[int] = []
    types: list[int] = []
    grids: list[list[int]] = []
    for part in layout:
        if isinstance(part, int):
            ids += [rng.randrange(151000) for _ in range(part)]
            types += [0] * part
        else:
            count = part[0] * part[1] * part[2] // 4
            ids += [IMAGE_PAD] * count
            types += [1] * count
            grids.append(part)
    return ids, types, grids


LAYOUTS = {
    "text-only": [17],
    "image-at-start": [[1, 4, 6], 9],
    "image-in-middle": [4, [1, 4, 6], 9],
    "image-at-end": [5, [1, 8, 4]],
    "two-images": [3, [1, 4, 6], 5, [1, 10, 4], 2],
    "image-only": [[1, 2, 2]],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_positions_equal_get_rope_index(name: str) -> None:
    ids, types, grids = prompt(LAYOUTS[name])
    positions, delta = mrope_positions(types, grids, 2)
    ref, ref_delta = hf_rope_index(ids, types, grids)
    assert positions.dtype == torch.int64 and positions.shape == (3, len(ids))
    assert torch.equal(positions, ref) and delta == ref_delta


def test_worked_example() -> None:
    _, types, grids = prompt([4, [1, 4, 6], 9])
    positions, delta = mrope_positions(types, grids, 2)
    assert positions[0].tolist() == [0, 1, 2, 3] + [4] * 6 + list(range(7, 16))
    assert positions[1, 4:10].tolist() == [4, 4, 4, 5, 5, 5] and positions[2, 4:10].tolist() == [
        4,
        5,
        6,
        4,
        5,
        6,
    ]
    assert delta == 16 - 19 == -3
    assert mrope_positions([0] * 5)[1] == 0


def test_text_after_the_prompt_is_n_plus_delta() -> None:
    ids, types, grids = prompt([3, [1, 4, 6], 5, [1, 10, 4], 2])
    _, delta = mrope_positions(types, grids, 2)
    longer, _ = mrope_positions(types + [0] * 6, grids, 2)  # the prompt and 6 generated tokens
    n = torch.arange(len(ids), len(ids) + 6)
    assert torch.equal(longer[:, len(ids) :], (n + delta).expand(3, -1))
    seq_lens = torch.tensor([len(ids), 7])
    assert torch.equal(
        decode_positions(seq_lens, torch.tensor([delta, 0])), torch.tensor([[len(ids) + delta, 7]] * 3)
    )


def test_adjacent_images_and_count_errors() -> None:
    _, types, grids = prompt([2, [1, 2, 2], [1, 4, 2], 2])  # two images with no text between them
    positions, _ = mrope_positions(types, grids, 2)
    assert positions[:, 2].tolist() == [2, 2, 2] and positions[:, 3].tolist() == [3, 3, 3]
    with pytest.raises(ValueError, match="grids"):
        mrope_positions(types, grids[:1], 2)
    with pytest.raises(ValueError, match="grids but"):
        mrope_positions(types, grids + [[1, 2, 2]], 2)


def test_video_frames_match_transformers() -> None:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    # 3 text, frame 1 (4 tokens), 2 text (a timestamp), frame 2, 1 text: one video of grid (2, 4, 4)
    types = [0] * 3 + [2] * 4 + [0] * 2 + [2] * 4 + [0]
    fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)))
    fake.get_vision_position_ids = functools.partial(Qwen3VLModel.get_vision_position_ids, fake)
    ref, deltas = Qwen3VLModel.get_rope_index(
        fake,
        torch.zeros(1, len(types), dtype=torch.long),
        torch.tensor([types]),
        video_grid_thw=torch.tensor([[2, 4, 4]]),
    )
    positions, delta = mrope_positions(types, (), 2, video_grids=[[2, 4, 4]])
    assert torch.equal(positions, ref[:, 0]) and delta == int(deltas[0, 0])


def test_axis_map() -> None:
    axis = mrope_axis_map(128, [24, 20, 20])
    assert [int((axis == a).sum()) for a in range(3)] == [24, 20, 20]
    assert axis[:6].tolist() == [0, 1, 2, 0, 1, 2] and axis[60:].tolist() == [0] * 4
    assert mrope_axis_map(8, [2, 1, 1], interleaved=False).tolist() == [0, 0, 1, 2]
    with pytest.raises(ValueError, match="summing"):
        mrope_axis_map(128, [24, 20, 19])


def _qwen3_vl_text_config(vl_source: Path, **overrides: Any) -> Any:
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig

    text = json.loads((vl_source / "config.json").read_text())["text_config"]
    text.pop("model_type")
    text.update(overrides)
    return Qwen3VLTextConfig(**text)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_qwen3_vl(vl_source: Path, dtype: torch.dtype) -> None:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        Qwen3VLTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = _qwen3_vl_text_config(vl_source)  # head_dim 128, sections [24, 20, 20], theta 5e6
    _, types, grids = prompt([3, [1, 4, 6], 5, [1, 10, 4], 2])
    positions, _ = mrope_positions(types, grids, 2)
    positions = positions + 3000  # far from 0, where rounding of large angles shows
    t = positions.shape[1]
    q = torch.randn(t, 16, 128).to(dtype)
    k = torch.randn(t, 8, 128).to(dtype)
    hf_rope = Qwen3VLTextRotaryEmbedding(config)
    cos, sin = hf_rope(q, positions[:, None, :])
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rope = MRotaryEmbedding.from_config(config, max_position=8192)
    assert rope.rotary_dim == 128
    got_q, got_k = rope(positions, q, k)
    tol = {"rtol": 0, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1), **tol)
    torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1), **tol)


def test_text_positions_are_plain_rope(vl_source: Path) -> None:
    rope = MRotaryEmbedding.from_config(_qwen3_vl_text_config(vl_source), max_position=64)
    positions = torch.arange(20)
    q, k = torch.randn(20, 2, 128), torch.randn(20, 1, 128)
    a = rope(positions, q, k)
    b = rope(positions.expand(3, -1), q, k)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_config_dict_of_a_tiny_checkpoint() -> None:
    # build_tiny_checkpoint's Qwen3-VL: head_dim 16, sections rescaled to [3, 3, 2]
    text = {
        "head_dim": 16,
        "rope_scaling": {"rope_theta": 5e6, "mrope_section": [3, 3, 2], "rope_type": "default"},
    }
    rope = MRotaryEmbedding.from_config(text, max_position=32)
    assert rope.rotary_dim == 16 and rope.axis_map.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="mrope_section"):
        MRotaryEmbedding.from_config({"head_dim": 16, "rope_parameters": {"rope_theta": 1e4}}, max_position=8)


def test_partial_rotary_equals_qwen3_5() -> None:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding, apply_rotary_pos_emb

    # Qwen3.5-0.8B's text rotary: head_dim 256, 64 rotary dims, sections [11, 11, 10], theta 1e7.
    rope_parameters = {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }
    config = Qwen3_5TextConfig(
        head_dim=256,
        hidden_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_parameters=rope_parameters,
    )
    _, types, grids = prompt([2, [1, 6, 4], 7, [1, 2, 8]], seed=1)
    positions, _ = mrope_positions(types, grids, 2)
    t = positions.shape[1]
    q, k = torch.randn(t, 8, 256), torch.randn(t, 2, 256)
    cos, sin = Qwen3_5TextRotaryEmbedding(config)(q, positions[:, None, :])
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rope = MRotaryEmbedding.from_config(config, max_position=256)
    assert (rope.head_dim, rope.rotary_dim) == (256, 64)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1), rtol=0, atol=2e-6)
    torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1), rtol=0, atol=2e-6)
    assert torch.equal(got_q[..., 64:], q[..., 64:])  # the unrotated dims pass through
