"""The dense one-row GEMV's fusions as the fusion plan routes them (mllmd.models.layers.fusion): a norm
fused into the projection after it, SiLU-and-mul into the down projection, Qwen3.5's gated RMSNorm
into the DeltaNet out projection. Each fused layer's output is the unfused route's within bf16
rounding, the unfused launches no longer run, and more than one row keeps the unfused route. Under
the interpreter (TRITON_INTERPRET=1) the plan is told the Triton kernels run on the CPU tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mllmd_kernels.testing import REL_TOL, kernel_device, on_gpu, rel_err, skip_reason
from torch import nn

import mllmd.models.layers.dispatch as dispatch_mod
import mllmd.models.layers.fusion as fusion_mod
import mllmd.models.layers.gated_deltanet as gdn_mod
import mllmd.models.layers.linear as linear_mod
from mllmd.models.layers import GatedMLP, Linear, MergedLinear, RMSNorm, plan_fusions
from mllmd.models.layers.fused_inputs import GatedNormRows, NormRows, SiluRows
from mllmd.models.layers.norm import ZeroCentredRMSNorm

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())
DTYPE = torch.bfloat16


@pytest.fixture(autouse=True)
def triton_route(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The plan and the GEMV dispatch see the Triton kernels as usable (the interpreter's CPU tensors
    too); the returned list records every gemv_fused launch's prologue."""
    if not on_gpu():
        monkeypatch.setattr(dispatch_mod, "fused_kernels", lambda x: True)
        monkeypatch.setattr(fusion_mod, "fused_kernels", lambda x: True)
    launched: list[str] = []
    real = linear_mod.gemv_fused
    monkeypatch.setattr(linear_mod, "gemv_fused", lambda x, w, p, **kw: launched.append(p.kind) or real(x, w, p, **kw))
    return launched


def _fill(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        scale = p.shape[-1] ** -0.5 if p.dim() == 2 else 0.2
        value = torch.randn(p.shape, generator=g) * scale + (1.0 if name.endswith("norm.weight") else 0.0)
        p.data.copy_(value.to(p.dtype))
    return module.to(DEVICE)


class NormThenProj(nn.Module):
    """A norm feeding a merged projection, as a decoder layer's input norm feeds qkv."""

    def __init__(self, norm_cls: Any, hidden: int) -> None:
        super().__init__()
        self.norm = norm_cls(hidden, 1e-6, dtype=DTYPE)
        self.proj = MergedLinear(hidden, {"q": 96, "k": 32, "v": 32}, dtype=DTYPE)
        self.FUSABLE = {"norm": "proj"}

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.proj(self.norm(x)), x
        normed, residual = self.norm(x, residual)
        return self.proj(normed), residual


@pytest.mark.parametrize("norm_cls", [RMSNorm, ZeroCentredRMSNorm])
@pytest.mark.parametrize("with_residual", [False, True])
def test_a_norm_runs_in_the_projection_after_it(norm_cls: Any, with_residual: bool, triton_route: list[str]) -> None:
    hidden = 256
    block = _fill(NormThenProj(norm_cls, hidden), 3)
    g = torch.Generator().manual_seed(4)
    for rows in (1, 3):
        x = torch.randn(rows, hidden, generator=g).to(DTYPE).to(DEVICE)
        residual = torch.randn(rows, hidden, generator=g).to(DTYPE).to(DEVICE) if with_residual else None
        plan_fusions(block, gemv_fusions=False)
        assert block.norm.fused_into is None
        with torch.no_grad():
            want, want_res = block(x, residual)
        plan_fusions(block, gemv_fusions=True)
        assert block.norm.fused_into == (block.proj, False)
        triton_route.clear()
        with torch.no_grad():
            got, got_res = block(x, residual)
        assert triton_route == (["rmsnorm" if norm_cls is RMSNorm else "rmsnorm_zero_centred"] if rows == 1 else [])
        assert rel_err(got, want) < REL_TOL[DTYPE]
        if on_gpu():  # the next residual: x + residual rounded as the norm kernel rounds it
            assert torch.equal(got_res, want_res)
        else:  # (the interpreter rounds bf16 toward zero, torch's CPU route to nearest)
            assert rel_err(got_res, want_res) < REL_TOL[DTYPE]


def test_a_norm_is_not_fused_into_a_projection_with_a_bias() -> None:
    block = _fill(NormThenProj(RMSNorm, 64), 5)
    block.proj.bias = nn.Parameter(torch.zeros(160, dtype=DTYPE, device=DEVICE), requires_grad=False)
    plan_fusions(block, gemv_fusions=True)
    assert block.norm.fused_into is None


def test_silu_and_mul_runs_in_the_down_projection(triton_route: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import mllmd.models.layers.activation as activation_mod

    mlp = _fill(GatedMLP(128, 192, DTYPE), 7)
    plan_fusions(mlp, gemv_fusions=True)
    assert mlp.silu_in_down and not mlp.silu_in_gate_up
    g = torch.Generator().manual_seed(8)
    acts: list[int] = []
    real = activation_mod.SiluAndMul.forward
    monkeypatch.setattr(activation_mod.SiluAndMul, "forward", lambda self, h: acts.append(h.shape[0]) or real(self, h))
    for rows in (1, 4):
        x = torch.randn(rows, 128, generator=g).to(DTYPE).to(DEVICE)
        triton_route.clear(), acts.clear()
        with torch.no_grad():
            got = mlp(x)
            want = mlp.down_proj(activation_mod.SiluAndMul()(mlp.gate_up_proj(x)))
        assert triton_route == (["silu_mul"] if rows == 1 else [])
        assert acts == ([rows] if rows == 1 else [rows, rows]), "one row: no SiLU-and-mul launch of its own"
        assert rel_err(got, want) < REL_TOL[DTYPE]
    plan_fusions(mlp, gemv_fusions=False)
    assert not mlp.silu_in_down


def test_the_gated_norm_runs_in_the_deltanet_out_projection(triton_route: list[str]) -> None:
    """Linear takes GatedNormRows (what GatedDeltaNet hands out_proj on the planned route)."""
    from mllmd_kernels import gated_rmsnorm_ref

    heads, dv, hidden = 4, 64, 96
    out_proj = _fill(Linear(heads * dv, hidden, dtype=DTYPE), 9)
    g = torch.Generator().manual_seed(10)
    o = torch.randn(1, heads * dv, generator=g).to(DTYPE).to(DEVICE)
    z = torch.randn(1, heads * dv, generator=g).to(DTYPE).to(DEVICE)
    weight = (torch.randn(dv, generator=g) * 0.2 + 1).to(DTYPE).to(DEVICE)
    rows = GatedNormRows(o, z, weight, 1e-6, dv)
    assert out_proj.takes_rows(o, linear_mod.row_prologue(rows)[1])
    with torch.no_grad():
        got = out_proj(rows)
        want = out_proj(gated_rmsnorm_ref(o.view(1, heads, dv), z.view(1, heads, dv), weight, 1e-6).view(1, -1))
    assert triton_route == ["gated_rmsnorm"]
    assert rel_err(got, want) < REL_TOL[DTYPE]
    assert not out_proj.takes_rows(torch.cat([o, o]), linear_mod.row_prologue(rows)[1]), "two rows"


def test_the_plan_routes_a_qwen3_5_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3.5's layers name their consumers (the DeltaNet in_proj or the attention's qkv), and the
    plan fuses their zero-centred norms, the MLPs' activation and the DeltaNet gated norms."""
    from types import SimpleNamespace

    from mllmd.models.qwen3_5 import Qwen3_5DecoderLayer

    cfg = SimpleNamespace(
        hidden_size=64, intermediate_size=96, rms_norm_eps=1e-6, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=False,
        rope_parameters={"partial_rotary_factor": 0.25},
    )  # fmt: skip
    layers = nn.ModuleList([Qwen3_5DecoderLayer(cfg, i, 0, DTYPE, None, f"model.layers.{i}") for i in range(2)])
    plan_fusions(layers.to(DEVICE), gemv_fusions=True)
    linear, full = layers
    assert linear.input_layernorm.fused_into == (linear.linear_attn.in_proj, False)
    assert full.input_layernorm.fused_into == (full.self_attn.qkv_proj, False)
    assert all(layer.post_attention_layernorm.fused_into == (layer.mlp.gate_up_proj, False) for layer in layers)
    assert linear.linear_attn.norm_in_out_proj and all(layer.mlp.silu_in_down for layer in layers)
    assert isinstance(gdn_mod.GatedNormRows, type) and NormRows and SiluRows  # the types the routes hand on
