"""Qwen3-VL: the Qwen3 decoder with interleaved M-RoPE and deepstack, fed by the Qwen3-VL vision tower.

Checkpoint layout (Qwen3VLForConditionalGeneration): `model.visual.*` (the tower), `model.language_model.*`
(the decoder), `lm_head` (tied to the embeddings in the published models). An image's tokens enter the
decoder as the tower's embeddings in place of its `<|image_pad|>` tokens; the outputs of the vision
blocks listed in `deepstack_visual_indexes` (through their own mergers) are added to the hidden states
at the image positions after decoder layers 0, 1, 2, ... (their place in that list).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mllmd.models.layers import AttentionShape, AttentionStep, Linear, compute_logits
from mllmd.models.mrope import MRotaryEmbedding
from mllmd.models.multimodal import StepImages
from mllmd.models.quantization import QuantConfig, UnsupportedQuantization, get_linear_scheme
from mllmd.models.qwen3 import Qwen3ForCausalLM, Qwen3Model
from mllmd.models.qwen3_vl_vision import VISUAL_PREFIX, Qwen3VLVisionModel
from mllmd.models.weights import load_weights


class Qwen3VLTextModel(Qwen3Model):
    """The decoder: Qwen3's layers, M-RoPE positions [3, T] (or [T] where a step has no image), deepstack."""

    def __init__(self, config: Any, dtype: torch.dtype, quant: QuantConfig | None = None,
                 prefix: str = "model.language_model") -> None:  # fmt: skip
        super().__init__(config, dtype, quant, prefix)
        self.rotary_emb = MRotaryEmbedding.from_config(config, int(config.max_position_embeddings))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: AttentionStep, images: StepImages | None = None
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if images is not None:
            hidden = images.merge(hidden)  # the image tokens' rows: the vision tower's embeddings
        rope = self.rotary_emb.table(positions)  # once for every layer
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(rope, hidden, residual, step)
            if images is not None and i < len(images.deepstack):
                hidden = images.add_deepstack(hidden, i)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3VLModel(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.visual = Qwen3VLVisionModel(config.vision_config, dtype=dtype)
        self.language_model = Qwen3VLTextModel(config.text_config, dtype, quant)


class Qwen3VLForConditionalGeneration(nn.Module):
    """Qwen3-VL for generation: `encode_images` runs the tower, `forward` the decoder on a step's tokens."""

    stacked_params = Qwen3ForCausalLM.stacked_params
    uses_mrope = True

    def __init__(self, config: Any, dtype: torch.dtype, quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = config
        text = config.text_config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
        lm_head_scheme = get_linear_scheme(quant_config, "lm_head")
        if lm_head_scheme is not None and self.tie_word_embeddings:
            raise UnsupportedQuantization("a quantized lm_head tied to the embeddings is not supported")
        self.model = Qwen3VLModel(config, dtype, quant_config)
        self.lm_head = None if self.tie_word_embeddings else Linear(
            text.hidden_size, text.vocab_size, dtype=dtype, quant=lm_head_scheme
        )
        self.image_token_id = int(config.image_token_id)

    @property
    def attention_shape(self) -> AttentionShape:
        lm = self.model.language_model
        attn = lm.layers[0].self_attn
        return AttentionShape(len(lm.layers), attn.num_heads, attn.num_kv_heads, attn.head_dim)

    @property
    def vocab_size(self) -> int:
        return int(self.config.text_config.vocab_size)

    @property
    def visual(self) -> Qwen3VLVisionModel:
        return self.model.visual

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tower on the patches of several images: (embeds [N, H], deepstack [k] x [N, H])."""
        return self.model.visual(pixel_values.to(self.model.visual.dtype), grids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: AttentionStep, images: StepImages | None = None
    ) -> torch.Tensor:
        return self.model.language_model(input_ids, positions, step, images)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return compute_logits(hidden, self.lm_head, self.model.language_model.embed_tokens.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The decoder's tensors by name (fused q/k/v and gate/up), the tower's through its own loader."""
        visual: list[tuple[str, torch.Tensor]] = []

        def decoder_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(VISUAL_PREFIX):
                    visual.append((name, tensor))
                elif "rotary_emb.inv_freq" not in name and not (name == "lm_head.weight" and self.tie_word_embeddings):
                    yield name, tensor

        load_weights(self, decoder_weights(), self.stacked_params, loaded_elsewhere="model.visual.")
        self.model.visual.load_weights(visual)
