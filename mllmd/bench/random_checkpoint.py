"""Full-size random-weight checkpoints for benchmarks, generated on the GPU in seconds.

    python -m mllmd.bench.random_checkpoint --source Qwen3-8B --out /dev/shm/qwen3-8b --dtype bfloat16

Same folder layout as `mllmd.testing.checkpoints.build_tiny_checkpoint` (config.json, sharded
safetensors with an index, generation config, the real Qwen tokenizer, a `random weights` marker), at
the source's real shapes. The parameter names and shapes come from the transformers model built on
the meta device; values follow the tiny builder's scales (embeddings std 1, linear weights std
1.5 / sqrt(fan_in), norm weights 1 + N(0, 0.1)). Only for timing and for numerics tests that compare
two implementations on the same weights: the weights are noise.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from mllmd.checkpoint import folder
from mllmd.checkpoint.random_weights import hf_model_classes_available, qwen3_weight_layout
from mllmd.testing import checkpoints as ck

SHARD_BYTES = 4 << 30


def _meta_model(config_dict: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    cfg = dict(config_dict)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        return ck.hf_model_class(config_dict).from_config(config)


def parameter_shapes(config_dict: dict[str, Any]) -> list[tuple[str, torch.Size]]:
    """(name, shape) of every parameter, in transformers' order: from its model on the meta device, or,
    for Qwen3 where transformers has no model classes (below torch 2.6: Jetson's), `qwen3_weight_layout`."""
    if config_dict.get("model_type") == "qwen3" and not hf_model_classes_available():
        return [(name, torch.Size(shape)) for name, shape, _ in qwen3_weight_layout(config_dict)]
    return [(name, p.shape) for name, p in _meta_model(config_dict).named_parameters()]


def _random_tensor(
    name: str, shape: torch.Size, dtype: torch.dtype, gen: torch.Generator, device: str, gain: float
) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)).to(dtype)
    if "embed_tokens" in name or name.startswith("lm_head"):
        return torch.randn(shape, generator=gen, device=device).to(dtype)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    std = gain / math.sqrt(shape[-1])
    return (torch.randn(shape, generator=gen, device=device) * std).to(dtype)


def build_random_checkpoint(
    out_dir: str | Path, source: str = "Qwen3-8B", *, dtype: str = "bfloat16", seed: int = 0,
    device: str = "cuda", overrides: dict[str, Any] | None = None, linear_gain: float = 1.5,
) -> Path:
    """Write a random checkpoint of `source`'s real shapes (optionally with config `overrides`).

    `linear_gain`: linear weights have std gain / sqrt(fan_in). At 1.5 each sub-layer grows the
    residual stream and a deep model becomes chaotic (one bf16 rounding changes the logits by a few
    percent, as in transformers' own bf16 run); about 0.5 gives a well-conditioned model, as trained
    models are, for comparing bf16 numerics against fp32."""
    src = ck.find_model_source(source)
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    config = dict(raw)
    config.update(overrides or {})
    config["torch_dtype"] = config["dtype"] = dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    tdtype = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    tied = bool(config.get("tie_word_embeddings", False))
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    weight_map: dict[str, str] = {}
    files: list[tuple[str, dict[str, torch.Tensor]]] = []

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            files.append((f"part-{len(files):05d}", shard))
            shard, shard_bytes = {}, 0

    for name, shape in parameter_shapes(config):
        if tied and name == "lm_head.weight":
            continue
        t = _random_tensor(name, shape, tdtype, gen, device, linear_gain).cpu()
        shard[name] = t
        shard_bytes += t.numel() * t.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    total = len(files)
    size = 0
    for i, (_, tensors) in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = fname
            size += t.numel() * t.element_size()
    folder.write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": size}, "weight_map": weight_map})
    folder.write_json(out / "config.json", config)
    folder.copy_source_files(src, out)
    folder.build_tokenizer(src, raw, out)
    folder.write_json(
        out / ck.MARKER_NAME,
        {"weights": "random", "builder": "mllmd.bench.random_checkpoint", "params": {"source": str(source), "seed": seed, "linear_gain": linear_gain}},
    )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="Qwen3-8B")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    print(build_random_checkpoint(args.out, args.source, dtype=args.dtype, seed=args.seed, device=args.device))


if __name__ == "__main__":
    main()
