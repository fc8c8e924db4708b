"""A whole Qwen3.5 Gated DeltaNet layer built from these ops, as the engine will call them (pooled conv
and recurrent states by slot: a prefill in two chunks, the second beside another request, then
decode steps with a padded row), against transformers' Qwen3_5GatedDeltaNet over the whole sequence
at once. Once with the torch references (always) and once with the Triton kernels."""

from __future__ import annotations

from collections.abc import Callable

import mllmd_kernels as mk
import pytest
import torch
from mllmd_kernels.testing import kernel_device, rel_err, skip_reason

DEVICE = kernel_device()
K = 4


def _layer(dtype: torch.dtype):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg = Qwen3_5TextConfig(
        hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=32, linear_conv_kernel_dim=K, num_hidden_layers=1, layer_types=["linear_attention"],
        rms_norm_eps=1e-6, hidden_act="silu",
    )  # fmt: skip
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(cfg, 0)
    with torch.no_grad():
        layer.A_log.copy_(torch.empty(4).uniform_(0.001, 0.05).log())  # long memory (real checkpoints have it)
        layer.dt_bias.copy_(torch.randn(4) * 0.5)
        layer.norm.weight.copy_(torch.randn(32) * 0.1 + 1)
    return layer.to(dtype).eval()


OPS_REF = {
    "conv_prefill": mk.causal_conv1d_prefill_ref, "conv_decode": mk.causal_conv1d_decode_ref,
    "chunk": mk.chunk_gated_delta_rule_ref, "decode": mk.fused_gdn_gating_decode_ref, "norm": mk.gated_rmsnorm_ref,
}  # fmt: skip
OPS_TRITON = {
    "conv_prefill": mk.causal_conv1d_prefill, "conv_decode": mk.causal_conv1d_decode,
    "chunk": mk.chunk_gated_delta_rule, "decode": mk.fused_gdn_gating_decode, "norm": mk.gated_rmsnorm,
}  # fmt: skip


def _forward(layer, ops: dict[str, Callable], x, conv_pool, ssm_pool, slots, cu=None, init=None) -> torch.Tensor:
    """The layer on tokens x [T, hidden]: a varlen prefill (cu, init) or one decode token a row (cu None)."""
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    t = x.shape[0]
    mixed = layer.in_proj_qkv(x)  # [T, conv_dim]
    z = layer.in_proj_z(x).view(t, hv, dv)
    a, b = layer.in_proj_a(x), layer.in_proj_b(x)  # [T, Hv]
    w = layer.conv1d.weight.squeeze(1)  # [conv_dim, K]
    if cu is not None:
        y = ops["conv_prefill"](mixed, w, None, cu, conv_pool, slots, init)
    else:
        y = ops["conv_decode"](mixed, w, None, conv_pool, slots)
    q = y[:, : hk * dk].view(t, hk, dk)  # strided views of the conv output, as the model takes them
    k = y[:, hk * dk : 2 * hk * dk].view(t, hk, dk)
    v = y[:, 2 * hk * dk :].view(t, hv, dv)
    if cu is not None:
        g, beta = mk.gdn_gating_ref(a, b, layer.A_log, layer.dt_bias)
        o = ops["chunk"](q, k, v, g, beta, None, ssm_pool, slots, init, cu)
    else:
        o = ops["decode"](q, k, v, a, b, layer.A_log, layer.dt_bias, None, ssm_pool, slots)
    return layer.out_proj(ops["norm"](o, z, layer.norm.weight, layer.norm.variance_epsilon).reshape(t, hv * dv))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_layer_in_chunks_and_steps_equals_transformers_in_one_pass(backend: str, dtype: torch.dtype) -> None:
    if backend == "triton" and DEVICE is None:
        pytest.skip(skip_reason())
    device = "cpu" if backend == "torch" else DEVICE
    ops = OPS_REF if backend == "torch" else OPS_TRITON
    layer = _layer(dtype)
    g = torch.Generator().manual_seed(1)
    length, split, prefill = 100, 37, 90  # chunks [0, 37) and [37, 90), then 10 decode steps
    x = (torch.randn(1, length, 64, generator=g) * 0.5).to(dtype)
    other = (torch.randn(20, 64, generator=g) * 0.5).to(dtype)
    with torch.no_grad():
        expect = layer(x)[0]  # transformers: the whole sequence, no cache
        layer = layer.to(device)
        x, other = x[0].to(device), other.to(device)
        conv_pool = torch.randn(4, layer.conv_dim, K - 1, generator=g).to(dtype=dtype, device=device)
        ssm_pool = torch.randn(4, 4, 16, 32, generator=g).to(device)  # garbage: never read without a state
        before = (conv_pool[3].clone(), ssm_pool[3].clone())
        i32 = {"dtype": torch.int32, "device": device}
        slot, slot_other = torch.tensor([2], device=device), torch.tensor([2, 1], device=device)
        outs = [_forward(layer, ops, x[:split], conv_pool, ssm_pool, slot, torch.tensor([0, split], **i32),
                         torch.tensor([False], device=device))]  # fmt: skip
        mixed = _forward(layer, ops, torch.cat([x[split:prefill], other]), conv_pool, ssm_pool, slot_other,
                         torch.tensor([0, prefill - split, prefill - split + 20], **i32),
                         torch.tensor([True, False], device=device))  # fmt: skip
        outs.append(mixed[: prefill - split])
        padded = torch.tensor([2, 0], device=device)  # a CUDA-graph batch of 2: one real row, one padded
        for t in range(prefill, length):
            step = torch.stack([x[t], torch.zeros_like(x[t])])
            outs.append(_forward(layer, ops, step, conv_pool, ssm_pool, padded)[:1])
    got = torch.cat(outs).cpu()
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert rel_err(got, expect) < tol, rel_err(got, expect)
    assert torch.equal(conv_pool[3], before[0]) and torch.equal(ssm_pool[3], before[1]), "an unnamed slot changed"
