"""Qwen3.5: a hybrid decoder of Gated DeltaNet layers and gated full-attention layers (`layer_types`),
with the Qwen3-VL vision tower (no deepstack).

Full attention: q_proj gives per head [query | gate]; zero-centred QK RMSNorm; interleaved M-RoPE on
the first `partial_rotary_factor` of each head; GQA over the paged KV pool (which holds only these
layers); the output multiplied by sigmoid(gate) before o_proj. Every norm of the decoder is the
zero-centred RMSNorm ((1 + w) in float32). MTP weights (`mtp.*`) are not loaded.

Checkpoints: Qwen3_5ForConditionalGeneration (`model.language_model.*`, `model.visual.*`, `lm_head`) and
the text-only Qwen3_5ForCausalLM (`model.*`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mllmd.models.layers import (
    AttentionShape,
    AttentionStep,
    GatedMLP,
    Linear,
    MergedLinear,
    RopeTable,
    RotaryAttention,
    compute_logits,
)
from mllmd.models.layers.activation import output_gate
from mllmd.models.layers.dispatch import fused_kernels
from mllmd.models.layers.gated_deltanet import GatedDeltaNet, HybridStep
from mllmd.models.layers.norm import ZeroCentredRMSNorm
from mllmd.models.mrope import MRotaryEmbedding
from mllmd.models.multimodal import StepImages
from mllmd.models.quantization import QuantConfig, UnsupportedQuantization, get_linear_scheme
from mllmd.models.qwen3 import Qwen3ForCausalLM
from mllmd.models.qwen3_vl_vision import VISUAL_PREFIX, Qwen3VLVisionModel
from mllmd.models.weights import load_weights


class Qwen3_5Attention(nn.Module):
    def __init__(self, config: Any, kv_layer: int, dtype: torch.dtype, quant: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = MergedLinear(
            config.hidden_size, {"q": 2 * self.q_size, "k": self.kv_size, "v": self.kv_size}, bias=bias, dtype=dtype,
            quant=get_linear_scheme(quant, f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"),
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias, dtype=dtype,
                             quant=get_linear_scheme(quant, f"{prefix}.o_proj"))
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        params = getattr(config, "rope_parameters", None) or {}
        rotary_dim = int(self.head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        self.attn = RotaryAttention(self.num_heads, self.num_kv_heads, self.head_dim, kv_layer, dtype,
                                    self.q_norm, self.k_norm, rotary_dim)  # type: ignore[arg-type]

    def forward(self, rope: RopeTable, x: Any, step: AttentionStep) -> torch.Tensor:
        q_gate, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = q_gate.shape[0]  # (x may be rows whose norm the projection applies: fusion.py)
        q, gate = q_gate.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # per head [query | gate]
        if not fused_kernels(q_gate):  # the torch route works on [T, Hq * D] copies (the kernels read the views)
            q, gate = q.reshape(t, self.q_size), gate.reshape(t, self.q_size)
        out = self.attn(rope, q, k, v, step)  # QK-norm, partial M-RoPE, paged attention
        return self.o_proj(output_gate(out, gate))  # out * sigmoid(gate)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, index: int, dtype: torch.dtype, quant: QuantConfig | None,
                 prefix: str) -> None:  # fmt: skip
        """`index`: the layer's place among the layers of its kind (KV pool or state pools)."""
        super().__init__()
        self.is_linear = config.layer_types[layer_id] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, index, dtype, quant, f"{prefix}.linear_attn")
        else:
            self.self_attn = Qwen3_5Attention(config, index, dtype, quant, f"{prefix}.self_attn")
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype, quant, f"{prefix}.mlp")
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        # producer -> consumer: the data flow the fusion plan may fuse across (as Qwen3DecoderLayer's)
        self.FUSABLE = {
            "input_layernorm": "linear_attn.in_proj" if self.is_linear else "self_attn.qkv_proj",
            "post_attention_layernorm": "mlp.gate_up_proj",
        }

    def forward(
        self, rope: RopeTable, hidden: torch.Tensor, residual: torch.Tensor | None, step: HybridStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(hidden), hidden
        else:
            x, residual = self.input_layernorm(hidden, residual)
        if self.is_linear:
            hidden = self.linear_attn(x, step.states)
        else:
            hidden = self.self_attn(rope, x, step.attention)
        x, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(x), residual


class Qwen3_5TextModel(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, quant: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        counts = {"linear_attention": 0, "full_attention": 0}
        layers = []
        for i, kind in enumerate(config.layer_types):
            layers.append(Qwen3_5DecoderLayer(config, i, counts[kind], dtype, quant, f"{prefix}.layers.{i}"))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.rotary_emb = MRotaryEmbedding.from_config(config, int(config.max_position_embeddings))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: HybridStep, images: StepImages | None = None
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if images is not None:
            hidden = images.merge(hidden)  # the image tokens' rows: the vision tower's embeddings
        rope = self.rotary_emb.table(positions)  # once for every full-attention layer
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, step)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3_5ForConditionalGeneration(nn.Module):
    """Qwen3.5 for generation (also its text-only checkpoints: `vision_config` absent, `model.*` names)."""

    stacked_params = {**Qwen3ForCausalLM.stacked_params, **GatedDeltaNet.stacked_params}
    uses_mrope = True
    hybrid = True

    def __init__(self, config: Any, dtype: torch.dtype, quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = config
        text = getattr(config, "text_config", config)
        self.text_config = text
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
        lm_head_scheme = get_linear_scheme(quant_config, "lm_head")
        if lm_head_scheme is not None and self.tie_word_embeddings:
            raise UnsupportedQuantization("a quantized lm_head tied to the embeddings is not supported")
        vision = getattr(config, "vision_config", None)
        self.prefix = "model.language_model" if vision is not None else "model"
        self.model = nn.Module()
        if vision is not None:
            self.model.visual = Qwen3VLVisionModel(vision, dtype=dtype)
            self.model.language_model = Qwen3_5TextModel(text, dtype, quant_config, self.prefix)
            self.image_token_id = int(config.image_token_id)
        else:
            self.model = Qwen3_5TextModel(text, dtype, quant_config, self.prefix)
        self.lm_head = None if self.tie_word_embeddings else Linear(
            text.hidden_size, text.vocab_size, dtype=dtype, quant=lm_head_scheme
        )

    @property
    def decoder(self) -> Qwen3_5TextModel:
        return self.model.language_model if hasattr(self.model, "language_model") else self.model  # type: ignore[return-value]

    @property
    def attention_shape(self) -> AttentionShape:
        full = [layer.self_attn for layer in self.decoder.layers if not layer.is_linear]
        if not full:  # the KV pool is sized by the full-attention layers (a config the family never ships)
            raise ValueError("the config's layer_types has no full_attention layer: this engine needs at least one")
        return AttentionShape(len(full), full[0].num_heads, full[0].num_kv_heads, full[0].head_dim)

    @property
    def state_layers(self) -> list[GatedDeltaNet]:
        """The Gated DeltaNet layers, in the order of the state pools."""
        return [layer.linear_attn for layer in self.decoder.layers if layer.is_linear]

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.model.visual(pixel_values.to(self.model.visual.dtype), grids)

    @property
    def visual(self) -> Qwen3VLVisionModel:
        return self.model.visual

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: HybridStep, images: StepImages | None = None
    ) -> torch.Tensor:
        return self.decoder(input_ids, positions, step, images)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return compute_logits(hidden, self.lm_head, self.decoder.embed_tokens.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The decoder's tensors by name (fused q/k/v, gate/up and the DeltaNet input projections), the
        tower's through its own loader; `mtp.*` (the multi-token prediction head) is skipped."""
        visual: list[tuple[str, torch.Tensor]] = []
        has_vision = hasattr(self.model, "visual")

        def decoder_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(VISUAL_PREFIX):
                    if has_vision:
                        visual.append((name, tensor))
                    continue
                if name.startswith("mtp.") or "rotary_emb.inv_freq" in name:
                    continue
                if name == "lm_head.weight" and self.tie_word_embeddings:
                    continue
                if not has_vision and name.startswith("model.language_model."):
                    name = "model." + name[len("model.language_model."):]
                yield name, tensor

        load_weights(self, decoder_weights(), self.stacked_params, loaded_elsewhere="model.visual." if has_vision else None)
        if has_vision:
            self.model.visual.load_weights(visual)
