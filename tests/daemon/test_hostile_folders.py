"""Model folders as hostile input: what the main process refuses before any worker allocates or reads.

Before: config.json sizes went unchecked to the scheduler worker, which asked the allocator for them
(vocab_size 10^9: 256 GB, max_position_embeddings 10^12: 8 TB of request table); a config.json holding
a list, a string size or a safetensors header entry of the wrong type raised TypeError or
AttributeError in the main process: /admin/models/load answered 500 and /admin/models (every folder's
listing) 500 too."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from mllmd.checkpoint.folder import find_model_source
from mllmd.daemon.models import ModelError, check_loadable, check_tokenizer, find_models, inspect_model

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 16, "hidden_size": 8,
          "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 4, "max_position_embeddings": 128, "torch_dtype": "float32"}  # fmt: skip
GOOD_ENTRY = {"dtype": "F32", "shape": [16, 8], "data_offsets": [0, 512]}


def _safetensors(path: Path, header: Any, data: bytes = b"\0" * 512) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _folder(root: Path, config: Any = None, entry: Any = None, config_text: str | None = None) -> Path:
    root.mkdir()
    text = config_text if config_text is not None else json.dumps(CONFIG if config is None else config)
    (root / "config.json").write_text(text)
    _safetensors(root / "model.safetensors", {"model.embed_tokens.weight": GOOD_ENTRY if entry is None else entry})
    return root


def test_a_plain_folder_passes(tmp_path: Path) -> None:
    facts = inspect_model(_folder(tmp_path / "m"))
    check_loadable(facts, budget_bytes=1 << 30, max_running_requests=64)
    assert facts.weight_bytes == 512 and facts.context_length == 128


@pytest.mark.parametrize(("key", "value"), [
    ("vocab_size", 10**9), ("hidden_size", 10**6), ("num_hidden_layers", 10**5),
    ("max_position_embeddings", 10**12), ("vocab_size", -5), ("num_attention_heads", 0),
    ("hidden_size", 64.5), ("num_hidden_layers", "2"), ("intermediate_size", True),
])  # fmt: skip
def test_config_sizes_are_bounded_integers(tmp_path: Path, key: str, value: Any) -> None:
    with pytest.raises(ModelError, match=f"'{key}' must be an integer from 1 to"):
        inspect_model(_folder(tmp_path / "m", CONFIG | {key: value}))


def test_nested_sections_are_checked(tmp_path: Path) -> None:
    nested = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": CONFIG | {"vocab_size": 10**10}}
    with pytest.raises(ModelError, match="'text_config.vocab_size'"):
        inspect_model(_folder(tmp_path / "a", nested))
    with pytest.raises(ModelError, match="'vision_config.depth'"):
        inspect_model(_folder(tmp_path / "b", CONFIG | {"vision_config": {"depth": 10**6}}))
    with pytest.raises(ModelError, match="'quantization_config' must be an object"):
        inspect_model(_folder(tmp_path / "c", CONFIG | {"quantization_config": "w4a16"}))


def test_sizes_within_bounds_that_need_more_memory_than_there_is_are_refused(tmp_path: Path) -> None:
    """2M x 64K embeddings (256 GiB) with a 512-byte weights file: counted from config.json, refused
    before the scheduler worker allocates them."""
    facts = inspect_model(_folder(tmp_path / "m", CONFIG | {"vocab_size": 1 << 21, "hidden_size": 1 << 16}))
    with pytest.raises(ModelError, match="as config.json sizes them"):
        check_loadable(facts, budget_bytes=8 << 30)


def test_the_request_table_counts(tmp_path: Path) -> None:
    """64 request rows of a 16M-token context are 8 GiB of int64 indices, allocated at load."""
    facts = inspect_model(_folder(tmp_path / "m", CONFIG | {"max_position_embeddings": 1 << 24}))
    check_loadable(facts, budget_bytes=4 << 30, max_running_requests=1)
    with pytest.raises(ModelError, match="request table of 8.0 GiB"):
        check_loadable(facts, budget_bytes=4 << 30, max_running_requests=64)


@pytest.mark.parametrize(("text", "needle"), [
    ("[1, 2]", "must hold a JSON object"), ('"x"', "must hold a JSON object"), ("hello", "not valid JSON"),
    ('{"vocab_size": 1', "not valid JSON"), ("\udcff", "not valid JSON"),
])  # fmt: skip
def test_config_json_that_is_not_an_object_is_named(tmp_path: Path, text: str, needle: str) -> None:
    root = _folder(tmp_path / "m")
    (root / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ModelError, match=needle):
        inspect_model(root)


def test_a_huge_config_json_is_not_read_whole(tmp_path: Path) -> None:
    root = _folder(tmp_path / "m", config_text=json.dumps(CONFIG | {"pad": "x" * (2 << 20)}))
    with pytest.raises(ModelError, match="larger than"):
        inspect_model(root)


@pytest.mark.parametrize(("entry", "needle"), [
    ("x", "entry is not an object"),
    (GOOD_ENTRY | {"dtype": "Q17"}, "unsupported dtype 'Q17'"),
    (GOOD_ENTRY | {"shape": "x"}, "shape must be a list"),
    (GOOD_ENTRY | {"shape": [-1, -4]}, "shape must be a list"),
    (GOOD_ENTRY | {"data_offsets": "ab"}, "data_offsets must be"),
    (GOOD_ENTRY | {"data_offsets": [10, 5]}, "data_offsets must be"),
    (GOOD_ENTRY | {"data_offsets": [0, 10**15]}, "lies past its end"),
    (GOOD_ENTRY | {"shape": [16, 9]}, "does not match its 512 bytes"),
])  # fmt: skip
def test_safetensors_header_entries_are_checked(tmp_path: Path, entry: Any, needle: str) -> None:
    with pytest.raises(ModelError, match=needle):
        inspect_model(_folder(tmp_path / "m", entry=entry))


def test_a_header_claiming_a_huge_length_is_named(tmp_path: Path) -> None:
    root = _folder(tmp_path / "m")
    raw = (root / "model.safetensors").read_bytes()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 62) + raw[8:])
    with pytest.raises(ModelError, match="header length"):
        inspect_model(root)


@pytest.mark.parametrize("index", [{"weight_map": ["a"]}, {"weight_map": {"w": "../elsewhere.safetensors"}}, []])
def test_a_bad_index_is_named(tmp_path: Path, index: Any) -> None:
    root = _folder(tmp_path / "m")
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match="model.safetensors.index.json"):
        inspect_model(root)


def test_one_bad_folder_does_not_break_the_listing(tmp_path: Path) -> None:
    _folder(tmp_path / "good")
    _folder(tmp_path / "list", config_text="[1]")
    _folder(tmp_path / "shape", entry=GOOD_ENTRY | {"shape": "x"})
    rows = {r["name"]: r for r in find_models([str(tmp_path)])}
    assert "must hold a JSON object" in rows["list"]["error"]
    assert "shape must be a list" in rows["shape"]["error"]
    assert rows["good"]["architecture"] == "Qwen3ForCausalLM"


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer.json", "model.safetensors", "config.json"])
def test_a_file_linked_outside_the_models_dirs_is_refused(tmp_path: Path, name: str) -> None:
    """Before: a folder inside model.models_dir whose generation_config.json linked to /etc/passwd had
    it read by the scheduler worker; a tokenizer.json or weights linked elsewhere loaded from there."""
    models, outside = tmp_path / "models", tmp_path / "outside"
    models.mkdir()
    root = _folder(models / "m")
    _folder(outside)
    (outside / "tokenizer.json").write_text("{}")
    (outside / "generation_config.json").write_text("{}")
    (root / name).unlink(missing_ok=True)
    (root / name).symlink_to(outside / name)
    with pytest.raises(ModelError, match=f"{name} is a link to .*outside the model folder and model.models_dir"):
        inspect_model(root, [str(models)])
    with pytest.raises(ModelError, match=f"{name} is a link to"):
        check_tokenizer(root, [str(models)])
    assert "is a link to" in find_models([str(models)])[0]["error"]


def test_links_inside_the_models_dirs_are_fine(tmp_path: Path) -> None:
    """A Hugging Face cache laid out in a models dir: snapshot files link to ../../blobs."""
    models = tmp_path / "models"
    blobs, snap = models / "hub" / "blobs", models / "hub" / "snapshots"
    blobs.mkdir(parents=True)
    snap.mkdir()
    (blobs / "cfg").write_text(json.dumps(CONFIG))
    root = _folder(snap / "abc")
    (root / "config.json").unlink()
    (root / "config.json").symlink_to("../../blobs/cfg")
    assert inspect_model(root, [str(models)]).architecture == "Qwen3ForCausalLM"
    with pytest.raises(ModelError, match="config.json is a link to"):
        inspect_model(root)  # no models dir given: only the folder itself
    (root / "loop").symlink_to(root / "loop")
    with pytest.raises(ModelError, match="loop is a broken or looping link"):
        inspect_model(root, [str(models)])


def test_recurrent_state_slots_count(tmp_path: Path) -> None:
    """Qwen3.5's per-request state (48 MiB a slot at the 9B's shapes) is counted before load: the slots
    `cache.state_slots` asks for, one when it is left to the memory plan."""
    real = json.loads((find_model_source("Qwen3.5-9B") / "config.json").read_text())["text_config"]
    linear = {k: real[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                   "linear_value_head_dim", "linear_conv_kernel_dim")}  # fmt: skip
    hybrid = CONFIG | linear | {"num_hidden_layers": 32, "layer_types": real["layer_types"], "torch_dtype": "bfloat16"}
    facts = inspect_model(_folder(tmp_path / "m", {"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                   "text_config": hybrid}))  # fmt: skip
    assert facts.state_bytes_per_slot == 24 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4)  # 49.1 MiB
    assert inspect_model(_folder(tmp_path / "dense")).state_bytes_per_slot == 0
    check_loadable(facts, budget_bytes=1 << 30, state_slots=20)
    with pytest.raises(ModelError, match="30 recurrent-state slots of 49 MiB"):
        check_loadable(facts, budget_bytes=1 << 30, state_slots=30)
    check_loadable(facts, budget_bytes=64 << 20)  # left to the plan: one slot
    with pytest.raises(ModelError, match="1 recurrent-state slot of 49 MiB"):
        check_loadable(facts, budget_bytes=40 << 20)
