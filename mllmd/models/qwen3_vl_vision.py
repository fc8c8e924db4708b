"""Qwen3-VL vision tower: patch embedding, interpolated learned positions, 2-D rotary ViT, 2x2 merger, deepstack.

Input: the patch rows of one or more images packed together, [N, 3 * 2 * 16 * 16] (what
`mllmd.multimodal.patchify` makes), and each image's patch grid (t, h, w). Output: one row per LLM image
token, [N / 4, out_hidden], plus one such tensor per `deepstack_visual_indexes` entry (the outputs of
those blocks through their own mergers), which the language model adds to its hidden states at the
image positions after decoder layers 0, 1, 2... (the list position, not the block number).

  patch_embed   Conv3d with kernel = stride = (2, 16, 16) over one patch: a Linear over the flat row.
  pos_embed     a learned 48x48 table, bilinearly resampled (align_corners) to each image's h x w grid.
  blocks        pre-norm LayerNorm -> qkv (bias) -> 2-D rotary (rows on the first half of each head's
                frequencies, columns on the second) -> bidirectional attention inside each frame ->
                proj; LayerNorm -> fc1 -> GELU (tanh) -> fc2.
  merger        LayerNorm -> the 4 patches of a 2x2 block side by side -> fc1 -> GELU (erf) -> fc2;
                deepstack mergers take the LayerNorm after the concatenation instead.

Patches arrive in merge-block order (each 2x2 block's 4 patches together), so merging is a reshape.
Everything that depends on the grids (rotary angles, interpolation taps, segment lengths) is built once
per call by `prepare` with tensor ops on the target device, no per-image loop; the grids are read on the
host (a list, or a CPU tensor). Qwen3.5's tower is the same without deepstack.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from mllmd_kernels import rope
from torch import nn

from mllmd.models.layers.dispatch import fused_kernels
from mllmd.models.layers.linear import check_tensor_dtype

VISUAL_PREFIX = "model.visual."


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


@dataclass(frozen=True)
class VisionTowerConfig:
    """The vision_config keys the tower reads (a Hugging Face config object or its dict)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, config: Any) -> VisionTowerConfig:
        rope = _get(config, "rope_parameters") or {}
        return cls(
            depth=int(_get(config, "depth")),
            hidden_size=int(_get(config, "hidden_size")),
            num_heads=int(_get(config, "num_heads")),
            intermediate_size=int(_get(config, "intermediate_size")),
            out_hidden_size=int(_get(config, "out_hidden_size")),
            hidden_act=str(_get(config, "hidden_act", "gelu_pytorch_tanh")),
            in_channels=int(_get(config, "in_channels", 3)),
            patch_size=int(_get(config, "patch_size", 16)),
            temporal_patch_size=int(_get(config, "temporal_patch_size", 2)),
            spatial_merge_size=int(_get(config, "spatial_merge_size", 2)),
            num_position_embeddings=int(_get(config, "num_position_embeddings", 2304)),
            deepstack_visual_indexes=tuple(int(i) for i in (_get(config, "deepstack_visual_indexes") or ())),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    def __post_init__(self) -> None:
        side = round(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} is not a square")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad or len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            raise ValueError(
                f"deepstack_visual_indexes {self.deepstack_visual_indexes} must be distinct blocks < {self.depth}"
            )
        if self.head_dim % 4:
            raise ValueError(f"head_dim {self.head_dim} must be a multiple of 4 (2-D rotary)")


@dataclass
class VisionInputs:
    """Per-call tensors derived from the grids (built by `Qwen3VLVisionModel.prepare`)."""

    grids: list[tuple[int, int, int]]  # host (t, h, w) per image
    seqlens: list[int]  # host: patches per attention segment (one per frame)
    cu_seqlens: torch.Tensor  # [segments + 1] int32, for varlen kernels
    max_seqlen: int
    cos: torch.Tensor  # [N, head_dim] fp32
    sin: torch.Tensor  # [N, head_dim] fp32
    pos_index: torch.Tensor  # [N, 4] int64 rows of the position table
    pos_weight: torch.Tensor  # [N, 4] fp32 bilinear weights
    rows: torch.Tensor  # [N] int64 0..N-1: each patch's row of cos / sin (for the rope kernel)

    @property
    def num_patches(self) -> int:
        return sum(t * h * w for t, h, w in self.grids)


def vision_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: VisionInputs, scale: float
) -> torch.Tensor:
    """Bidirectional attention inside each segment of `inputs.seqlens`; q, k, v, out: [N, heads, head_dim].

    The one place a varlen kernel (FlashAttention / mllmd_kernels' extend attention, non-causal, from
    `cu_seqlens` and `max_seqlen`) replaces SDPA. Here SDPA runs once per run of equal-length segments
    (the frames of a video, same-size images), batched, with no mask and no [N, N] tensor.
    """
    out = torch.empty_like(q)
    start = 0
    lengths = inputs.seqlens
    i = 0
    while i < len(lengths):
        j = i
        while j < len(lengths) and lengths[j] == lengths[i]:
            j += 1
        count, length = j - i, lengths[i]
        end = start + count * length
        qs, ks, vs = (x[start:end].view(count, length, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [count, heads, length, head_dim]
        out[start:end] = o.transpose(1, 2).reshape(end - start, *q.shape[1:])
        start, i = end, j
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _activation(name: str) -> Any:
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name in ("silu", "swish"):
        return F.silu
    raise ValueError(f"unsupported vision hidden_act {name!r}")


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionTowerConfig, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True, dtype=dtype, device=device)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, inputs: VisionInputs) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # each [N, heads, head_dim]
        if fused_kernels(x):  # one launch for both, in float32 with one rounding as below
            q, k = rope(inputs.rows, q, k, inputs.cos, inputs.sin, round_products=False)
        else:
            cos, sin = inputs.cos.unsqueeze(1), inputs.sin.unsqueeze(1)  # [N, 1, head_dim] fp32
            q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
            k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        out = vision_attention(q, k, v, inputs, self.scale)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionTowerConfig, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(
            cfg.hidden_size, cfg.intermediate_size, bias=True, dtype=dtype, device=device
        )
        self.linear_fc2 = nn.Linear(
            cfg.intermediate_size, cfg.hidden_size, bias=True, dtype=dtype, device=device
        )
        self.act = _activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionTowerConfig, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6, dtype=dtype, device=device)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6, dtype=dtype, device=device)
        self.attn = VisionAttention(cfg, dtype, device)
        self.mlp = VisionMLP(cfg, dtype, device)

    def forward(self, x: torch.Tensor, inputs: VisionInputs) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), inputs)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge neighbouring patches -> one LLM token row (the norm before or after joining them)."""

    def __init__(
        self, cfg: VisionTowerConfig, *, postshuffle_norm: bool, dtype: torch.dtype, device: Any
    ) -> None:
        super().__init__()
        self.joined = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        norm_dim = self.joined if postshuffle_norm else cfg.hidden_size
        self.norm = nn.LayerNorm(norm_dim, eps=1e-6, dtype=dtype, device=device)
        self.linear_fc1 = nn.Linear(self.joined, self.joined, bias=True, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(self.joined, cfg.out_hidden_size, bias=True, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.joined))
        else:
            x = self.norm(x).view(-1, self.joined)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (kernel = stride = one patch) as the Linear it is over a flat patch row."""

    def __init__(self, cfg: VisionTowerConfig, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=True, dtype=dtype, device=device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))


def _normalize_grids(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    if isinstance(grid_thw, torch.Tensor):
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw must be [num_images, 3], got {tuple(grid_thw.shape)}")
        rows = grid_thw.tolist()  # a device tensor costs one sync here: pass host grids
    else:
        rows = [list(row) for row in grid_thw]
    grids = [(int(t), int(h), int(w)) for t, h, w in rows]
    if not grids:
        raise ValueError("grid_thw is empty")
    return grids


class Qwen3VLVisionModel(nn.Module):
    """The vision tower of Qwen3-VL (and Qwen3.5, without deepstack); names follow `model.visual.*`."""

    def __init__(self, config: Any, *, dtype: torch.dtype = torch.float32, device: Any = None) -> None:
        super().__init__()
        cfg = config if isinstance(config, VisionTowerConfig) else VisionTowerConfig.from_hf(config)
        self.config = cfg
        self.merge = cfg.spatial_merge_size
        self.side = round(cfg.num_position_embeddings**0.5)
        self.patch_embed = PatchEmbed(cfg, dtype, device)
        self.pos_embed = nn.Embedding(
            cfg.num_position_embeddings, cfg.hidden_size, dtype=dtype, device=device
        )
        self.blocks = nn.ModuleList([VisionBlock(cfg, dtype, device) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, postshuffle_norm=False, dtype=dtype, device=device)
        self.deepstack_merger_list = nn.ModuleList(
            [
                PatchMerger(cfg, postshuffle_norm=True, dtype=dtype, device=device)
                for _ in cfg.deepstack_visual_indexes
            ]
        )
        self.deepstack_slot = {block: slot for slot, block in enumerate(cfg.deepstack_visual_indexes)}
        quarter = cfg.head_dim // 4  # frequencies per axis
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float) / (2 * quarter))
        )
        self.register_buffer("inv_freq", inv_freq.to(device=device), persistent=False)  # [head_dim / 4]

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def prepare(self, grid_thw: torch.Tensor | Sequence[Sequence[int]], device: Any = None) -> VisionInputs:
        """Rotary angles, position-table taps and attention segments for these grids, built on `device`."""
        grids = _normalize_grids(grid_thw)
        m, side = self.merge, self.side
        for t, h, w in grids:
            if min(t, h, w) < 1 or h % m or w % m:
                raise ValueError(f"grid (t={t}, h={h}, w={w}) must be positive with h, w multiples of {m}")
        device = torch.device(device) if device is not None else self.inv_freq.device
        counts_host = [t * h * w for t, h, w in grids]
        n = sum(counts_host)
        seqlens = [h * w for t, h, w in grids for _ in range(t)]
        g = _to_device(grids, torch.int64, device)  # [I, 3]
        counts = _to_device(counts_host, torch.int64, device)
        image = torch.repeat_interleave(torch.arange(len(grids), device=device), counts, output_size=n)  # [N]
        first = torch.cumsum(counts, 0) - counts
        heights, widths = g[image, 1], g[image, 2]
        within = (torch.arange(n, device=device) - first[image]) % (
            heights * widths
        )  # index inside the frame
        # merge-block order: (block row, block column, row in block, column in block)
        in_col = within % m
        in_row = (within // m) % m
        block = within // (m * m)
        row = (block // (widths // m)) * m + in_row
        col = (block % (widths // m)) * m + in_col
        inv_freq = self.inv_freq.to(device)
        angles = torch.cat([row[:, None].float() * inv_freq, col[:, None].float() * inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)  # [N, head_dim]
        rows_i, rows_w = _bilinear_taps(row, heights, side)
        cols_i, cols_w = _bilinear_taps(col, widths, side)
        pos_index = (rows_i[:, :, None] * side + cols_i[:, None, :]).reshape(n, 4)
        pos_weight = (rows_w[:, :, None] * cols_w[:, None, :]).reshape(n, 4)
        seg = _to_device(seqlens, torch.int32, device)
        cu_seqlens = F.pad(torch.cumsum(seg, 0, dtype=torch.int32), (1, 0))
        return VisionInputs(
            grids, seqlens, cu_seqlens, max(seqlens), angles.cos(), angles.sin(), pos_index, pos_weight,
            torch.arange(n, device=device),
        )

    def _positions(self, inputs: VisionInputs) -> torch.Tensor:
        """Each patch's bilinear mix of 4 position-table rows, summed in fp32 ([N, hidden])."""
        table = self.pos_embed.weight
        acc = table[inputs.pos_index[:, 0]].float() * inputs.pos_weight[:, 0:1]
        for tap in range(1, 4):
            acc = acc + table[inputs.pos_index[:, tap]].float() * inputs.pos_weight[:, tap : tap + 1]
        return acc

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]] | VisionInputs
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [N, patch_dim], grids -> (embeds [N / merge^2, out_hidden], deepstack list of the same)."""
        inputs = (
            grid_thw if isinstance(grid_thw, VisionInputs) else self.prepare(grid_thw, pixel_values.device)
        )
        if pixel_values.shape != (inputs.num_patches, self.config.patch_dim):
            raise ValueError(
                f"pixel_values {tuple(pixel_values.shape)} do not match the grids "
                f"({inputs.num_patches} patches of {self.config.patch_dim})"
            )
        x = self.patch_embed(pixel_values)  # [N, hidden]
        x = x + self._positions(inputs).to(x.dtype)
        deepstack: list[torch.Tensor] = []
        for index, block in enumerate(self.blocks):
            x = block(x, inputs)
            slot = self.deepstack_slot.get(index)
            if slot is not None:
                deepstack.append(self.deepstack_merger_list[slot](x))
        return self.merger(x), deepstack

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], prefix: str = VISUAL_PREFIX) -> None:
        """Copy the checkpoint's `model.visual.*` tensors in; ValueError naming missing/unexpected/misshapen ones.

        The caller passes only the tower's tensors (filter the checkpoint on `prefix`).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            key = name[len(prefix) :] if name.startswith(prefix) else None
            param = params.get(key) if key is not None else None
            if param is None or key is None:
                unexpected.append(name)
                continue
            if key == "patch_embed.proj.weight" and tensor.dim() == 5:  # Conv3d [hidden, C, T, P, P]
                tensor = tensor.reshape(tensor.shape[0], -1)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
                )
            check_tensor_dtype(name, tensor, param.dtype)
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(key)
        missing = sorted(set(params) - loaded)
        if missing or unexpected:
            raise ValueError(
                f"vision tower weights do not match: missing {[prefix + k for k in missing][:8]}"
                f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
            )


def _to_device(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device`; to CUDA through pinned memory, so the copy does not block the host."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """2 source rows and weights per target position, resampling `side` rows to `size` (align_corners)."""
    source = index.float() * (side - 1) / (size - 1).clamp(min=1)  # [N] fp32
    floor = source.floor()
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)  # [N, 2]
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)  # [N, 2]
    return taps, weights
