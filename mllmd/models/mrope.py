"""Interleaved multimodal RoPE (M-RoPE) of Qwen3-VL and Qwen3.5: 3-axis positions and the rotation they give.

Positions. Every token has a (t, h, w) position. Text tokens have three equal positions that continue
from the previous run; the tokens of an image whose merged grid is (t, h', w') = (t, h/2, w/2) get
t = start + frame, h = start + row, w = start + column, and the text after the image continues from
start + max(h', w'). The prompt's positions therefore end below its length: `delta` = max position + 1 -
length (0 for text, negative with images), and the token at absolute index n >= length (generated, or a
text continuation) has position n + delta on all three axes. Store delta per request (a model-global
cache of it, as transformers keeps, mixes requests up under continuous batching).

Rotation. Rotary frequency i (of rotary_dim / 2) takes its angle from one axis: interleaved, as Qwen3-VL
does, frequency i uses H when i % 3 == 1 and i < 3 * section[1], W when i % 3 == 2 and i < 3 * section[2],
T otherwise (sections [24, 20, 20] for head_dim 128). The cos/sin rows are then laid out as usual for the
"rotate_half" layout, on the first rotary_dim dims of each head; the rest pass through (Qwen3.5: head_dim
256, rotary 64, sections [11, 11, 10]). For text (t = h = w) this is ordinary RoPE.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mllmd.models.layers.rotary import RopeTable

TEXT, IMAGE, VIDEO = 0, 1, 2


def mrope_positions(
    token_types: Sequence[int],
    image_grids: Sequence[Sequence[int]] = (),
    spatial_merge_size: int = 2,
    *,
    video_grids: Sequence[Sequence[int]] = (),
) -> tuple[torch.Tensor, int]:
    """(positions [3, T] int64, delta) for a prompt whose tokens have these types (0 text, 1 image, 2 video).

    `image_grids` are the images' patch grids (t, h, w) in prompt order; each image's tokens
    (t * h * w / merge^2 of them) are consumed from the runs of image tokens in order. Video grids are
    split into frames (t = 1 each), one frame per run of video tokens, as Qwen3-VL separates frames by
    timestamps. Equal to transformers' `Qwen3VLModel.get_rope_index` (and Qwen3.5's).
    """
    grids = {
        IMAGE: [(int(t), int(h), int(w)) for t, h, w in image_grids],
        VIDEO: [(1, int(h), int(w)) for t, h, w in video_grids for _ in range(int(t))],
    }
    used = {IMAGE: 0, VIDEO: 0}
    m = spatial_merge_size
    parts: list[torch.Tensor] = []
    current = 0
    i, n = 0, len(token_types)
    while i < n:
        kind = token_types[i]
        j = i
        while j < n and token_types[j] == kind:
            j += 1
        if kind == TEXT:
            parts.append(torch.arange(current, current + j - i, dtype=torch.int64).expand(3, -1))
            current += j - i
        elif kind in grids:
            pos = i
            while pos < j:  # several images may sit in one run of image tokens
                if used[kind] >= len(grids[kind]):
                    raise ValueError(f"more {'image' if kind == IMAGE else 'video'} tokens than grids")
                t, h, w = grids[kind][used[kind]]
                used[kind] += 1
                gt, gh, gw = t, h // m, w // m
                if pos + gt * gh * gw > j:
                    raise ValueError(
                        f"an image of {gt * gh * gw} tokens does not fit its run of {j - pos} tokens"
                    )
                parts.append(_grid_positions(current, gt, gh, gw))
                current += max(gh, gw)
                pos += gt * gh * gw
        else:
            raise ValueError(f"unknown token type {kind}")
        i = j
    for kind, name in ((IMAGE, "image"), (VIDEO, "video")):
        if used[kind] != len(grids[kind]):
            raise ValueError(f"{len(grids[kind])} {name} grids but {used[kind]} {name}s in the prompt")
    if not parts:
        return torch.zeros(3, 0, dtype=torch.int64), 0
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - n


def _grid_positions(start: int, t: int, h: int, w: int) -> torch.Tensor:
    """[3, t * h * w]: (start + frame, start + row, start + column) in raster order."""
    frame = torch.arange(t).view(t, 1, 1).expand(t, h, w)
    row = torch.arange(h).view(1, h, 1).expand(t, h, w)
    col = torch.arange(w).view(1, 1, w).expand(t, h, w)
    return torch.stack([frame, row, col]).reshape(3, -1) + start


def decode_positions(seq_lens: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """[3, B] positions of the next token of each request: its absolute index plus its delta, all axes."""
    return (seq_lens + deltas).expand(3, -1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def mrope_axis_map(
    rotary_dim: int, mrope_section: Sequence[int], *, interleaved: bool = True
) -> torch.Tensor:
    """[rotary_dim / 2] int64: which axis (0 T, 1 H, 2 W) each rotary frequency takes its angle from."""
    half = rotary_dim // 2
    if len(mrope_section) != 3 or sum(mrope_section) != half:
        raise ValueError(
            f"mrope_section {list(mrope_section)} must be 3 numbers summing to rotary_dim / 2 = {half}"
        )
    index = torch.arange(half)
    if interleaved:
        axis = torch.zeros(half, dtype=torch.int64)
        axis[(index % 3 == 1) & (index < 3 * mrope_section[1])] = 1
        axis[(index % 3 == 2) & (index < 3 * mrope_section[2])] = 2
        return axis
    bounds = torch.tensor([mrope_section[0], mrope_section[0] + mrope_section[1]])
    return torch.bucketize(index, bounds, right=True)  # Qwen2-VL's contiguous sections


class MRotaryEmbedding(nn.Module):
    """M-RoPE on q [T, Hq, head_dim] and k [T, Hkv, head_dim] at positions [3, T] (or [T] for text)."""

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        mrope_section: Sequence[int],
        *,
        interleaved: bool = True,
        scaling: float = 1.0,
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, head_dim={head_dim}]")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.scaling = scaling
        # The angles are computed per step from inv_freq (one product per entry, as transformers computes
        # them): a table of every position would cost 2 x 4 x max_position x rotary_dim / 2 bytes (134 MB
        # for Qwen3-VL's 262,144 positions).
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [rotary/2]
        self.register_buffer(
            "axis_map", mrope_axis_map(rotary_dim, mrope_section, interleaved=interleaved), persistent=False
        )

    @classmethod
    def from_config(cls, text_config: Any, max_position: int) -> MRotaryEmbedding:
        """From a Qwen3-VL / Qwen3.5 text config (rope_parameters or rope_scaling; partial_rotary_factor)."""

        def get(key: str, default: Any = None) -> Any:
            if isinstance(text_config, dict):
                return text_config.get(key, default)
            return getattr(text_config, key, default)

        params = get("rope_parameters") or get("rope_scaling") or {}
        if params.get("rope_type", params.get("type", "default")) not in ("default", "mrope"):
            raise NotImplementedError(f"rope_type {params.get('rope_type')!r} is not supported with M-RoPE")
        head_dim = get("head_dim") or get("hidden_size") // get("num_attention_heads")
        factor = params.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
        theta = params.get("rope_theta", get("rope_theta", 10000.0))
        section = params.get("mrope_section")
        if not section:
            raise ValueError("the text config has no mrope_section")
        return cls(
            int(head_dim),
            int(head_dim * factor),
            max_position,
            float(theta),
            section,
            interleaved=bool(params.get("mrope_interleaved", True)),
        )

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary_dim] fp32 for positions [3, T] (or [T]): once per step, shared by the layers."""
        freqs = positions[..., None].float() * self.inv_freq  # [T, rotary/2] or [3, T, rotary/2]
        if positions.dim() == 2:
            index = self.axis_map.expand(1, positions.shape[1], -1)  # [1, T, rotary/2]
            freqs = freqs.gather(0, index).squeeze(0)  # each frequency from its axis: [T, rotary/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos, sin

    def table(self, positions: torch.Tensor) -> RopeTable:
        """The step's rotation (mllmd.models.layers.rotary) for positions [3, T] or [T]: one row per token,
        built from the half-width cache (no full table of every position is kept)."""
        cos, sin = self.cos_sin(positions)
        return RopeTable(cos, sin, torch.arange(cos.shape[0], dtype=torch.int64, device=cos.device))

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the first rotary_dim dims of q and k by cos/sin rows (cast to q's dtype, as transformers)."""
        cos = cos.to(q.dtype).unsqueeze(1)  # [T, 1, rotary_dim]
        sin = sin.to(q.dtype).unsqueeze(1)
        return self._rotate_one(q, cos, sin), self._rotate_one(k, cos, sin)

    def _rotate_one(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return x * cos + _rotate_half(x) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        return self.rotate(q, k, cos, sin)
