"""A model type the installed transformers cannot read is refused with the release it needs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import transformers

import mllmd.models as models
from mllmd.testing import checkpoints as ck


def _config_only(tmp_path: Path, source: str) -> Path:
    shutil.copyfile(ck.find_model_source(source) / "config.json", tmp_path / "config.json")
    return tmp_path


@pytest.mark.parametrize(("source", "model_type"), [("Qwen3.5-0.8B", "qwen3_5"), ("Qwen3-VL-2B-Instruct", "qwen3_vl")])
def test_an_unknown_model_type_names_the_transformers_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, model_type: str
) -> None:
    path = _config_only(tmp_path, source)
    assert models.load_hf_config(path).model_type == model_type  # the installed transformers reads it
    monkeypatch.setattr(models, "_known_model_types", lambda: {"qwen3"})  # as an older release would
    need = models.MIN_TRANSFORMERS[model_type]
    with pytest.raises(ValueError, match=rf"model type '{model_type}' needs transformers >= {need}; installed: "
                                         rf"{transformers.__version__}"):
        models.load_hf_config(path)


def test_the_engine_reports_it_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mllmd import LLM

    path = _config_only(tmp_path, "Qwen3.5-0.8B")
    monkeypatch.setattr(models, "_known_model_types", lambda: {"qwen3"})
    with pytest.raises(ValueError, match="needs transformers >= 5.2"):
        LLM(str(path), device="cpu")


def test_a_folder_without_config_is_left_to_transformers(tmp_path: Path) -> None:
    with pytest.raises((OSError, ValueError), match=str(tmp_path)):  # transformers' own words, naming the folder
        models.load_hf_config(tmp_path)
