"""Qwen3.5's gated full-attention layer on the fused route (the rope kernel with the zero-centred QK
norm and partial rotary, K/V stored by it or by the step; the output gate kernel) against its torch
route: the same output. On a GPU the torch route's norm is its own Triton kernel; under the
interpreter (TRITON_INTERPRET=1) the CPU reference. Also the whole tiny model's greedy tokens."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mllmd_kernels.testing import close_tol, kernel_device, on_gpu, skip_reason

import mllmd.models.layers.activation as activation_mod
import mllmd.models.layers.attention as attention_mod
import mllmd.models.qwen3_5 as qwen3_5_mod
from mllmd.models.mrope import MRotaryEmbedding
from mllmd.models.qwen3_5 import Qwen3_5Attention

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())


class PoolStep:
    """One sequence's step over a K/V pool of `slots` rows: the step's tokens go to rows `loc`, and
    attention is causal over them (what the engine's backends do for a fresh prompt)."""

    def __init__(self, slots: int, hkv: int, d: int, dtype: torch.dtype, loc: torch.Tensor) -> None:
        self.k = torch.full((slots, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
        self.v = self.k.clone()
        self.loc = loc

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k, self.v, self.loc

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[self.loc], self.v[self.loc] = k, v

    def attend(self, layer: int, q: torch.Tensor, scale: float, out_absmax: bool = False) -> tuple[torch.Tensor, None]:
        k, v = self.k[self.loc], self.v[self.loc]  # [T, Hkv, D]
        rep = q.shape[1] // k.shape[1]
        qf, kf, vf = (x.float().transpose(0, 1) for x in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
        out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
        return out.transpose(0, 1).to(q.dtype).contiguous(), None


def _config(head_dim: int) -> SimpleNamespace:
    """Qwen3.5-2B's attention at a small width: partial rotary 0.25, interleaved M-RoPE sections."""
    half = head_dim // 8  # rotary_dim / 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    return SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim, hidden_size=128,
                           rms_norm_eps=1e-6, attention_bias=False, max_position_embeddings=4096,
                           rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                                            "mrope_section": section, "mrope_interleaved": True})  # fmt: skip


def _route(monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    """The model's attention, RotaryAttention and the gate on the fused or the torch route (the
    norms' own dispatch is left alone: their Triton kernel on a GPU, as the torch route runs)."""
    for mod in (qwen3_5_mod, attention_mod, activation_mod):
        monkeypatch.setattr(mod, "fused_kernels", lambda x, fused=fused: fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 256])
@pytest.mark.parametrize("rope_stores_kv", [True, False])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("inputs", ["random", "exact_sums"])
def test_fused_route_equals_the_torch_route(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, head_dim: int, rope_stores_kv: bool, tokens: int, inputs: str
) -> None:
    """With "exact_sums", x and the projections are small multiples of powers of two, so that q, k and
    their sums of squares are exact in float32 and the norm statistics cannot differ with the
    summation order: then the two routes agree bit for bit (on a GPU in every dtype; the
    interpreter's float32 -> bfloat16 cast truncates, its exp and rsqrt are numpy's). "random": all
    but rare last-place flips of the statistics' rounding, which attention then spreads over the output."""
    cfg = _config(head_dim)
    g = torch.Generator().manual_seed(head_dim + tokens)
    layer = Qwen3_5Attention(cfg, kv_layer=0, dtype=dtype, quant=None, prefix="model.layers.3.self_attn")
    exact = inputs == "exact_sums"
    for param in layer.parameters():
        if exact:  # {-1, 0, 1} / 8: the qkv outputs are multiples of 1/32, at most 4 in magnitude
            param.data.copy_(torch.randint(-1, 2, param.shape, generator=g) / 8)
        else:  # the norms' offsets from 1, the projections
            param.data.copy_(torch.randn(param.shape, generator=g) * (0.3 if param.dim() == 1 else 0.08))
    layer = layer.to(DEVICE)
    layer.attn.rope_stores_kv = rope_stores_kv
    rotary = MRotaryEmbedding.from_config(cfg, cfg.max_position_embeddings).to(DEVICE)
    positions = torch.stack([torch.arange(tokens) + 40, torch.arange(tokens) // 2 + 40, torch.arange(tokens) % 3 + 40])
    table = rotary.table(positions.to(DEVICE))  # an image's 3-axis positions: the axes differ
    if exact:
        x = (torch.randint(-1, 2, (tokens, cfg.hidden_size), generator=g) / 4).to(device=DEVICE, dtype=dtype)
    else:
        x = torch.randn(tokens, cfg.hidden_size, generator=g).to(device=DEVICE, dtype=dtype)
    loc = torch.randperm(3 * tokens + 4, generator=g)[:tokens].to(DEVICE)
    outs, caches = {}, {}
    calls: list[bool] = []
    real_rope = attention_mod.rope
    monkeypatch.setattr(attention_mod, "rope", lambda *a, **kw: calls.append(kw["zero_centred_norm"]) or real_rope(*a, **kw))
    for fused in (False, True):
        _route(monkeypatch, fused)
        step = PoolStep(3 * tokens + 4, cfg.num_key_value_heads, head_dim, dtype, loc)
        with torch.no_grad():
            outs[fused] = layer(table, x, step)
        caches[fused] = (step.k[loc], step.v[loc])
    assert calls == [True], "the fused route did not take the rope kernel"
    assert torch.equal(caches[True][1], caches[False][1])  # v: all D dims, unchanged
    pairs = ((outs[True], outs[False]), (caches[True][0], caches[False][0]))
    if exact and (on_gpu() or dtype == torch.float16):
        for got, want in pairs:
            assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} differ"
    elif dtype == torch.float32:
        for got, want in pairs:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        for got, want in pairs:
            torch.testing.assert_close(got, want, **close_tol(dtype))
        if dtype == torch.float16 or on_gpu():  # the K cache: rare flips
            k_got, k_want = pairs[1]
            assert (k_got != k_want).float().mean() <= 2e-3, f"{int((k_got != k_want).sum())} of {k_got.numel()} differ"


@pytest.mark.timeout(900)
def test_tiny_model_greedy_tokens_on_the_fused_route(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny long-memory Qwen3.5 (fp32) through the engine: the fused attention route's greedy tokens
    over chunked prefills, decodes and a radix hit equal the torch route's."""
    from mllmd import LLM, SamplingParams
    from tests.engine.test_qwen3_5 import build_long_memory_model, prompt

    model = build_long_memory_model(tmp_path / "q35")
    prompts = [prompt(1, 30), prompt(2, 9)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = {}
    kernels: list[str] = []
    real_rope, real_gate = attention_mod.rope, activation_mod.sigmoid_gate
    monkeypatch.setattr(attention_mod, "rope", lambda *a, **kw: kernels.append("rope") or real_rope(*a, **kw))
    monkeypatch.setattr(activation_mod, "sigmoid_gate", lambda *a: kernels.append("gate") or real_gate(*a))
    for fused in (False, True):
        _route(monkeypatch, fused)
        kernels.clear()
        llm = LLM(str(model), device=DEVICE, dtype="float32", chunked_prefill_size=16, max_total_tokens=2048)
        outs = llm.generate(prompts, params) + llm.generate([prompts[0][:20] + prompt(3, 5)], params)
        assert llm.engine.is_idle_and_clean()
        runs[fused] = [o.token_ids for o in outs]
        assert (kernels.count("rope") > 0 and kernels.count("rope") == kernels.count("gate")) == fused, kernels
    assert runs[True] == runs[False]
