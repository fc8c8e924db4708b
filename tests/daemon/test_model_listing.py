"""`mllmctl models`: what the daemon reads from a model folder, and the table it prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mllmd.ctl import render_models
from mllmd.daemon.models import inspect_model


def _folder(root: Path, config: dict, dtype: torch.dtype) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 8, dtype=dtype)}, str(root / "model.safetensors"))
    return root


@pytest.mark.parametrize(("config", "dtype", "expected"), [
    ({"architectures": ["Qwen3ForCausalLM"], "torch_dtype": "bfloat16"}, torch.bfloat16, "bfloat16"),
    # Qwen3.5 / Qwen3-VL: the dtype lives in text_config only.
    ({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"dtype": "float32"}},
     torch.float32, "float32"),
    # No dtype in the config: the weights' own, under torch's name (not safetensors' "F16").
    ({"architectures": ["Qwen3ForCausalLM"]}, torch.float16, "float16"),
    ({"architectures": ["Qwen3ForCausalLM"]}, torch.bfloat16, "bfloat16"),
])
def test_the_dtype_is_named_as_torch_names_it(tmp_path: Path, config: dict, dtype: torch.dtype, expected: str) -> None:
    assert inspect_model(_folder(tmp_path / "m", config, dtype)).dtype == expected


def test_the_table_stays_aligned_with_long_names() -> None:
    rows = [
        {"name": "tiny-q3", "architecture": "Qwen3ForCausalLM", "parameters": 1.0e7, "dtype": "float32",
         "quantization": None, "size_bytes": 55 << 20},
        {"name": "a-model-with-a-rather-long-folder-name", "architecture": "Qwen3_5ForConditionalGeneration",
         "parameters": 9.0e9, "dtype": "bfloat16", "quantization": "w4a16", "size_bytes": 6 << 30},
    ]
    lines = render_models({"models": rows}).splitlines()
    assert len(lines) == 3
    header = lines[0]
    for column in ("ARCHITECTURE", "DTYPE", "QUANT"):  # left-aligned: every row's cell starts under its title
        start = header.index(column)
        for line, row in zip(lines[1:], rows):
            cell = {"ARCHITECTURE": row["architecture"], "DTYPE": row["dtype"],
                    "QUANT": row["quantization"] or "-"}[column]
            assert line[start:start + len(cell)] == cell, (column, lines)
    ends = {len(line) for line in lines}  # SIZE is right-aligned and last
    assert len(ends) == 1, lines


def test_folders_that_cannot_load_say_why(tmp_path: Path) -> None:
    """A folder with an architecture mllmd does not serve, or without a tokenizer, is listed with what
    could be read and the reason it cannot load (the table printed `? ? ?` and no reason before)."""
    from mllmd.daemon.models import find_models

    _folder(tmp_path / "llama", {"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}, torch.bfloat16)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{not json")
    rows = {r["name"]: r for r in find_models([str(tmp_path)])}
    assert set(rows) == {"llama", "empty"}
    assert rows["llama"]["architecture"] == "LlamaForCausalLM" and rows["llama"]["dtype"] == "bfloat16"
    assert "unsupported architecture 'LlamaForCausalLM'" in rows["llama"]["error"], rows["llama"]
    assert "config.json" in rows["empty"]["error"]
    text = render_models({"models": list(rows.values())})
    assert "?" not in text
    tail = text.split("not loadable:")[1]
    assert "llama: unsupported architecture" in tail and "empty:" in tail and "config.json" in tail
