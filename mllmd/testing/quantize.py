"""Quantize a float checkpoint with compressed-tensors itself (what llmcompressor's data-free
`oneshot(recipe=QuantizationModifier(scheme=..., targets="Linear", ignore=["lm_head"]))` writes).

    python -m mllmd.testing.quantize --base DIR --out DIR --scheme W4A16 [--device cuda]

Attach the preset scheme (`apply_quantization_config`), compute each weight's scale and zero point
from its min/max per channel or per group (llmcompressor's default "memoryless_minmax" weight
observer) with `calculate_qparams`, then `ModelCompressor` compresses (int8 / packed int4) and
writes the `quantization_config`. Needs the test-only dependency compressed-tensors. Used by the
tests (tiny checkpoints) and by the GPU benchmarks (Qwen3-8B shapes, `--device cuda`).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

_SKIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


def quantize_checkpoint(
    base: Path, out: Path, preset: str, weight_overrides: dict[str, Any] | None = None,
    ignore: tuple[str, ...] = ("lm_head",), device: str = "cpu", scale_dtype: str = "model",
) -> Path:
    """Quantize the float checkpoint `base` with compressed-tensors and save it compressed in `out`.

    The scales are computed in float32 from the stored weights, on `device`, then stored (and used to
    quantize) in `scale_dtype`: "model" (default) is the base checkpoint's own dtype, as
    compressed-tensors (llmcompressor) keeps a bf16 model's scales in bf16; "float32" keeps them."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    from mllmd.testing.checkpoints import hf_model_class

    config = json.loads((Path(base) / "config.json").read_text(encoding="utf-8"))
    model = hf_model_class(config).from_pretrained(base, dtype=torch.float32).to(device)
    if scale_dtype == "model":
        stored = _stored_dtype(base)
    else:
        stored = getattr(torch, scale_dtype, None)
        if not isinstance(stored, torch.dtype) or not stored.is_floating_point:
            raise ValueError(f"scale_dtype must be 'model' or a float dtype name, not {scale_dtype!r}")
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if weight_overrides:
        scheme.weights = scheme.weights.model_copy(update=weight_overrides)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            w = module.weight
            observed = w.unflatten(-1, (-1, args.group_size)) if args.strategy == "group" else w.unsqueeze(-2)
            scale, zero_point = calculate_qparams(observed.amin(-1), observed.amax(-1), args)  # [N, G]
            module.weight_scale.data = scale.to(stored)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point)
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.to("cpu").save_pretrained(out)
    compressor.update_config(str(out))
    copy_tokenizer_files(base, out)
    return out


def decompressed_reference(model_dir: Path) -> Any:
    """transformers' model of a compressed-tensors checkpoint, its tensors decompressed by
    compressed-tensors, float32, in eval mode: the reference the quantized engine is compared with."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from mllmd.testing.checkpoints import hf_model_class

    config = AutoConfig.from_pretrained(model_dir)
    raw = config.quantization_config
    qconfig = QuantizationConfig.model_validate(raw if isinstance(raw, dict) else raw.to_dict())
    del config.quantization_config
    model = hf_model_class(config.to_dict()).from_config(config, dtype=torch.float32)
    apply_quantization_config(model, qconfig)  # schemes + quantized forward on the targeted Linears
    compressor = ModelCompressor(quantization_config=qconfig)
    compressor.compress_model(model)  # the compressed parameter layout (weight_packed, ...)
    state: dict[str, Any] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(f))
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
    compressor.decompress_model(model)
    return model.eval()


def redhat_qwen3_5_ignore(config: dict[str, Any]) -> list[str]:
    """RedHatAI's Qwen3.5 W4A16 recipe (RedHatAI/Qwen3.5-9B-quantized.w4a16's `ignore` list) for a
    model of `config`'s layers and tower depth: the lm_head, the MTP head, the vision tower and the
    Gated DeltaNet layers' projections stay in the float dtype."""
    text, vision = config["text_config"], config["vision_config"]
    names = ["lm_head", "re:^mtp.*", "model.visual.merger.linear_fc1", "model.visual.merger.linear_fc2"]
    for i, kind in enumerate(text["layer_types"]):
        if kind == "linear_attention":
            names += [f"model.language_model.layers.{i}.linear_attn.{p}"
                      for p in ("out_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
    for b in range(vision["depth"]):
        names += [f"model.visual.blocks.{b}.{p}" for p in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    return names


def _stored_dtype(base: Path) -> Any:
    """The float dtype of the base checkpoint's weights, from its config (float32 if it names none)."""
    import torch
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(base)
    name = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "float32"
    dtype = name if isinstance(name, torch.dtype) else getattr(torch, str(name).replace("torch.", ""))
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def copy_tokenizer_files(base: Path, out: Path) -> None:
    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _SKIPPED_FILES:
            shutil.copy(f, out / f.name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scheme", required=True, help="compressed-tensors preset, e.g. W8A8, W4A16, W4A16_ASYM")
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scale-dtype", default="model",
                    help="dtype of the stored scales: 'model' (the base checkpoint's, as llmcompressor does) or e.g. float32")
    ap.add_argument("--ignore", choices=["lm_head", "redhat-qwen3.5"], default="lm_head",
                    help="layers left unquantized: the lm_head, or RedHatAI's Qwen3.5 recipe (redhat_qwen3_5_ignore)")
    args = ap.parse_args(argv)
    overrides = {"group_size": args.group_size} if args.group_size else None
    ignore: tuple[str, ...] = ("lm_head",)
    if args.ignore == "redhat-qwen3.5":
        ignore = tuple(redhat_qwen3_5_ignore(json.loads((Path(args.base) / "config.json").read_text(encoding="utf-8"))))
    print(quantize_checkpoint(Path(args.base), Path(args.out), args.scheme, overrides, ignore=ignore,
                              device=args.device, scale_dtype=args.scale_dtype))


if __name__ == "__main__":
    main()
