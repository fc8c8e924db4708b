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
import copy
import inspect
import json
import math
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mllmd import knobs
from mllmd.demo_weights import LINEAR_GAIN, NORM_NOISE, save_random_qwen3_weights
from mllmd.testing.tokenizer import DATA_DIR, build_qwen_tokenizer

if TYPE_CHECKING:
    import torch

MARKER_NAME = "MLLMD_TEST_CHECKPOINT.json"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the `mllmd` package
# Extra files copied verbatim from the source folder when present.
COPIED_FILES = ("generation_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
TINY_VISION = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4}


def shared_models_dir() -> Path:
    """The real model configs: `$MLLMD_SHARED_MODELS`, else `<repo root>/../shared/models`."""
    return knobs.shared_models_dir() or PACKAGE_ROOT.parent / "shared" / "models"


def hf_model_class(config_dict: dict[str, Any]) -> Any:
    """transformers' auto class for a config: image-text-to-text where it has a vision tower (Qwen3-VL,
    Qwen3.5: `model.language_model.*` and `model.visual.*`, the names their checkpoints ship), else
    causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if "vision_config" in config_dict else AutoModelForCausalLM


def find_model_source(source: str | os.PathLike[str]) -> Path:
    """Folder of the real config files for `source` (a folder path, or a model name).

    A name is looked up in `$MLLMD_SHARED_MODELS` when set, then in the copies vendored in
    `mllmd/testing/data/` (every model of shared/models), then in `../shared/models`.
    """
    path = Path(source)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    candidates = [DATA_DIR / str(source), shared_models_dir() / str(source)]
    if knobs.shared_models_dir() is not None:
        candidates.reverse()
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"no config.json for model source {str(source)!r} (looked in {looked})")


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
    src = find_model_source(source)
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    config_dict = tiny_config(raw, params)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if _hf_model_classes_available() or config_dict.get("model_type") != "qwen3" or max_shard_size is not None:
        model = build_random_model(config_dict, seed=seed, dtype=dtype)
        _save_weights(model, out, max_shard_size)
    else:  # torch below 2.6 under transformers 5 (Jetson): the same tensors, drawn with torch alone
        save_random_qwen3_weights(config_dict, out, seed=seed, dtype=dtype)
    _write_json(out / "config.json", config_dict)
    _copy_source_files(src, out)
    _build_tokenizer(src, raw, out)
    marker = {"weights": "random", "builder": "mllmd.testing.checkpoints", "init": _init_summary()}
    _write_json(out / MARKER_NAME, {**marker, "params": params})
    return out


def tiny_config(raw: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The source's config.json dict with the shape overrides of `params` applied (a new dict)."""
    config = copy.deepcopy(raw)
    if "quantization_config" in config:
        raise ValueError("random weights cannot fill a quantized checkpoint; build from the base model")
    text = config.get("text_config", config)
    layers = params["num_hidden_layers"]
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads"):
        text[key] = params[key]
    text["num_key_value_heads"] = params["num_key_value_heads"]
    text["head_dim"] = params["head_dim"]
    if "max_window_layers" in text:
        text["max_window_layers"] = layers
    if "layer_types" in text:
        text["layer_types"] = _hybrid_layer_types(text["layer_types"], layers)
    _shrink_linear_attention(text, params)
    for rope_key in ("rope_scaling", "rope_parameters"):
        if isinstance(text.get(rope_key), dict):
            _scale_mrope(text[rope_key], params["head_dim"])
    if isinstance(config.get("vision_config"), dict):
        _shrink_vision(config["vision_config"], params["hidden_size"])
    if params["tie_word_embeddings"] is not None:
        config["tie_word_embeddings"] = text["tie_word_embeddings"] = params["tie_word_embeddings"]
    _set_dtype(config, text, params["dtype"])
    _deep_merge(config, params["extra_overrides"])
    return config


def _hybrid_layer_types(pattern: list[Any], n: int) -> list[Any]:
    """Repeat a per-layer pattern (e.g. Qwen3.5's 3 linear + 1 full attention) over `n` layers.

    Fewer layers than the pattern's period would drop every full-attention layer (2 of Qwen3.5's
    "linear, linear, linear, full"), a model no engine pages KV for: the last layer then takes the
    pattern's full attention, so every kind of the source is still built."""
    types = [pattern[i % len(pattern)] for i in range(n)]
    if n and "full_attention" in pattern and "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def _shrink_linear_attention(text: dict[str, Any], params: dict[str, Any]) -> None:
    """Qwen3.5 Gated DeltaNet layers: key heads = KV heads, value heads = query heads, dim = head_dim."""
    if "linear_num_key_heads" not in text:
        return
    text["linear_num_key_heads"] = params["num_key_value_heads"]
    text["linear_num_value_heads"] = params["num_attention_heads"]
    text["linear_key_head_dim"] = params["head_dim"]
    text["linear_value_head_dim"] = params["head_dim"]


def _scale_mrope(rope: dict[str, Any], head_dim: int) -> None:
    """Rescale an M-RoPE `mrope_section` so that it still sums to half the rotary dimension."""
    sections = rope.get("mrope_section")
    if not sections:
        return
    half = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    exact = [s * half / sum(sections) for s in sections]
    scaled = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: scaled[i] - exact[i])
    for i in by_remainder[: half - sum(scaled)]:
        scaled[i] += 1
    rope["mrope_section"] = scaled


def _shrink_vision(vision: dict[str, Any], text_hidden: int) -> None:
    vision.update(TINY_VISION)
    vision["out_hidden_size"] = text_hidden
    if vision.get("deepstack_visual_indexes"):
        count = min(len(vision["deepstack_visual_indexes"]), TINY_VISION["depth"])
        vision["deepstack_visual_indexes"] = list(range(count))


def _set_dtype(config: dict[str, Any], text: dict[str, Any], dtype: str) -> None:
    found = False
    for target in (config, text):
        for key in ("torch_dtype", "dtype"):
            if key in target:
                target[key] = dtype
                found = True
    if not found:
        config["torch_dtype"] = dtype


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def _hf_model_classes_available() -> bool:
    """False where transformers serves configs and tokenizers only (transformers 5 below torch 2.6)."""
    from transformers.utils import is_torch_available

    return bool(is_torch_available())


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
                weight.copy_(torch.randn(weight.shape, generator=generator))
            elif isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
                fan_in = weight[0].numel()
                weight.copy_(torch.randn(weight.shape, generator=generator) * (gain / math.sqrt(fan_in)))
            elif _is_norm(module):
                _randomize_norm_(weight, generator, flip_signs=module is final_norm)


def _is_norm(module: Any) -> bool:
    name = type(module).__name__
    return "RMSNorm" in name or "LayerNorm" in name


def _final_norm(model: Any) -> Any:
    """The norm just before the lm_head (`model.norm`, or `model.language_model.norm`)."""
    base = getattr(model, "model", model)
    base = getattr(base, "language_model", base)
    return getattr(base, "norm", None)


def _randomize_norm_(weight: torch.Tensor, generator: torch.Generator, *, flip_signs: bool) -> None:
    """Effective scale 1 + noise (sign-flipped per channel if asked), whatever the norm's convention.

    A freshly initialised norm weight is 1 (`x * w`) or 0 (Qwen3.5's `x * (1 + w)`).
    """
    import torch

    offset = 1.0 - round(weight.detach().float().mean().item())  # 0 for `x * w`, 1 for `x * (1 + w)`
    scale = 1.0 + NORM_NOISE * torch.randn(weight.shape, generator=generator)
    if flip_signs:
        scale = scale * (torch.randint(0, 2, weight.shape, generator=generator) * 2 - 1)
    weight.copy_(scale - offset)


def _init_summary() -> dict[str, Any]:
    return {
        "embeddings_std": 1.0,
        "linear_std": f"{LINEAR_GAIN} / sqrt(fan_in)",
        "norm": f"1 + N(0, {NORM_NOISE}); final norm with random signs",
    }


def _save_weights(model: Any, out: Path, max_shard_size: str | None) -> None:
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(out, **kwargs)


def _copy_source_files(src: Path, out: Path) -> None:
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    templates = sorted(src.glob("*.jinja"))
    if templates:
        shutil.copyfile(templates[0], out / "chat_template.jinja")


def _build_tokenizer(src: Path, raw: dict[str, Any], out: Path) -> None:
    model_type = str(raw.get("model_type", ""))
    vocab = "qwen3_5" if model_type.startswith("qwen3_5") else "qwen3"
    tokenizer_config = src / "tokenizer_config.json"
    templates = sorted(src.glob("*.jinja"))
    build_qwen_tokenizer(
        out,
        tokenizer_config if tokenizer_config.is_file() else None,
        vocab=vocab,
        chat_template=templates[0] if templates else None,
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mllmd.testing.checkpoints",
        description="Build a small random-weight checkpoint from a real Qwen config (weights are random).",
    )
    parser.add_argument("--source", default="Qwen3-0.6B", help="name under shared/models, or a folder")
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
