"""Small random-weight checkpoints built from the real Qwen configs, with the real Qwen tokenizer.

`build_tiny_checkpoint(out_dir, "Qwen3-0.6B")` writes a Hugging Face model folder (config.json,
safetensors, generation_config.json, tokenizer) that has the real architecture, vocabulary, special
token ids, RoPE base and norm epsilon of the source model, shrunk to a few layers of width 64. Tests
load it with transformers and with mllmd and compare the two. Nothing is downloaded.

Weights. Hugging Face's own init (normal, std 0.02) gives near-uniform logits and, with tied
embeddings, a model that predicts the same token whatever the context. `randomize_weights_`
re-initialises instead:
  * embeddings and lm_head: normal, std 1 (the residual stream starts at unit RMS);
  * linear and conv weights: normal, std 1.5 / sqrt(fan_in) (each sub-layer adds about 1.5x RMS,
    so attention and MLP outputs outweigh the token embedding and the context matters);
  * norm weights: their usual value (1, or 0 for Qwen3.5's (1 + w) norms) plus normal noise of
    std 0.1; the final norm's scale also gets a random sign per channel, which stops a tied
    lm_head from predicting the current token again (e_t . norm(h) no longer grows with |e_t|^2);
  * everything else (biases, Qwen3.5's A_log / dt_bias) keeps Hugging Face's init, seeded.
Measured on the default build (2 layers, width 64; greedy, float32, 7 random prompts x 64 new
tokens; tied / untied), against Hugging Face's init in brackets:
  * logit std 8.2 (0.16); top-1 minus top-2 logit: median 1.25 / 1.08 (0.30 / 0.02),
    5th percentile 0.08 / 0.11 (0.04 / 0.002), minimum 0.007 / 0.016 (0.0), far above float32
    rounding, so float32 greedy parity is stable;
  * distinct generated tokens 90% / 98% (2.5% / 98%); one last token after 16 random contexts
    gets 16 / 15 different predictions (1 / 16).
Top-1/top-2 gaps stay Gaussian-small relative to the logits, so a bfloat16 forward pass still
picks a different argmax than float32 at ~4% of steps: compare bf16 runs by teacher forcing with a
tolerance, not by exact greedy equality.

Run as a module to build one from the shell:
    python -m mllmd.testing.checkpoints --source Qwen3-0.6B --out /tmp/qwen3-tiny --layers 2
"""

from __future__ import annotations

import argparse
import inspect
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mllmd.checkpoint.folder import (  # noqa: F401  (re-exported: the tests' one entry point)
    MARKER_NAME,
    find_model_source,
    shared_models_dir,
    tiny_config,
    write_checkpoint_folder,
)
from mllmd.checkpoint.random_weights import (
    LINEAR_GAIN,
    draw_embedding,
    draw_linear,
    draw_norm_scale,
    init_summary,
)

if TYPE_CHECKING:
    import torch


def hf_model_class(config_dict: dict[str, Any]) -> Any:
    """transformers' auto class for a config: image-text-to-text where it has a vision tower (Qwen3-VL,
    Qwen3.5: `model.language_model.*` and `model.visual.*`, the names their checkpoints ship), else
    causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if "vision_config" in config_dict else AutoModelForCausalLM


def build_tiny_checkpoint(
    out_dir: str | os.PathLike[str],
    source: str = "Qwen3-0.6B",
    *,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    tie_word_embeddings: bool | None = None,
    dtype: str = "float32",
    seed: int = 0,
    max_shard_size: str | None = None,
    extra_overrides: dict[str, Any] | None = None,
) -> Path:
    """Build a random-weight checkpoint of `source`'s architecture in `out_dir`; return `out_dir`.

    The shape arguments replace the source's; vocab size, special token ids, RoPE and norm settings
    stay. `tie_word_embeddings=None` keeps the source's choice. `max_shard_size` (e.g. "2MB")
    splits the weights into shards with a `model.safetensors.index.json`. `extra_overrides` is
    deep-merged into config.json last (for composite configs, text keys go under "text_config").
    The same arguments always give byte-identical safetensors files. Composite sources (Qwen3.5,
    Qwen3-VL) keep their real layout (`model.language_model.*`, `model.visual.*`) with a 2-block
    vision tower; for Qwen3.5 pass `head_dim >= 32` so every M-RoPE section stays non-empty.
    """
    params = {
        "source": str(source),
        "num_hidden_layers": num_hidden_layers,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "tie_word_embeddings": tie_word_embeddings,
        "dtype": dtype,
        "seed": seed,
        "max_shard_size": max_shard_size,
        "extra_overrides": extra_overrides or {},
    }
    def write_weights(config: dict[str, Any], out: Path) -> None:
        _save_weights(build_random_model(config, seed=seed, dtype=dtype), out, max_shard_size)

    marker = {"weights": "random", "builder": "mllmd.testing.checkpoints", "init": init_summary()}
    return write_checkpoint_folder(Path(out_dir), params, write_weights, marker)


def build_random_model(config_dict: dict[str, Any], *, seed: int, dtype: str = "float32") -> Any:
    """A transformers model for `config_dict` with `randomize_weights_` weights, in `dtype`."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = dict(config_dict)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if "vision_config" in config_dict:  # keep the real checkpoint layout (language_model + visual)
            model = getattr(transformers, config_dict["architectures"][0])._from_config(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
    randomize_weights_(model, seed=seed)
    return model.to(getattr(torch, dtype)).eval()


def randomize_weights_(model: torch.nn.Module, *, seed: int, gain: float = LINEAR_GAIN) -> None:
    """Re-initialise a freshly built `model` in place for well-spread logits (see the module docstring)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    final_norm = _final_norm(model)
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    seen: set[int] = set()  # a tied lm_head shares the embedding's Parameter: draw it once
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.nn.Parameter) or id(weight) in seen:
                continue
            seen.add(id(weight))
            if isinstance(module, torch.nn.Embedding) or module is lm_head:
                weight.copy_(draw_embedding(tuple(weight.shape), generator))
            elif isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
                weight.copy_(draw_linear(tuple(weight.shape), generator, gain))
            elif _is_norm(module):
                # a fresh norm weight is 1 (`x * w`) or 0 (Qwen3.5's `x * (1 + w)`): the same effective scale
                offset = 1.0 - round(weight.detach().float().mean().item())
                weight.copy_(draw_norm_scale(tuple(weight.shape), generator, flip_signs=module is final_norm) - offset)


def redraw_decays(folder: Path, seed: int, low: float = 0.001, high: float = 0.05) -> None:
    """Give a Qwen3.5 checkpoint's Gated DeltaNet heads long memory: A = exp(A_log) drawn in [low, high].
    With transformers' init most heads forget within a token, so a lost or zeroed recurrent state
    changes nothing and a test of state handling could not fail."""
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors = load_file(str(file))
        for key in tensors:
            if key.endswith("linear_attn.A_log"):
                a = torch.empty(tensors[key].shape).uniform_(low, high, generator=g)
                tensors[key] = a.log().to(tensors[key].dtype)
        save_file(tensors, str(file), metadata={"format": "pt"})


def _is_norm(module: Any) -> bool:
    name = type(module).__name__
    return "RMSNorm" in name or "LayerNorm" in name


def _final_norm(model: Any) -> Any:
    """The norm just before the lm_head (`model.norm`, or `model.language_model.norm`)."""
    base = getattr(model, "model", model)
    base = getattr(base, "language_model", base)
    return getattr(base, "norm", None)


def _save_weights(model: Any, out: Path, max_shard_size: str | None) -> None:
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(out, **kwargs)


def _parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mllmd.testing.checkpoints",
        description="Build a small random-weight checkpoint from a real Qwen config (weights are random).",
    )
    parser.add_argument("--source", default="Qwen3-0.6B",
                        help="a real config vendored in mllmd/checkpoint/data (Qwen3-0.6B, Qwen3-8B, "
                             "Qwen3-VL-2B-Instruct, Qwen3.5-0.8B/2B/4B/9B), or a folder with a config.json")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    tie = parser.add_mutually_exclusive_group()
    tie.add_argument(
        "--tied", dest="tie", action="store_true", default=None, help="tie lm_head to embeddings"
    )
    tie.add_argument("--untied", dest="tie", action="store_false", help="separate random lm_head")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default=None, help='e.g. "2MB" for a sharded checkpoint')
    return parser.parse_args(None if argv is None else list(argv))


def main(argv: Iterable[str] | None = None) -> int:
    """CLI entry point: build one checkpoint and print its folder."""
    args = _parse_args(argv)
    out = build_tiny_checkpoint(
        args.out,
        args.source,
        num_hidden_layers=args.layers,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        tie_word_embeddings=args.tie,
        dtype=args.dtype,
        seed=args.seed,
        max_shard_size=args.max_shard_size,
    )
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
