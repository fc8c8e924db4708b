"""Qwen3 (dense) for causal LM: pre-norm decoder with QK-norm, RoPE, GQA and a SwiGLU MLP.

Hidden states are flat [T, H]: all tokens of the step, every request concatenated. Attention goes
through the step's AttentionStep, which reads and writes the paged KV pool. Which kernels run where
is the layers' business (mllmd.models.layers.fusion); this file is the architecture.
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
    RMSNorm,
    RopeTable,
    RotaryAttention,
    compute_logits,
    get_rope,
)
from mllmd.models.quantization import QuantConfig, UnsupportedQuantization, get_linear_scheme
from mllmd.models.weights import load_weights


class Qwen3Attention(nn.Module):
    def __init__(
        self, config: Any, layer_id: int, dtype: torch.dtype, quant: QuantConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=bias,
            dtype=dtype,
            quant=get_linear_scheme(quant, f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"),
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias, dtype=dtype,
                             quant=get_linear_scheme(quant, f"{prefix}.o_proj"))
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.attn = RotaryAttention(self.num_heads, self.num_kv_heads, self.head_dim, layer_id, dtype,
                                    self.q_norm, self.k_norm)

    def forward(self, rope: RopeTable, x: Any, step: AttentionStep) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(rope, q, k, v, step))  # QK-norm, RoPE, paged attention


class Qwen3DecoderLayer(nn.Module):
    # producer -> consumer: the data flow the fusion plan may fuse across
    FUSABLE = {
        "input_layernorm": "self_attn.qkv_proj",
        "post_attention_layernorm": "mlp.gate_up_proj",
        "self_attn.attn": "self_attn.o_proj",
    }

    def __init__(
        self, config: Any, layer_id: int, dtype: torch.dtype, quant: QuantConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_id, dtype, quant, f"{prefix}.self_attn")
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype, quant, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(
        self, rope: RopeTable, hidden: torch.Tensor, residual: torch.Tensor | None, step: AttentionStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(hidden), hidden
        else:
            x, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, x, step)
        x, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(x), residual


class Qwen3Model(nn.Module):
    def __init__(
        self, config: Any, dtype: torch.dtype, quant: QuantConfig | None = None, prefix: str = "model"
    ) -> None:
        """`prefix`: the checkpoint's name for this module, which quantization targets match."""
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, i, dtype, quant, f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary_emb = get_rope(head_dim, config.max_position_embeddings, config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb.table(positions)  # once for every layer
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, step)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 decoder + lm_head (tied to the embeddings when the config says so)."""

    # checkpoint sub-name -> (fused parameter, shard)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: Any, dtype: torch.dtype, quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        lm_head_scheme = get_linear_scheme(quant_config, "lm_head")  # None: kept in the config's ignore list
        if lm_head_scheme is not None and self.tie_word_embeddings:
            raise UnsupportedQuantization(
                "a quantized lm_head tied to the embeddings is not supported (keep lm_head in the config's ignore list)"
            )
        self.model = Qwen3Model(config, dtype, quant_config)
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype=dtype, quant=lm_head_scheme)

    @property
    def attention_shape(self) -> AttentionShape:
        attn = self.model.layers[0].self_attn
        return AttentionShape(len(self.model.layers), attn.num_heads, attn.num_kv_heads, attn.head_dim)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        """Hidden states [T, H] of every token of the step."""
        return self.model(input_ids, positions, step)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, V] for the given rows only (the positions that sample)."""
        return compute_logits(hidden, self.lm_head, self.model.embed_tokens.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the (fused) parameters; error on missing or unexpected names."""

        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                return None
            return name

        load_weights(self, weights, self.stacked_params, rename)
