"""The engine on CUDA: greedy parity with transformers (fp32) on a Qwen3-0.6B-shaped random model for
each attention backend with CUDA graphs on and off, bf16 logits against the fp32 reference, and
decode steps that never synchronise the host with the device. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mllmd import LLM, SamplingParams
from mllmd.testing.checkpoints import build_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NEW_TOKENS = 32
# Qwen3-0.6B's real shapes (vocabulary, RoPE, norms and special tokens come from its config).
SHAPE_0_6B = dict(
    num_hidden_layers=28, hidden_size=1024, intermediate_size=3072,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128,
)
PROMPTS = [
    [9707, 11, 1879, 0],
    list(range(1000, 1077)),
    [151644, 872, 198, 7985, 264, 6935, 38242, 911, 70403, 13, 151645, 198, 151644, 77091, 198],
    [16, 11, 220, 17, 11, 220, 18, 11, 220, 19, 11] * 3,
]


@pytest.fixture(scope="module")
def model_0_6b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stored in bf16 like the real Qwen3 checkpoints; the fp32 runs compute on those weights upcast."""
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3-0.6b-shape"), "Qwen3-0.6B", dtype="bfloat16", **SHAPE_0_6B
    )


@pytest.fixture(scope="module")
def conditioned_0_6b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-0.6B shapes and bf16 weights with linear std 0.5 / sqrt(fan_in): well-conditioned, like
    a trained model, unlike `model_0_6b`, where one bf16 rounding moves the logits by ~3% (transformers'
    own bf16 run included): there bf16-vs-fp32 differences measure the weights' chaos, not our kernels."""
    from mllmd.bench.random_checkpoint import build_random_checkpoint

    return build_random_checkpoint(
        tmp_path_factory.mktemp("qwen3-0.6b-conditioned"), "Qwen3-0.6B", dtype="bfloat16", linear_gain=0.5
    )


@pytest.fixture(scope="module")
def hf_fp32(model_0_6b: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_0_6b, dtype=torch.float32).cuda().eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_fp32) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for ids in PROMPTS:
            x = torch.tensor([ids], device="cuda")
            y = hf_fp32.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False)
            outs.append(y[0, len(ids) :].tolist())
    return outs


def _llm(path: Path, **kw) -> LLM:
    """The decode stall cap off unless asked for: left to itself it follows measured step times, and these
    tests compare runs step for step."""
    kw.setdefault("max_decode_stall_ms", 0)
    return LLM(str(path), device="cuda", max_total_tokens=4096, max_running_requests=8, **kw)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda_graph", "eager"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp32_greedy_equals_transformers(
    model_0_6b: Path, hf_greedy: list[list[int]], backend: str, graphs: bool, overlap: bool
):
    llm = _llm(
        model_0_6b, dtype="float32", attention_backend=backend, disable_cuda_graph=not graphs,
        overlap_schedule=overlap,
    )
    runner = llm.engine.runner
    assert (runner.graph_runner is not None) == (graphs and runner.attn_backend.supports_cuda_graph)
    assert (runner.prefill_graphs is not None) == (graphs and runner.attn_backend.supports_prefill_graph)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for got, want in zip(outs, hf_greedy):
        assert got.token_ids == want[: len(got.token_ids)] and len(got.token_ids) == NEW_TOKENS


def _prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits of every prompt position, through the engine's model (eager, one request)."""
    from mllmd.engine.forward_batch import ForwardBatch

    runner = llm.engine.runner
    n = len(ids)
    slots = torch.arange(1, n + 1, device="cuda")
    runner.req_to_token_pool.req_to_token[0, :n] = slots
    one = torch.ones(1, dtype=torch.int64, device="cuda")
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, device="cuda"), positions=slots - 1, out_cache_loc=slots,
        req_pool_indices=one - 1, seq_lens=one * n, extend_lens=one * n,
        logits_indices=torch.arange(n, device="cuda"), seq_lens_cpu=[n], prefix_lens_cpu=[0], extend_lens_cpu=[n],
    )
    return runner.forward_eager(batch)


def test_bf16_logits_within_2e2_of_fp32_reference(conditioned_0_6b: Path):
    from transformers import AutoModelForCausalLM

    model_0_6b = conditioned_0_6b
    llm = _llm(model_0_6b, dtype="bfloat16", disable_cuda_graph=True)
    ids = PROMPTS[1]
    ours = _prefill_logits(llm, ids).double()
    hf_fp32 = AutoModelForCausalLM.from_pretrained(model_0_6b, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        ref = hf_fp32(torch.tensor([ids], device="cuda")).logits[0].double()
    del hf_fp32
    rel = ((ours - ref).norm() / ref.norm()).item()
    hf_bf16 = AutoModelForCausalLM.from_pretrained(model_0_6b, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        theirs = hf_bf16(torch.tensor([ids], device="cuda")).logits[0].double()
    del hf_bf16
    hf_rel = ((theirs - ref).norm() / ref.norm()).item()
    print(f"bf16 vs fp32 logits, relative: mllmd {rel:.4g}, transformers bf16 {hf_rel:.4g}")
    assert rel < 2e-2, f"bf16 logits differ from the fp32 reference by {rel:.3g} (transformers bf16: {hf_rel:.3g})"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda_graph", "eager"])
def test_decode_step_never_synchronizes(model_0_6b: Path, graphs: bool, overlap: bool):
    """Only the sampled ids come back (pinned memory + an event); everything else is enqueued."""
    llm = _llm(model_0_6b, dtype="bfloat16", disable_cuda_graph=not graphs, overlap_schedule=overlap)
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, top_k=50, seed=1, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(f"r{i}", ids, sampled if i % 2 else params)
    for _ in range(3):  # prefill + first decodes (warm-up: Triton compiles, graphs replay once)
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            outs = engine.step()
            assert len(outs) == len(PROMPTS) and all(len(o.new_token_ids) == 1 for o in outs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.runner.graph_runner is None or graphs


def test_cuda_graph_padding_matches_eager(model_0_6b: Path):
    """3 requests replay the graph captured for 4 (one padding row): same tokens as eager decode."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[:3]
    a = _llm(model_0_6b, dtype="float32", disable_cuda_graph=False).generate(prompts, params)
    b = _llm(model_0_6b, dtype="float32", disable_cuda_graph=True).generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_prefill_graphs_match_eager(model_0_6b: Path):
    """Prompts in chunks of 24 beside running decodes (overlap: their tokens still on the device), the
    same prompts again (prefix hits) and a lone new prompt: prefill and mixed steps replay the prefill
    CUDA graphs (padded to their buckets) and give the tokens of the same steps run eagerly."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    opts = dict(dtype="float32", overlap_schedule=True, chunked_prefill_size=24, max_prefill_tokens=64)
    runs, replays = {}, []
    for graphs in (True, False):
        llm = _llm(model_0_6b, prefill_graph_max_tokens=64 if graphs else 0, **opts)
        pg = llm.engine.runner.prefill_graphs
        assert (pg is not None) == graphs
        if pg is not None:
            real_run = pg.run
            pg.run = lambda batch, run=real_run: replays.append(batch.prefill_graph) or run(batch)
        outs = llm.generate(PROMPTS, params) + llm.generate(PROMPTS[:2], params)
        outs += llm.generate([list(range(2000, 2040))], params)
        runs[graphs] = [o.token_ids for o in outs]
    assert runs[True] == runs[False]
    assert len(replays) >= 5 and len({key[1] for key in replays}) >= 2, replays


def test_dense_route_graphs_replay_only_fresh_rows(model_0_6b: Path, monkeypatch: pytest.MonkeyPatch):
    """The Triton backend's dense route (SDPA over a fresh row's own K/V) made to apply from 16 tokens,
    float32 included: a fresh one-row prompt replays its bucket's fresh-row graph, a continuation chunk
    and a prefix hit replay the paged graphs (the dense one would attend past none of the prefix), and
    the tokens equal the eager run's (tests/kernel/test_prefill_graph.py has the same on the CPU)."""
    import mllmd.engine.attention.triton_backend as tb

    monkeypatch.setattr(tb, "DENSE_PREFILL_DTYPES", (torch.float32,))
    monkeypatch.setattr(tb, "DENSE_PREFILL_MIN_TOKENS", 16)
    monkeypatch.setattr(tb, "DENSE_PREFILL_MIN_HEAD_TOKENS", 0)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    base = list(range(1000, 1040))  # chunks of 24 and 16
    prompts = [base, base[:32] + list(range(3000, 3030)), list(range(5000, 5020))]  # fresh, a prefix hit, fresh
    opts = dict(dtype="float32", chunked_prefill_size=24, max_prefill_tokens=64)
    runs, replays = {}, []
    for graphs in (True, False):
        llm = _llm(model_0_6b, prefill_graph_max_tokens=64 if graphs else 0, **opts)
        pg = llm.engine.runner.prefill_graphs
        if pg is not None:
            real_run = pg.run
            pg.run = lambda batch, run=real_run: replays.append((batch.prefill_graph, sum(batch.prefix_lens_cpu))) or run(batch)
        runs[graphs] = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert runs[True] == runs[False]
    assert any(key[2] for key, prefix in replays if not prefix), replays
    assert not any(key[2] for key, prefix in replays if prefix), replays


def _fill_free_cached_blocks(value: int) -> list[torch.Tensor]:
    """Allocate a byte tensor over every free block the caching allocator holds outside graph pools."""
    free = []
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            continue  # a CUDA graph's private pool
        free += [b["size"] for b in seg["blocks"] if b["state"] == "inactive"]
    held = []
    for size in sorted(free, reverse=True):
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
        t.fill_(value)
        held.append(t)
    return held


def test_cuda_graph_replay_writes_only_its_own_memory(model_0_6b: Path):
    """Every buffer a captured graph writes lives in the graph's private pool: memory the caching
    allocator hands out after capture (here: all of its free blocks, filled with a sentinel) is left
    untouched by replays. A scratch buffer allocated during the warm-up and freed after capture would
    be overwritten on every replay (this is how the Qwen3-8B daemon crashed with graphs on)."""
    llm = _llm(model_0_6b, dtype="bfloat16", disable_cuda_graph=False, max_prefill_tokens=256,
               prefill_graph_max_tokens=128)  # fmt: skip
    graphs = llm.engine.runner.graph_runner
    prefill = llm.engine.runner.prefill_graphs
    assert graphs is not None and len(graphs.graphs) > 1 and prefill is not None and len(prefill.graphs) > 1
    torch.cuda.synchronize()
    held = _fill_free_cached_blocks(0x5A)
    assert held, "the caching allocator held no free block to check"
    for graph in [*graphs.graphs.values(), *prefill.graphs.values()]:
        graph.replay()
    torch.cuda.synchronize()
    changed = [t.numel() for t in held if not bool((t == 0x5A).all())]
    assert not changed, f"graph replays wrote into {len(changed)} blocks outside their pool (sizes {changed[:8]})"


def test_deleting_the_llm_frees_its_device_memory_at_once(model_0_6b: Path):
    """No reference cycle through the CUDA graph runners: `del llm` frees the KV pool and the graphs
    without waiting for Python's cycle collector (a second LLM in the same process would otherwise find
    the device full: bench.ttft did)."""
    import gc
    import weakref

    llm = _llm(model_0_6b, dtype="bfloat16", disable_cuda_graph=False)
    llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4, temperature=0.0))
    runner = weakref.ref(llm.engine.runner)
    assert llm.engine.runner.graph_runner is not None and llm.engine.runner.prefill_graphs is not None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gc.disable()
    try:
        del llm
        assert runner() is None, "the model runner outlived its LLM: a reference cycle holds it"
        assert torch.cuda.memory_allocated() < before - (64 << 20)
    finally:
        gc.enable()
