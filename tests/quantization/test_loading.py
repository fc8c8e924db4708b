"""Loading quantized checkpoints: ModelInfo, honest weight bytes, refusals at load, bench_one_batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mllmd import LLM
from mllmd.models.layers import Linear
from mllmd.models.quantization import UnsupportedQuantization
from mllmd.testing.quantize import quantize_checkpoint

_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "I32": 4, "I64": 8, "F8_E4M3": 1}


def checkpoint_bytes(model_dir: Path, skip_suffix: tuple[str, ...] = ()) -> int:
    """Bytes of the tensors stored in the checkpoint's safetensors files."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not name.endswith(skip_suffix):
                    t = f.get_slice(name)
                    total += int(torch.tensor(t.get_shape()).prod()) * _DTYPE_BYTES[t.get_dtype()]
    return total


def decoder_linear_bytes(llm: LLM) -> int:
    model = llm.engine.runner.model
    return sum(
        p.numel() * p.element_size()
        for name, m in model.named_modules()
        if isinstance(m, Linear) and name != "lm_head"
        for p in m.parameters(recurse=False)
    )


def variant_copy(src: Path, dst: Path, edit: Any) -> Path:
    """`src` with its weights linked and its quantization_config changed by `edit(qc)`."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("variant", ["w8a8", "w4a16_g128"])
def test_model_info_reports_scheme_and_stored_weight_bytes(quantized: Any, tiny_bases: dict[str, Path], variant: str) -> None:
    model_dir = quantized(variant)
    # two engines live at once: each gets a small KV pool (the default on a GPU is most of its memory)
    llm = LLM(str(model_dir), dtype="float32", max_total_tokens=4096)
    info = llm.engine.info
    assert info.quantization == ("w8a8" if variant == "w8a8" else "w4a16")
    # exactly what the checkpoint stores, less W4A16's weight_shape (checked at load, not kept);
    # the CPU W4A16 kernel's dequantized copy is not counted
    assert info.weight_bytes == checkpoint_bytes(model_dir, skip_suffix=(".weight_shape",))
    dense = LLM(str(tiny_bases["untied"]), dtype="float32", max_total_tokens=4096)
    assert dense.engine.info.quantization is None
    assert dense.engine.info.weight_bytes == checkpoint_bytes(tiny_bases["untied"])
    # decoder linears: int8 + a float32 scale per row ~ 1/4; int4 + float32 scale per 128 ~ 1/7.5
    ratio = decoder_linear_bytes(llm) / decoder_linear_bytes(dense)
    assert ratio < (0.26 if variant == "w8a8" else 0.14), ratio
    assert info.weight_bytes < dense.engine.info.weight_bytes


def test_lm_head_and_norms_stay_full_precision(quantized: Any) -> None:
    model = LLM(str(quantized("w8a8")), dtype="float32").engine.runner.model
    assert model.lm_head is not None and model.lm_head.quant_method is None
    assert model.lm_head.weight.dtype == torch.float32
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.int8
    assert layer.self_attn.qkv_proj.weight_scale.shape == (layer.self_attn.qkv_proj.out_features, 1)
    assert layer.input_layernorm.weight.dtype == torch.float32


def test_fp8_checkpoint_is_refused_by_name(tmp_path: Path, tiny_bases: dict[str, Path]) -> None:
    fp8 = quantize_checkpoint(tiny_bases["tied"], tmp_path / "fp8", "FP8_DYNAMIC")
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"]["format"] == "float-quantized"
    with pytest.raises(UnsupportedQuantization, match="'float-quantized'.*float8"):
        LLM(str(fp8), dtype="float32")


def test_quantized_lm_head_loads_quantized(quantized: Any) -> None:
    """A checkpoint made without ignore=["lm_head"]: the lm_head is a quantized layer of that scheme
    (int4 words + scales), not a float weight."""
    model = LLM(str(quantized("w4a16_g128_lm_head")), dtype="float32").engine.runner.model
    assert model.lm_head is not None and model.lm_head.quant_method is not None
    assert model.lm_head.weight_packed.dtype == torch.int32 and "weight" not in dict(model.lm_head.named_parameters())


def test_quantized_tied_lm_head_is_refused(quantized: Any, tmp_path: Path) -> None:
    """A quantized lm_head tied to the embeddings (one tensor, two layouts) is refused by name."""

    folder = variant_copy(quantized("w8a8"), tmp_path / "lm_head", lambda qc: qc.update(ignore=[]))
    raw = json.loads((folder / "config.json").read_text())
    raw["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedQuantization, match="lm_head tied to the embeddings"):
        LLM(str(folder), dtype="float32")


def test_tensors_that_do_not_fit_the_config_name_the_tensor(quantized: Any, tmp_path: Path) -> None:
    def group64(qc: dict) -> None:
        qc["config_groups"]["group_0"]["weights"]["group_size"] = 64

    folder = variant_copy(quantized("w4a16_g128"), tmp_path / "g64", group64)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.\w+\.\w+_proj\.weight_scale.*shape"):
        LLM(str(folder), dtype="float32")


@pytest.mark.parametrize(("variant", "tensor"), [("w4a16_g128", "weight_packed"), ("w8a8", "weight")])
def test_quantized_integers_stored_as_floats_are_refused(quantized: Any, tmp_path: Path, variant: str, tensor: str) -> None:
    """Packed int4 words or int8 weights saved as floats (a bad conversion script) would be rounded
    into other numbers when copied into the integer parameters: the load names the tensor instead."""
    from safetensors.torch import load_file, save_file

    src = quantized(variant)
    dst = tmp_path / "floats"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).symlink_to(f)
    for f in src.glob("*.safetensors"):
        tensors = load_file(str(f))
        name = f"model.layers.0.mlp.down_proj.{tensor}"
        if name in tensors:
            tensors[name] = tensors[name].double()
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"down_proj\.{tensor}.*torch\.float64, expected integers"):
        LLM(str(dst), dtype="float32")


def test_bench_one_batch_runs_and_reports_stored_weight_bytes(quantized: Any, tmp_path: Path) -> None:
    from mllmd.bench import one_batch

    model_dir = quantized("w4a16_g128")
    out = tmp_path / "result.jsonl"
    one_batch.main(
        ["--model-path", str(model_dir), "--batch-size", "2", "--input-len", "8", "--output-len", "3",
         "--device", "cpu", "--dtype", "float32", "--warmup", "0", "--result-filename", str(out)]
    )
    line = json.loads(out.read_text().splitlines()[-1])
    assert line["weight_bytes"] == checkpoint_bytes(model_dir, skip_suffix=(".weight_shape",))
    assert line["median_decode_latency"] > 0


@pytest.mark.parametrize("variant", ["w8a8", "w4a16_g32_asym"])
def test_bfloat16_compute_runs_close_to_float32(quantized: Any, variant: str) -> None:
    """The same checkpoint computed in bfloat16 (the GPU dtype): close to float32, not equal."""
    from mllmd import SamplingParams

    model_dir = quantized(variant)
    ids = list(range(1000, 1040))
    logits = []
    for dtype in ("float32", "bfloat16"):
        engine = LLM(str(model_dir), dtype=dtype, chunked_prefill_size=0, max_total_tokens=4096).engine
        engine.add_request("r", ids, SamplingParams(max_tokens=1, temperature=0.0))
        batch = engine.runner.prepare(engine.scheduler.schedule())
        batch.logits_indices = torch.arange(batch.num_tokens)
        logits.append(engine.runner.forward(batch))
    f32, bf16 = logits
    assert bf16.isfinite().all()
    assert float((bf16 - f32).norm() / f32.norm()) < 0.1


def test_bf16_scales_load_as_stored(quantized: Any) -> None:
    """A W4A16 checkpoint whose scales are bf16 (as llmcompressor writes a bf16 model's) loads with
    every scale's value as stored; the checkpoint really holds bf16 scales."""
    from safetensors import safe_open

    model_dir = quantized("w4a16_g128_bf16_scales")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        stored = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
    assert stored.dtype == torch.bfloat16
    model = LLM(str(model_dir), dtype="float32", device="cpu").engine.runner.model
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight_scale.float(), stored.float())
