"""Qwen3.5 and Qwen3-VL on CUDA: greedy tokens equal transformers' (fp32, on the GPU) through the Triton
Gated DeltaNet kernels at Qwen3.5's real DeltaNet head dims (Dk = Dv = 128, value heads twice the key
heads), with decode CUDA graphs on and off, chunked prefill in a mixed batch, a prefix hit from a
snapshot, and an image prompt. Skipped without CUDA."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mllmd import LLM, SamplingParams
from mllmd.testing import checkpoints as ck

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(900),
]

NEW = 32
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers (3 DeltaNet + 1 gated attention) at the 0.8B config's DeltaNet head dims, long-memory
    decays (a lost state shows)."""
    out = ck.build_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_5_gpu"), "Qwen3.5-0.8B", num_hidden_layers=4,
                                   hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=128, seed=7)  # fmt: skip
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert text["linear_key_head_dim"] == 128 and text["linear_num_value_heads"] == 2 * text["linear_num_key_heads"]
    ck.redraw_decays(out, seed=12)
    return out


@pytest.fixture(scope="module")
def hf(hybrid: Path) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(hybrid, dtype=torch.float32).cuda().eval()


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 150000, (n,), generator=g).tolist()


def hf_greedy(model: Any, ids: list[int], **extra: Any) -> list[int]:
    with torch.inference_mode():
        x = torch.tensor([ids], device="cuda")
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, **extra)  # fmt: skip
    return out[0, len(ids):].tolist()


PROMPTS = [prompt(1, 230), prompt(2, 17), prompt(3, 130), prompt(4, 1)]


@pytest.fixture(scope="module")
def wants(hf: Any) -> list[list[int]]:
    return [hf_greedy(hf, p) for p in PROMPTS]


def _llm(path: Path, **kw: Any) -> LLM:
    kw.setdefault("max_decode_stall_ms", 0)  # scheduling that follows measured step times: off (runs compared)
    return LLM(str(path), device="cuda", dtype="float32", max_total_tokens=4096, max_running_requests=8, **kw)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda_graph", "eager"])
def test_qwen3_5_greedy_equals_transformers(hybrid: Path, wants: list[list[int]], graphs: bool) -> None:
    llm = _llm(hybrid, disable_cuda_graph=not graphs, chunked_prefill_size=64)
    assert (llm.engine.runner.graph_runner is not None) == graphs
    assert (llm.engine.runner.prefill_graphs is not None) == graphs  # prefill chunks and mixed steps too
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == wants
    assert llm.engine.is_idle_and_clean()


def test_qwen3_5_prefix_hit_from_a_snapshot(hybrid: Path, hf: Any) -> None:
    llm = _llm(hybrid, chunked_prefill_size=0, state_snapshot_interval=64)
    base = prompt(9, 150)
    assert llm.generate([base], GREEDY)[0].token_ids == hf_greedy(hf, base)
    # the prompt's one step (a prefill graph) took snapshots at 64 and, before its end, 128
    for shared, reused in ((100, 64), (140, 128)):
        p = base[:shared] + prompt(10 + shared, 30)
        out = llm.generate([p], GREEDY)[0]
        assert out.cached_tokens == reused
        assert out.token_ids == hf_greedy(hf, p)


def test_qwen3_5_image_prompt(hybrid: Path, hf: Any) -> None:
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor

    from tests.multimodal.test_vl_engine import messages_for, text

    img = Image.fromarray(np.random.default_rng(3).integers(0, 256, (48, 64, 3), dtype=np.uint8))
    llm = _llm(hybrid, chunked_prefill_size=41)
    messages = messages_for([text("What is in"), "A", text("this picture?")], [img])
    got = llm.chat(messages, GREEDY, chat_template_kwargs={"enable_thinking": False})[0]
    ids = got.prompt_token_ids
    pix = AutoImageProcessor.from_pretrained(hybrid)(images=[img], return_tensors="pt")
    pad = llm.engine.info.image_token_id
    want = hf_greedy(hf, ids, pixel_values=pix["pixel_values"].cuda(), image_grid_thw=pix["image_grid_thw"].cuda(),
                     mm_token_type_ids=(torch.tensor([ids], device="cuda") == pad).long())  # fmt: skip
    assert got.token_ids == want


def test_qwen3_vl_images_on_cuda(tmp_path: Path) -> None:
    """Two images in one prompt and a text-only request beside it, prefilled in chunks of 50 with decode
    graphs on: the tower, the deepstack merges and M-RoPE on the GPU equal transformers on the GPU."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from tests.multimodal.test_vl_engine import IMAGE_PAD, messages_for, smooth, text

    model = ck.build_tiny_checkpoint(tmp_path / "vl", "Qwen3-VL-2B-Instruct", seed=3,
                                     extra_overrides={"vision_config": {"depth": 4, "deepstack_visual_indexes": [1, 2]}})  # fmt: skip
    llm = _llm(model, chunked_prefill_size=50)
    imgs = [smooth(64, 48, 1), smooth(40, 72, 2)]
    messages = messages_for([text("Compare"), "A", text("with"), "B"], imgs)
    got = llm.chat(messages, GREEDY)[0]
    ids = got.prompt_token_ids
    hf_vl = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).cuda().eval()
    pix = AutoImageProcessor.from_pretrained(model)(images=imgs, return_tensors="pt")
    want = hf_greedy(hf_vl, ids, pixel_values=pix["pixel_values"].cuda(), image_grid_thw=pix["image_grid_thw"].cuda(),
                     mm_token_type_ids=(torch.tensor([ids], device="cuda") == IMAGE_PAD).long())  # fmt: skip
    assert got.token_ids == want
    plain = prompt(11, 40)
    assert llm.generate([plain], GREEDY)[0].token_ids == hf_greedy(hf_vl, plain)
    assert llm.engine.is_idle_and_clean()


def test_qwen3_vl_tower_graphs_replay_the_eager_tower(tmp_path: Path) -> None:
    """A grid's second call captures a CUDA graph and later calls replay it: the outputs equal the eager
    tower's bit for bit for new pixels each time, a graph's outputs survive another grid's replay in the
    shared pool, a grid seen once or larger than a graph may hold runs eagerly, and at most MAX_GRAPHS
    are kept."""
    from mllmd.engine import vision_graph
    from mllmd.multimodal.patchify import patchify_images

    model = ck.build_tiny_checkpoint(tmp_path / "vl", "Qwen3-VL-2B-Instruct", seed=3,
                                     extra_overrides={"vision_config": {"depth": 4, "deepstack_visual_indexes": [1, 2]}})  # fmt: skip
    llm = _llm(model)
    vision = llm.engine.runner.vision
    assert vision is not None and vision.graphs is not None
    graphs, visual = vision.graphs, llm.engine.runner.model.visual
    gen = torch.Generator(device="cuda").manual_seed(0)

    def pixels(h: int, w: int) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        img = torch.randint(0, 256, (h, w, 3), generator=gen, device="cuda", dtype=torch.uint8)
        return patchify_images([img], vision.preprocess, dtype=visual.dtype)

    def check(h: int, w: int, replayed: bool) -> None:
        values, grids = pixels(h, w)
        with torch.inference_mode():
            want, want_deep = visual(values, grids)
        got = graphs.run(values, grids)
        assert (got is not None) == replayed
        if got is not None:
            assert torch.equal(got[0], want) and all(torch.equal(a, b) for a, b in zip(got[1], want_deep))
            assert len(got[1]) == 2

    check(64, 96, replayed=False)  # first sight: eager
    check(64, 96, replayed=True)  # captured
    check(64, 96, replayed=True)  # replayed with new pixels
    check(32, 160, replayed=False)
    check(32, 160, replayed=True)
    check(64, 96, replayed=True)  # after the other grid's replays in the shared pool
    assert graphs.captures == 2 and graphs.replays == 4
    big = int(vision_graph.MAX_PATCHES**0.5) * 16 + 32  # more patches than a graph may hold
    check(big, big, replayed=False)
    check(big, big, replayed=False)
    for w in (128, 192, 224, 256):
        check(32, w, replayed=False)
        check(32, w, replayed=True)
    assert len(graphs.graphs) == vision_graph.MAX_GRAPHS
    assert ((1, 4, 6),) not in graphs.graphs  # 64 x 96 pixels, the least recently used, went first
    assert llm.engine.is_idle_and_clean()
