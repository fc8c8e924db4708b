"""Random Qwen3 (dense) weights drawn with torch alone: the built-in demo model's weights.

transformers 5 turns its model classes off below torch 2.6 (it then serves configs and tokenizers
only), and Jetson's JetPack wheels are torch 2.4 / 2.5, so the demo cannot build its weights through
`Qwen3ForCausalLM` there. This draws the same tensors, in the same order from the same generator and
with the same draw functions, as `mllmd.testing.checkpoints.randomize_weights_` does on transformers' model (every Qwen3 weight is
overwritten there, so transformers' own init leaves no trace); tests/testing/test_random_weights.py
holds the two equal. Serving itself never needs the model classes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

LINEAR_GAIN = 1.5  # linear weights ~ N(0, (LINEAR_GAIN / sqrt(fan_in))^2)
NORM_NOISE = 0.1  # norm weights ~ 1 + N(0, NORM_NOISE^2)
WEIGHTS_FILE = "model.safetensors"


def hf_model_classes_available() -> bool:
    """False where transformers serves configs and tokenizers only (transformers 5 below torch 2.6)."""
    from transformers.utils import is_torch_available

    return bool(is_torch_available())


def init_summary() -> dict[str, Any]:
    """How the weights were drawn, for a checkpoint's marker file."""
    return {
        "embeddings_std": 1.0,
        "linear_std": f"{LINEAR_GAIN} / sqrt(fan_in)",
        "norm": f"1 + N(0, {NORM_NOISE}); final norm with random signs",
    }


def qwen3_weight_layout(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every Qwen3 weight, in transformers' module order; kind is
    "embedding", "linear" or "norm" ("final_norm" for the norm before the lm_head)."""
    if config.get("model_type") != "qwen3":
        raise ValueError(f"torch-only random weights are for Qwen3 dense models, not {config.get('model_type')!r}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("torch-only random weights do not draw biases (attention_bias / mlp_bias)")
    hidden = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    vocab = int(config["vocab_size"])
    layout: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, hidden), "embedding")]
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        layout += [
            (p + "self_attn.q_proj.weight", (heads * head_dim, hidden), "linear"),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), "linear"),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden), "linear"),
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim), "linear"),
            (p + "self_attn.q_norm.weight", (head_dim,), "norm"),
            (p + "self_attn.k_norm.weight", (head_dim,), "norm"),
            (p + "mlp.gate_proj.weight", (inter, hidden), "linear"),
            (p + "mlp.up_proj.weight", (inter, hidden), "linear"),
            (p + "mlp.down_proj.weight", (hidden, inter), "linear"),
            (p + "input_layernorm.weight", (hidden,), "norm"),
            (p + "post_attention_layernorm.weight", (hidden,), "norm"),
        ]
    layout.append(("model.norm.weight", (hidden,), "final_norm"))
    if not config.get("tie_word_embeddings", False):
        layout.append(("lm_head.weight", (vocab, hidden), "embedding"))
    return layout


def draw_embedding(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """An embedding or lm_head: N(0, 1), so the residual stream starts at unit RMS."""
    import torch

    return torch.randn(shape, generator=generator)


def draw_linear(shape: tuple[int, ...], generator: torch.Generator, gain: float = LINEAR_GAIN) -> torch.Tensor:
    """A linear or conv weight: N(0, (gain / sqrt(fan_in))^2), fan_in = every dim after the first."""
    import torch

    return torch.randn(shape, generator=generator) * (gain / math.sqrt(math.prod(shape[1:])))


def draw_norm_scale(shape: tuple[int, ...], generator: torch.Generator, *, flip_signs: bool) -> torch.Tensor:
    """A norm's effective scale: 1 + N(0, NORM_NOISE^2); the final norm's with a random sign per channel
    (a tied lm_head then no longer predicts the current token)."""
    import torch

    scale = 1.0 + NORM_NOISE * torch.randn(shape, generator=generator)
    if flip_signs:
        scale = scale * (torch.randint(0, 2, shape, generator=generator) * 2 - 1)
    return scale


def random_qwen3_weights(config: dict[str, Any], *, seed: int, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """Every weight of a Qwen3 dense `config`, drawn as `randomize_weights_` draws them, in `dtype`.

    A tied lm_head is left out, as transformers leaves it out of the saved checkpoint."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape, kind in qwen3_weight_layout(config):
        if kind == "embedding":
            value = draw_embedding(shape, generator)
        elif kind == "linear":
            value = draw_linear(shape, generator)
        else:
            value = draw_norm_scale(shape, generator, flip_signs=kind == "final_norm")
        weights[name] = value.to(getattr(torch, dtype)).contiguous()
    return weights


def save_random_qwen3_weights(config: dict[str, Any], out: Path, *, seed: int, dtype: str) -> Path:
    """Write `random_qwen3_weights` to `out/model.safetensors` (one file, as transformers writes a
    small model); return the file."""
    from safetensors.torch import save_file

    path = Path(out) / WEIGHTS_FILE
    save_file(random_qwen3_weights(config, seed=seed, dtype=dtype), str(path), metadata={"format": "pt"})
    return path
