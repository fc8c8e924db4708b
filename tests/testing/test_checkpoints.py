"""Random-weight test checkpoints: real configs, loadable by transformers, deterministic, well spread."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from mllmd.checkpoint.folder import scale_mrope
from mllmd.checkpoint.tokenizer import DATA_DIR
from mllmd.demo import DEMO_MODEL_NAME, ensure_demo_model
from mllmd.testing import checkpoints as ck

SOURCE = ck.find_model_source("Qwen3-0.6B")
VENDORED = ("Qwen3-0.6B", "Qwen3-8B", "Qwen3-VL-2B-Instruct", "Qwen3.5-0.8B", "Qwen3.5-2B", "Qwen3.5-4B",
            "Qwen3.5-9B", "RedHatAI-Qwen3.5-9B-quantized.w4a16")
PROMPTS = [
    [9707, 11, 1879, 0, 358, 2776, 264, 1273],  # "Hello, world! I'm a test"
    [104307, 3837, 99489, 1773],
    [151644, 872, 198, 3838, 374, 279, 6722, 30, 151645, 198, 151644, 77091, 198],
    [750, 282, 2075, 1648, 470, 856, 488, 220, 16],
]


def safetensors_keys(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


def load(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ck.build_tiny_checkpoint(tmp_path_factory.mktemp("tied"))


@pytest.fixture(scope="module")
def untied_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("untied")
    return ck.build_tiny_checkpoint(out, tie_word_embeddings=False, max_shard_size="10MB", seed=1)


def test_config_keeps_real_values_and_applies_overrides(tied: Path) -> None:
    real = json.loads((SOURCE / "config.json").read_text())
    config = AutoConfig.from_pretrained(tied)
    assert (config.vocab_size, config.bos_token_id, config.eos_token_id) == (151936, 151643, 151645)
    assert config.rms_norm_eps == real["rms_norm_eps"] == 1e-6
    assert config.rope_parameters["rope_theta"] == real["rope_theta"] == 1_000_000
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (2, 64, 128)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.max_window_layers == 2 and config.layer_types == ["full_attention"] * 2
    assert config.tie_word_embeddings is True  # Qwen3-0.6B ties them
    written = json.loads((tied / "config.json").read_text())
    assert written["rope_theta"] == 1_000_000 and written["torch_dtype"] == "float32"  # real file layout
    generation = json.loads((tied / "generation_config.json").read_text())
    assert generation == json.loads((SOURCE / "generation_config.json").read_text())


def test_marker_says_random(tied: Path) -> None:
    marker = json.loads((tied / ck.MARKER_NAME).read_text())
    assert marker["weights"] == "random"
    assert marker["params"]["source"] == "Qwen3-0.6B" and marker["params"]["hidden_size"] == 64


def test_tokenizer_is_included(tied: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tied)
    assert tok.eos_token_id == 151645 and tok.encode("<think>", add_special_tokens=False) == [151667]
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True
    )


def test_tied_checkpoint_has_no_separate_lm_head(tied: Path) -> None:
    tensors = safetensors_keys(tied)
    assert "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].shape == (151936, 64)
    model = load(tied)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_untied_checkpoint_is_sharded_with_a_distinct_lm_head(untied_sharded: Path) -> None:
    index = json.loads((untied_sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((untied_sharded / s).is_file() for s in shards)
    tensors = safetensors_keys(untied_sharded)
    assert set(index["weight_map"]) == set(tensors)
    lm_head, embed = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
    assert lm_head.shape == embed.shape and not torch.allclose(lm_head, embed)
    model = load(untied_sharded)
    assert model.config.tie_word_embeddings is False
    assert torch.equal(model.lm_head.weight, lm_head)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_same_arguments_give_identical_bytes(tied: Path, tmp_path: Path) -> None:
    again = ck.build_tiny_checkpoint(tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tied / name).read_bytes(), name
    other_seed = ck.build_tiny_checkpoint(tmp_path / "seed1", seed=1)
    assert (other_seed / "model.safetensors").read_bytes() != (tied / "model.safetensors").read_bytes()


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    ck.build_tiny_checkpoint(tmp_path)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("fixture", ["tied", "untied_sharded"])
def test_logits_are_well_spread_and_greedy_output_varies(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    model = load(request.getfixturevalue(fixture))
    gaps, generated = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=16,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=151643,
            )
            generated.append(out.sequences[0, len(prompt) :].tolist())
            for logits in out.logits:
                top = logits[0].topk(2).values
                gaps.append((top[0] - top[1]).item())
            assert logits[0].std() > 4  # Hugging Face's 0.02 init gives ~0.16
    gaps_t = torch.tensor(gaps)
    assert gaps_t.median() > 0.3 and gaps_t.min() > 1e-4  # 0.02 init: median ~0.02, ties ~1e-4
    for tokens in generated:
        assert len(set(tokens)) >= 8  # no collapse into repeating one token
    assert len({tokens[0] for tokens in generated}) == len(PROMPTS)


def test_context_changes_the_prediction(tied: Path) -> None:
    model = load(tied)
    generator = torch.Generator().manual_seed(0)
    prefixes = torch.randint(0, 150_000, (8, 6), generator=generator)
    batch = torch.cat([prefixes, torch.full((8, 1), 1234)], dim=1)  # same last token, 8 contexts
    with torch.no_grad():
        predictions = model(batch).logits[:, -1].argmax(-1)
    assert len(set(predictions.tolist())) >= 6


def test_bfloat16_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    argv = ["--out", str(out), "--layers", "3", "--hidden-size", "32", "--head-dim", "8", "--untied"]
    assert ck.main([*argv, "--dtype", "bfloat16", "--intermediate-size", "48"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (3, 32, 48)
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "bfloat16"
    tensors = safetensors_keys(out)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16} and "lm_head.weight" in tensors
    marker = json.loads((out / ck.MARKER_NAME).read_text())
    assert marker["params"]["tie_word_embeddings"] is False


def test_extra_overrides_are_merged(tmp_path: Path) -> None:
    out = ck.build_tiny_checkpoint(tmp_path, extra_overrides={"max_position_embeddings": 4096})
    assert AutoConfig.from_pretrained(out).max_position_embeddings == 4096


def test_quantized_sources_are_refused(tmp_path: Path) -> None:
    source = tmp_path / "quantized"
    source.mkdir()
    config = json.loads((SOURCE / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "x"}}))
    with pytest.raises(ValueError, match="quantized"):
        ck.build_tiny_checkpoint(tmp_path / "out", str(source))


def test_vendored_configs_are_used_without_shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLLMD_SHARED_MODELS", str(tmp_path / "no-shared"))
    for name in VENDORED:
        assert ck.find_model_source(name) == DATA_DIR / name
    with pytest.raises(FileNotFoundError, match="Qwen9-1B"):
        ck.find_model_source("Qwen9-1B")


def test_vendored_configs_are_the_upstream_files() -> None:
    """Every vendored file has the git blob id its README gives (the id the Hub shows for the upstream
    file), and equals the shared copy where shared/models is beside the repository."""
    rows = re.findall(r"^\| ([^|]+?) \| (\d+) \| `([0-9a-f]+)` \|", (DATA_DIR / "README.md").read_text(), re.M)
    assert len(rows) >= 27
    listed = set()
    for name, size, blob in rows:
        data = (DATA_DIR / name).read_bytes()
        assert len(data) == int(size), name
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest().startswith(blob), name
        listed.add(name)
        shared = ck.shared_models_dir() / name
        if shared.is_file():
            assert shared.read_bytes() == data, name
    on_disk = {str(p.relative_to(DATA_DIR)) for p in DATA_DIR.glob("*/*")}
    assert on_disk == listed


def test_mrope_sections_are_rescaled() -> None:
    rope = {"mrope_section": [24, 20, 20]}
    scale_mrope(rope, head_dim=16)
    assert sum(rope["mrope_section"]) == 8 and min(rope["mrope_section"]) > 0
    partial = {"mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25}
    scale_mrope(partial, head_dim=64)
    assert sum(partial["mrope_section"]) == 8


def test_qwen3_5_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    out = ck.build_tiny_checkpoint(tmp_path, "Qwen3.5-0.8B", num_hidden_layers=4, head_dim=32)
    text = AutoConfig.from_pretrained(out).text_config
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (text.vocab_size, text.eos_token_id) == (248320, 248044)
    keys = safetensors_keys(out)
    assert "model.language_model.layers.0.linear_attn.A_log" in keys
    assert any(key.startswith("model.visual.") for key in keys)
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert logits.shape == (248320,) and logits.std() > 4


def test_demo_model(tmp_path: Path) -> None:
    path = ensure_demo_model(tmp_path)
    assert path == tmp_path / DEMO_MODEL_NAME
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_MODEL_NAME]  # no staging folders left
    readme = (path / "README.md").read_text()
    assert "RANDOM WEIGHTS" in readme and "meaningless" in readme
    marker = json.loads((path / ck.MARKER_NAME).read_text())
    assert marker["weights"] == "random" and marker["params"]["dtype"] == "bfloat16"
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "qwen3" and config.vocab_size == 151936
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # cached, not rebuilt


def test_stale_demo_model_is_rebuilt(tmp_path: Path) -> None:
    stale = tmp_path / DEMO_MODEL_NAME
    stale.mkdir()
    (stale / ck.MARKER_NAME).write_text(json.dumps({"weights": "random", "params": {"hidden_size": 1}}))
    path = ensure_demo_model(tmp_path)
    assert json.loads((path / ck.MARKER_NAME).read_text())["params"]["hidden_size"] == 128
    assert (path / "README.md").is_file()


def test_qwen3_vl_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    out = ck.build_tiny_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct")
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["rope_scaling"]["mrope_section"] == [3, 3, 2]  # sums to head_dim / 2
    assert config["vision_config"]["out_hidden_size"] == 64
    assert config["vision_config"]["deepstack_visual_indexes"] == [0, 1]
    assert (out / "preprocessor_config.json").is_file() and (out / "chat_template.jinja").is_file()
    keys = safetensors_keys(out)
    assert "model.language_model.layers.1.self_attn.q_norm.weight" in keys
    assert "model.visual.deepstack_merger_list.1.linear_fc2.weight" in keys
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert logits.shape == (151936,) and logits.std() > 4


@pytest.mark.parametrize(("layers", "expected"), [
    (1, ["full_attention"]),
    (2, ["linear_attention", "full_attention"]),
    (4, ["linear_attention"] * 3 + ["full_attention"]),
    (5, ["linear_attention"] * 3 + ["full_attention", "linear_attention"]),
])
def test_fewer_hybrid_layers_than_the_pattern_keep_a_full_attention_layer(
    layers: int, expected: list[str]
) -> None:
    """Qwen3.5's pattern is 3 linear + 1 full: a 2-layer build (the CLI default) once had no full
    attention layer, a checkpoint the engine refuses to load."""
    raw = json.loads((ck.find_model_source("Qwen3.5-0.8B") / "config.json").read_text())
    params = {"num_hidden_layers": layers, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "tie_word_embeddings": None, "dtype": "float32", "extra_overrides": {}}
    assert ck.tiny_config(raw, params)["text_config"]["layer_types"] == expected
