"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) through the engine: greedy tokens equal transformers'.

A tiny random Qwen3.5 from the real 0.8B config (4 layers: 3 DeltaNet + 1 full attention; value heads
twice the key heads), its decays re-drawn for long memory (A in U(0.001, 0.05): with the default init
most heads forget within a token, and a lost state would go unnoticed). Every case compares 64 greedy
tokens with transformers' Qwen3_5ForConditionalGeneration (fp32, CPU): chunked prefill at several chunk
sizes, new and continuing requests in one batch, preemption and a small state pool, prefix-cache hits
before / at / after a snapshot boundary and one leaving a single token to prefill, and an image prompt.
One test shows the suite's power: zeroing the state at a chunk boundary makes it fail.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mllmd import LLM, SamplingParams
from mllmd.testing import checkpoints as ck
from mllmd.testing.engine_steps import run_to_end

NEW = 64
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_long_memory_model(tmp_path_factory.mktemp("qwen3_5"))


def build_long_memory_model(out_dir: Path) -> Path:
    """The tiny Qwen3.5 of this module's docstring (value heads > key heads, decays re-drawn) in `out_dir`."""
    out = ck.build_tiny_checkpoint(out_dir, "Qwen3.5-0.8B", num_hidden_layers=4, head_dim=32, seed=5)
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert text["linear_num_value_heads"] > text["linear_num_key_heads"]
    ck.redraw_decays(out, seed=11)  # long memory: exp(A) in [0.001, 0.05]
    return out


@pytest.fixture(scope="module")
def hf(model: Path) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 150000, (n,), generator=g).tolist()


def hf_greedy(hf: Any, ids: list[int], **extra: Any) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **extra)
    return out[0, len(ids):].tolist()


LONG = prompt(1, 230)


@pytest.fixture(scope="module")
def want_long(hf: Any) -> list[int]:
    return hf_greedy(hf, LONG)


@pytest.mark.parametrize("chunk", [1, 3, 63, 64, 65, 200])
def test_chunked_prefill_carries_the_state(model: Path, want_long: list[int], chunk: int) -> None:
    llm = LLM(str(model), dtype="float32", chunked_prefill_size=chunk, disable_radix_cache=True)
    assert llm.generate([LONG], GREEDY)[0].token_ids == want_long
    assert llm.engine.is_idle_and_clean()


def test_new_and_continuing_requests_in_one_batch(model: Path, hf: Any) -> None:
    """Prompts of different lengths prefilled in chunks of 37 beside each other's decodes; then a small
    KV pool (preemptions, recomputed from the last snapshot) and a small state pool (requests wait)."""
    prompts = [prompt(2, 90), prompt(3, 17), prompt(4, 140), prompt(5, 5)]
    wants = [hf_greedy(hf, p) for p in prompts]
    llm = LLM(str(model), dtype="float32", chunked_prefill_size=37)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == wants
    tight = LLM(str(model), dtype="float32", chunked_prefill_size=37, max_total_tokens=300, state_slots=3,
                state_snapshot_interval=32)
    assert [o.token_ids for o in tight.generate(prompts, GREEDY)] == wants
    assert tight.engine.scheduler.stats.preemptions > 0, "the KV pool was meant to force preemptions"
    assert tight.engine.is_idle_and_clean()


def test_snapshots_a_long_prompt_takes_do_not_keep_the_next_request_waiting(model: Path, hf: Any) -> None:
    """A prompt prefilled in 16-token chunks with a snapshot every 16 tokens took every one of 4 state
    slots as snapshots and held them until it finished: a second request waited through its whole
    generation. Admission takes one of those snapshots back (they are cache material); both outputs
    stay exact, and the pool's count shows them as snapshots, not as slots held by requests."""
    long, short = prompt(6, 130), prompt(7, 10)
    llm = LLM(str(model), dtype="float32", chunked_prefill_size=16, state_slots=4, state_snapshot_interval=16)
    engine, sched = llm.engine, llm.engine.scheduler
    engine.add_request("long", long, GREEDY)
    while sched.waiting or sched.running[0].kv_len < len(long):
        engine.step()  # the long prompt is prefilled: it decodes from now on
    usage = engine.state_usage()
    assert usage is not None and (usage["free"], usage["snapshots"]) == (0, 3), usage
    engine.add_request("short", short, GREEDY)
    engine.step()
    assert {r.rid for r in sched.running} == {"long", "short"}, "the short request waited for the long one"
    usage = engine.state_usage()
    assert usage is not None and (usage["free"], usage["snapshots"]) == (0, 2), usage
    while engine.has_unfinished():
        engine.step()
    assert engine.is_idle_and_clean()
    assert [o.token_ids for o in llm.generate([long, short], GREEDY)] == [hf_greedy(hf, long), hf_greedy(hf, short)]


def test_a_snapshot_taken_while_prefilling_serves_a_request_that_arrives_meanwhile(model: Path, hf: Any) -> None:
    """Snapshots every 32 tokens, chunks of 32: a request sharing 80 prompt tokens with one still
    prefilling (at 96 of 150) starts from its snapshot at 64 (it entered the prefix cache when that
    chunk ended; it used to wait in the request until it finished), and both outputs are exact."""
    first = prompt(8, 150)
    second = first[:80] + prompt(9, 20)
    llm = LLM(str(model), dtype="float32", chunked_prefill_size=32, state_snapshot_interval=32)
    engine, sched = llm.engine, llm.engine.scheduler
    engine.add_request("first", first, GREEDY)
    while sched.waiting or sched.running[0].kv_len < 96:
        engine.step()
    engine.add_request("second", second, GREEDY)
    outs, cached = run_to_end(engine)
    assert cached == {"first": 0, "second": 64}
    assert [outs["first"], outs["second"]] == [hf_greedy(hf, first), hf_greedy(hf, second)]
    assert engine.is_idle_and_clean()


def test_prefix_hits_around_snapshot_boundaries(model: Path, hf: Any) -> None:
    """Snapshots every 64 tokens: a second request sharing 50 (before the first boundary), 64 (at it),
    100 (after it) prompt tokens with the first reuses 0, 64, 64 of them; one that extends the first
    request's whole sequence by a token prefills that token only. Every output equals its cold run."""
    llm = LLM(str(model), dtype="float32", chunked_prefill_size=0, state_snapshot_interval=64)
    base = prompt(6, 150)
    first = llm.generate([base], GREEDY)[0]
    assert first.token_ids == hf_greedy(hf, base)
    for shared, reused in ((50, 0), (64, 64), (100, 64)):
        p = base[:shared] + prompt(7 + shared, 30)
        out = llm.generate([p], GREEDY)[0]
        assert out.cached_tokens == reused, (shared, out.cached_tokens)
        assert out.token_ids == hf_greedy(hf, p), shared
    extended = base + first.token_ids  # the first request's sequence: its final state is cached
    out = llm.generate([extended], GREEDY)[0]
    assert out.cached_tokens == len(extended) - 1
    assert out.token_ids == hf_greedy(hf, extended)
    assert llm.engine.is_idle_and_clean()


def test_one_step_prefills_a_long_prompt_and_snapshots_inside_it(model: Path, hf: Any) -> None:
    """Snapshots every 64 tokens no longer cut the prefill into 64-token steps: a 300-token prompt is
    one step whose chunk kernel copies the states out at 64, 128, 192 and 256, and requests sharing 130
    and 260 of its tokens start from 128 and 256. Outputs equal the cold runs."""
    llm = LLM(str(model), dtype="float32", chunked_prefill_size=0, state_snapshot_interval=64)
    engine = llm.engine
    base = prompt(21, 300)
    engine.add_request("base", base, GREEDY)
    first_step = [t for o in engine.step() for t in o.new_token_ids]  # (with overlap: none yet)
    assert engine.scheduler.running[0].kv_len == len(base)  # the whole prompt in the first step
    usage = engine.state_usage()
    assert usage is not None and usage["snapshots"] == 4, usage
    outs, _ = run_to_end(engine)
    assert first_step + outs["base"] == hf_greedy(hf, base)
    for shared, reused in ((130, 128), (260, 256)):
        p = base[:shared] + prompt(22 + shared, 20)
        out = llm.generate([p], GREEDY)[0]
        assert out.cached_tokens == reused, (shared, out.cached_tokens)
        assert out.token_ids == hf_greedy(hf, p), shared
    assert engine.is_idle_and_clean()


def test_chunks_off_the_64_token_grid_snapshot_their_start_and_end(model: Path, hf: Any) -> None:
    """Chunks of 96 (the decode stall cap rounds chunks to graph buckets such as 96): the interval's 128
    falls 32 tokens into the second chunk, before its first whole 64-token chunk, so that chunk's start
    (96: the state before the step, copied then) is kept, and its end (192, also a multiple of the
    interval: copied after the step). Requests sharing 150 and 200 tokens start from 96 and 192."""
    llm = LLM(str(model), dtype="float32", chunked_prefill_size=96, state_snapshot_interval=64 * 2)
    base = prompt(51, 230)
    assert llm.generate([base], GREEDY)[0].token_ids == hf_greedy(hf, base)
    for shared, reused in ((150, 96), (200, 192)):
        p = base[:shared] + prompt(52 + shared, 20)
        out = llm.generate([p], GREEDY)[0]
        assert out.cached_tokens == reused, (shared, out.cached_tokens)
        assert out.token_ids == hf_greedy(hf, p), shared
    assert llm.engine.is_idle_and_clean()


def test_the_next_turn_of_a_conversation_starts_from_the_snapshot_before_the_prompts_end(model: Path, hf: Any) -> None:
    """The next turn repeats a prompt up to a few tokens before its end (the chat template renders the
    assistant's header differently once the reply is in the history), so no snapshot at an interval
    multiple (none below 512 here) nor the final one (after the reply) can serve it: the snapshot at the
    last 64-token boundary before the prompt's end does (128 of a 190-token prompt)."""
    llm = LLM(str(model), dtype="float32", chunked_prefill_size=0, state_snapshot_interval=512)
    first_turn = prompt(31, 190)
    reply = llm.generate([first_turn], GREEDY)[0]
    next_turn = first_turn[:-4] + reply.token_ids[:20] + prompt(32, 15)
    out = llm.generate([next_turn], GREEDY)[0]
    assert out.cached_tokens == 128
    assert out.token_ids == hf_greedy(hf, next_turn)
    assert llm.engine.is_idle_and_clean()


def test_a_snapshot_taken_inside_a_step_equals_the_state_of_a_step_that_ends_there(model: Path) -> None:
    """The state the chunk kernel copies out after 128 tokens of one 200-token step (conv and
    recurrent, every DeltaNet layer) equals the request's own state after a chunk that ends at 128
    (64-token steps), which the scheduler copies once that step is launched."""
    ids = prompt(41, 200)

    def snapshot_at_128(chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        llm = LLM(str(model), dtype="float32", chunked_prefill_size=chunk, state_snapshot_interval=128)
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
        match = llm.engine.scheduler.cache.match_prefix(ids[:128] + [7])
        assert int(match.indices.numel()) == 128 and match.state is not None
        pool = llm.engine.runner.state_pool
        return pool.conv[:, match.state].clone(), pool.ssm[:, match.state].clone()

    conv_in_step, ssm_in_step = snapshot_at_128(0)
    conv_at_end, ssm_at_end = snapshot_at_128(64)
    assert conv_in_step.abs().sum() > 0 and ssm_in_step.abs().sum() > 0
    torch.testing.assert_close(conv_in_step, conv_at_end, rtol=0, atol=0)
    torch.testing.assert_close(ssm_in_step, ssm_at_end, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("slots", [1, 2])
def test_a_small_state_pool_keeps_the_snapshot_a_request_is_about_to_use(model: Path, hf: Any, slots: int) -> None:
    """Making room for the new request's own state slot must not evict the snapshot its prefix match
    found (it did: the slot came first and LRU took the snapshot, so a shared prefix never hit with 2
    slots). With 2 slots the other snapshot goes; with 1 (only the matched snapshot holds a slot) the
    request takes the snapshot's slot itself. Outputs equal the cold runs."""
    llm = LLM(str(model), dtype="float32", chunked_prefill_size=0, state_slots=slots, state_snapshot_interval=32)
    base = prompt(11, 100)
    first = llm.generate([base + prompt(12, 10)], GREEDY)[0]
    if slots == 2:  # a new question on the shared 100 tokens: the snapshot at 64, taken while prefilling
        p = base + prompt(13, 10)  # (the interval's 96 falls inside the step's second 64-token chunk)
        reused = 64
    else:  # one slot: no snapshot while prefilling; the first request's final state is the one snapshot
        p = base + prompt(12, 10) + first.token_ids + prompt(14, 5)
        reused = 110 + NEW - 1
    out = llm.generate([p], GREEDY)[0]
    assert out.cached_tokens == reused
    assert out.token_ids == hf_greedy(hf, p)
    assert llm.engine.is_idle_and_clean()


def test_zeroing_the_state_at_a_chunk_boundary_is_caught(model: Path, want_long: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's power: a scheduler that loses the recurrent state when a prefill chunk ends (zeroes the
    request's slot) gives other tokens than transformers."""
    from mllmd.engine.scheduler import Scheduler

    real = Scheduler.commit

    def lossy(self: Scheduler, batch: Any) -> None:
        real(self, batch)
        for req in batch.reqs:
            if req.kv_len == 64 and req.state_slot is not None:
                self.state_pool.zero(req.state_slot)  # type: ignore[union-attr]

    monkeypatch.setattr(Scheduler, "commit", lossy)
    llm = LLM(str(model), dtype="float32", chunked_prefill_size=64, disable_radix_cache=True)
    assert llm.generate([LONG], GREEDY)[0].token_ids != want_long


def test_image_prompt(model: Path, hf: Any) -> None:
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor

    from tests.multimodal.test_vl_engine import messages_for, text

    rng = np.random.default_rng(3)
    img = Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
    llm = LLM(str(model), dtype="float32", chunked_prefill_size=41)
    messages = messages_for([text("What is in"), "A", text("this picture?")], [img])
    got = llm.chat(messages, GREEDY, chat_template_kwargs={"enable_thinking": False})[0]
    ids = got.prompt_token_ids
    pix = AutoImageProcessor.from_pretrained(model)(images=[img], return_tensors="pt")
    pad = llm.engine.info.image_token_id
    want = hf_greedy(hf, ids, pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"],
                     mm_token_type_ids=(torch.tensor([ids]) == pad).long())
    assert got.token_ids == want


def test_a_config_without_full_attention_is_refused_by_name(tmp_path: Path) -> None:
    from mllmd import LLM

    only_linear = ck.build_tiny_checkpoint(
        tmp_path / "linear",
        "Qwen3.5-0.8B",
        num_hidden_layers=2,
        head_dim=32,
        extra_overrides={"text_config": {"layer_types": ["linear_attention", "linear_attention"]}},
    )
    with pytest.raises(ValueError, match="no full_attention layer"):
        LLM(str(only_linear), device="cpu", dtype="float32", max_total_tokens=64)


def test_max_running_requests_is_lowered_to_the_state_slots(model: Path, hf: Any) -> None:
    """Each running request holds a recurrent-state slot: with 3 slots at most 3 run (the request table,
    the sampler's rows and the graphs are sized for 3, not 8), and 5 requests still all finish right."""
    llm = LLM(str(model), dtype="float32", max_running_requests=8, state_slots=3)
    assert llm.engine.config.max_running_requests == llm.engine.scheduler.max_running_requests == 3
    assert llm.engine.runner.req_to_token_pool.size == 3
    prompts = [prompt(40 + i, 20 + i) for i in range(5)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, p)[:8]
