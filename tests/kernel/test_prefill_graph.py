"""Prefill and mixed-step graphs (mllmd.engine.prefill_graph): a step staged into a bucket's padded
static inputs and rerun from those inputs alone gives the same greedy tokens and log-probabilities as
the eager step. Here on the CPU under the Triton interpreter, with a StepGraph double that reruns the
recorded step at each replay (a CUDA graph replays the same kernels on the same memory; the GPU test
is tests/engine/test_gpu.py::test_prefill_graphs_match_eager)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from mllmd_kernels import HAS_TRITON, interpreting

from mllmd import LLM, SamplingParams
from mllmd.engine.prefill_graph import PrefillGraphRunner, row_buckets, token_buckets
from tests.engine.test_parity import _tokenize


def test_buckets() -> None:
    assert token_buckets(512) == [16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert token_buckets(100) == [16, 32, 64, 96, 112]  # the cap, rounded up to a multiple of 16
    assert token_buckets(0) == []
    assert row_buckets(64) == [1, 4, 16, 64]
    assert row_buckets(8) == [1, 4, 8]
    assert row_buckets(1) == [1]


class RerunGraph:
    """A StepGraph that records the step and reruns it at each replay, into the captured output."""

    rows: Counter[int] = Counter()  # replays per row bucket (the output is [rows, hidden])

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def capture(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.run = run
        self.out = run()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.run())
        RerunGraph.rows[self.out.shape[0]] += 1


def _llm(model: Path, graphs: bool) -> LLM:
    llm = LLM(str(model), device="cpu", dtype="float32", attention_backend="triton", overlap_schedule=True,
              chunked_prefill_size=20, max_prefill_tokens=40, max_running_requests=6)  # fmt: skip
    runner = llm.engine.runner
    if graphs:
        runner.prefill_graphs = PrefillGraphRunner(
            runner.model, runner.attn_backend, runner.token_buf, 48, 6, runner._plan, new_graph=RerunGraph,
            images=runner._graph_images(),
        )
    return llm


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="the Triton interpreter on the CPU (TRITON_INTERPRET=1)")
def test_prefill_graphs_match_eager_steps(qwen3_tied: Path) -> None:
    """Prompts of 5 to 40 tokens in chunks of 20 beside running decodes (whose tokens are still on
    the device: overlap), then the same prompts again (prefix-cache hits: extends over a cached
    prefix): tokens and top log-probabilities equal the eager run's, and the graphs ran prefill,
    mixed and padded steps. (Log-probabilities within 1e-4, a few float32 steps of the logits: a
    matmul over the padded rows may round differently.)"""
    prompts = _tokenize(qwen3_tied)[:5]
    prompts = [p[:40] for p in prompts]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    runs = {}
    RerunGraph.rows.clear()
    for graphs in (False, True):
        llm = _llm(qwen3_tied, graphs)
        outs = llm.generate(prompts, params) + llm.generate(prompts[:2], params)
        assert sum(o.cached_tokens for o in outs[len(prompts):]) > 0
        assert llm.engine.is_idle_and_clean()
        runs[graphs] = outs
    for eager, graphed in zip(runs[False], runs[True]):
        assert graphed.token_ids == eager.token_ids
        for got, want in zip(graphed.top_logprobs, eager.top_logprobs):
            assert [t for t, _ in got] == [t for t, _ in want]
            assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)
    assert sum(RerunGraph.rows.values()) >= 4 and len(RerunGraph.rows) >= 2, RerunGraph.rows


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="the Triton interpreter on the CPU (TRITON_INTERPRET=1)")
def test_dense_route_graphs_only_replay_fresh_rows(qwen3_tied: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention backend's dense route (SDPA over a row's own tokens, for long fresh prompts) made
    to apply here from 16 tokens: a one-row step with a cached prefix (a prefix hit, a continuation
    chunk) must not replay a graph captured on that route, which would attend past none of the prefix.
    Tokens equal the eager run's; fresh rows still replay the dense graphs. (Before: a continuation of
    1,537-2,048 tokens on Qwen3-8B, or of 769+ on Qwen3.5, replayed the 2,048 / 1,024 dense graph.)"""
    import mllmd.engine.attention.triton_backend as tb

    monkeypatch.setattr(tb, "DENSE_PREFILL_DTYPES", (torch.float32,))
    monkeypatch.setattr(tb, "DENSE_PREFILL_MIN_TOKENS", 16)
    monkeypatch.setattr(tb, "DENSE_PREFILL_MIN_HEAD_TOKENS", 0)
    dense_rows: list[int] = []
    real = tb.dense_causal_attention
    monkeypatch.setattr(tb, "dense_causal_attention", lambda q, *a: dense_rows.append(q.shape[0]) or real(q, *a))
    base = max(_tokenize(qwen3_tied), key=len)[:30]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        llm = _llm(qwen3_tied, graphs)
        dense_rows.clear()  # (the capture ran each fresh-row graph once)
        # (chunks of 20) fresh; a prefix hit with 20+ new tokens; a fresh 40-token prompt
        outs = [llm.generate([p], params)[0] for p in (base, base + base[:20], base[::-1] + base[5:15])]
        assert outs[1].cached_tokens > 0
        runs[graphs] = [o.token_ids for o in outs]
        assert (32 if graphs else 20) in dense_rows, "the fresh prompt's first chunk took the dense route"
    assert runs[True] == runs[False]


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="the Triton interpreter on the CPU (TRITON_INTERPRET=1)")
def test_vision_language_text_steps_run_in_prefill_graphs(tmp_path: Path) -> None:
    """Qwen3-VL: text after the images runs in the graphs at index + M-RoPE delta (a follow-up turn over
    a cached image, decodes of an image request beside a text prompt's chunks): the same tokens as the
    eager run."""
    from mllmd.testing import checkpoints as ck
    from tests.multimodal.test_vl_engine import part, smooth, text

    model = ck.build_tiny_checkpoint(tmp_path / "vl", "Qwen3-VL-2B-Instruct", seed=3,
                                     extra_overrides={"vision_config": {"depth": 2, "deepstack_visual_indexes": [0, 1]}})
    first = [{"role": "user", "content": [part(smooth(64, 48, 1)), text("What is in this picture?")]}]
    plain = [{"role": "user", "content": [text("Name three planets and one moon of each, briefly.")]}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs, shifted = {}, []
    for graphs in (False, True):
        llm = _llm(model, graphs)
        pg = llm.engine.runner.prefill_graphs
        if pg is not None:
            real_stage = pg.stage

            def stage(*args: Any, real: Any = real_stage, **kw: Any) -> Any:
                batch = real(*args, **kw)
                if batch is not None:  # positions (the 3rd argument) off the columns: an M-RoPE delta
                    shifted.append(args[2] != args[1])
                return batch

            pg.stage = stage  # type: ignore[method-assign]
        outs = llm.chat([first, plain], params)
        answer = llm.tokenizer.decode(outs[0].token_ids)
        follow = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And its colour?"}]
        outs += llm.chat(follow, params)
        assert outs[-1].cached_tokens > 0  # the first turn's prompt, image included, came from the cache
        runs[graphs] = [o.token_ids for o in outs]
    assert runs[True] == runs[False]
    assert any(shifted) and len(shifted) >= 3, shifted


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="the Triton interpreter on the CPU (TRITON_INTERPRET=1)")
def test_vision_language_image_steps_run_in_prefill_graphs(tmp_path: Path) -> None:
    """Qwen3-VL with deepstack: steps with image tokens replay the graphs with the image rows and 3-axis
    positions staged (an image first and one in the middle, of different sizes; chunks of 20 that end
    inside an image; two such requests in one step; then a text-only request, whose step must not see
    the last image step's rows): the same tokens as the eager run. Fails when the deepstack rows or the
    3-axis positions are not staged, or stale image rows are left in the buffers."""
    from mllmd.testing import checkpoints as ck
    from tests.multimodal.test_vl_engine import part, smooth, text

    model = ck.build_tiny_checkpoint(tmp_path / "vl", "Qwen3-VL-2B-Instruct", seed=5,
                                     extra_overrides={"vision_config": {"depth": 2, "deepstack_visual_indexes": [0, 1]}})
    convs = [
        [{"role": "user", "content": [part(smooth(160, 96, 1)), text("Describe it.")]}],
        [{"role": "user", "content": [text("Compare"), part(smooth(96, 128, 2)), text("with this"),
                                      part(smooth(64, 64, 3)), text("in one line.")]}],
    ]  # fmt: skip
    plain = [{"role": "user", "content": [text("Name three planets and one moon of each, briefly.")]}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs, staged = {}, []
    for graphs in (False, True):
        llm = _llm(model, graphs)
        pg = llm.engine.runner.prefill_graphs
        if pg is not None:
            assert pg.axes == 3 and len(pg.image_deepstack) == 2
            real_stage = pg.stage

            def stage(*args: Any, real: Any = real_stage, **kw: Any) -> Any:
                batch = real(*args, **kw)
                if batch is not None:  # (staged with images, with 3-axis positions)
                    staged.append((args[-1] is not None, args[-2] is not None))
                return batch

            pg.stage = stage  # type: ignore[method-assign]
        outs = llm.chat(convs, params) + llm.chat([plain], params)
        runs[graphs] = [o.token_ids for o in outs]
    assert runs[True] == runs[False]
    assert sum(img for img, _ in staged) >= 3 and sum(ax for _, ax in staged) >= 3, staged


def _hybrid_llm(model: Path, graph_tokens: int, **engine: Any) -> LLM:
    """A hybrid model's LLM on the CPU with the Triton attention backend, and with prefill graphs (the
    RerunGraph double) up to `graph_tokens` tokens where that is not 0."""
    llm = LLM(str(model), device="cpu", dtype="float32", attention_backend="triton", overlap_schedule=True, **engine)
    if graph_tokens:
        runner = llm.engine.runner
        runner.prefill_graphs = PrefillGraphRunner(runner.model, runner.attn_backend, runner.token_buf, graph_tokens,
                                                   engine["max_running_requests"], runner._plan, new_graph=RerunGraph,
                                                   state_slots=True)  # fmt: skip
    return llm


def _hybrid_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, graph_tokens: int,
                 requests: Callable[[LLM], list[Any]], **engine: Any) -> dict[bool, list[list[int]]]:  # fmt: skip
    """The long-memory Qwen3.5 of tests/engine/test_qwen3_5.py with its DeltaNet layers on their Triton
    kernels (as on a GPU, under the interpreter): `requests(llm)`'s outputs' tokens, eager (False) and
    with prefill graphs (True); each run ends idle and clean."""
    import mllmd.models.layers.gated_deltanet as gdn
    from tests.engine.test_qwen3_5 import build_long_memory_model

    monkeypatch.setattr(gdn, "fused_kernels", lambda x: True)
    model = build_long_memory_model(tmp_path / "q35")
    runs = {}
    RerunGraph.rows.clear()
    for graphs in (False, True):
        llm = _hybrid_llm(model, graph_tokens if graphs else 0, **engine)
        runs[graphs] = [o.token_ids for o in requests(llm)]
        assert llm.engine.is_idle_and_clean()
    return runs


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="the Triton interpreter on the CPU (TRITON_INTERPRET=1)")
def test_hybrid_steps_carry_their_state_through_prefill_graphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3.5 (long-memory decays): prompts in chunks of 20 that continue from their recurrent state,
    beside decodes, then a prefix hit from a state snapshot: padded rows in the dummy state slot and
    padded tokens past the last sequence change nothing; tokens equal the eager run's. The Gated
    DeltaNet layers run their Triton kernels (conv, chunked rule, recurrent decode, gated norm), as on
    a GPU, under the interpreter. (Fails when the rows' state slots are not staged.)"""
    from tests.engine.test_qwen3_5 import prompt

    prompts = [prompt(1, 45), prompt(2, 7), prompt(3, 30)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def requests(llm: LLM) -> list[Any]:
        outs = llm.generate(prompts, params) + llm.generate([prompts[0][:41] + prompt(4, 9)], params)
        assert outs[-1].cached_tokens >= 40  # the snapshot after 40 tokens
        return outs

    runs = _hybrid_runs(tmp_path, monkeypatch, 48, requests, chunked_prefill_size=20, max_prefill_tokens=40,
                        max_running_requests=6, state_snapshot_interval=20)
    assert runs[True] == runs[False]
    assert sum(RerunGraph.rows.values()) >= 4 and len(RerunGraph.rows) >= 2, RerunGraph.rows


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="the Triton interpreter on the CPU (TRITON_INTERPRET=1)")
def test_hybrid_models_keep_the_graph_where_the_backend_prefers_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qwen3_tied: Path
) -> None:
    """The attention backend may ask for an eager step (its dense route for long fresh prompts at
    head_dim 256): a plain model's prompt then leaves the prefill graph, a hybrid model's stays in it,
    since its eager step would pay the host for every DeltaNet layer to speed up its few attention
    layers."""
    from mllmd.engine.attention.triton_backend import TritonAttentionBackend
    from tests.engine.test_qwen3_5 import build_long_memory_model, prompt

    monkeypatch.setattr(TritonAttentionBackend, "prefers_eager", lambda self, *a: True)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    RerunGraph.rows.clear()
    _llm(qwen3_tied, True).generate([max(_tokenize(qwen3_tied), key=len)[:30]], params)
    assert not RerunGraph.rows, "the plain model's prompt ran eagerly"
    _hybrid_llm(build_long_memory_model(tmp_path / "q35"), 48, max_running_requests=4).generate([prompt(1, 30)], params)
    assert RerunGraph.rows, "the hybrid model's prompt ran in its prefill graph"


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="the Triton interpreter on the CPU (TRITON_INTERPRET=1)")
def test_hybrid_snapshots_taken_inside_a_prefill_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 120-token Qwen3.5 prompt in one step of the 128-token graph takes its prefix-cache snapshot at
    64 inside the graph (the graph's snapshot inputs: the chunk kernel's table, the conv states' token
    indices and slots); a request sharing 100 tokens starts from it. Tokens equal the eager run's,
    which takes the same snapshot."""
    from tests.engine.test_qwen3_5 import prompt

    first = prompt(5, 120)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def requests(llm: LLM) -> list[Any]:
        outs = llm.generate([first], params) + llm.generate([first[:100] + prompt(6, 12)], params)
        assert outs[-1].cached_tokens == 64
        return outs

    runs = _hybrid_runs(tmp_path, monkeypatch, 128, requests, chunked_prefill_size=0, max_prefill_tokens=128,
                        max_running_requests=1, state_snapshot_interval=64)
    assert runs[True] == runs[False]
    assert RerunGraph.rows[1] >= 2, RerunGraph.rows  # both prompts' steps replayed a graph
