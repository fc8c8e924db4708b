"""Torch references of the quantized layers against compressed-tensors' own functions, and the kernel registry."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels.int8_gemm import _int_mm_works

from mllmd.models.layers import Linear, MergedLinear
from mllmd.models.quantization import LinearScheme, QuantLinearKernel, ops, register_kernel, select_kernel
from mllmd.models.quantization import kernels as kernels_mod

W8A8_SCHEME = LinearScheme("w8a8", 8, "channel", None, True)


@pytest.mark.parametrize(("rows", "cols"), [(4, 64), (3, 13), (16, 256)])
def test_int4_packing_matches_compressed_tensors(rows: int, cols: int) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    g = torch.Generator().manual_seed(rows * cols)
    q = torch.randint(-8, 8, (rows, cols), generator=g, dtype=torch.int8)
    packed = pack_to_int32(q, 4)
    assert torch.equal(ops.pack_int4(q), packed)
    assert torch.equal(ops.unpack_int4(packed, cols), q)
    # zero points are packed along the output dim
    packed0 = pack_to_int32(q, 4, packed_dim=0)
    assert torch.equal(ops.unpack_int4(packed0.t().contiguous(), rows).t(), q)
    assert torch.equal(unpack_from_int32(packed, 4, q.shape), q)


def test_per_token_quant_matches_compressed_tensors_fake_quant() -> None:
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = preset_name_to_scheme("W8A8", ["Linear"]).input_activations
    x = torch.randn(1, 9, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 9).view(1, 9, 1)
    x[0, 4] = 0.0  # an all-zero token gets the eps scale, as in compressed-tensors
    x[0, 5, 7] = x[0, 5].abs().max() * 1.0  # the positive extreme clamps to 127
    scale, zp = compute_dynamic_scales_and_zp(x, args, module=torch.nn.Module())
    expected = fake_quantize(x, scale, zp, args)
    q, s = ops.per_token_quant_int8(x[0])
    assert q.dtype == torch.int8 and int(q.max()) <= 127 and int(q.min()) >= -128
    assert torch.equal(s, scale[0].float())
    assert torch.equal(q.float() * s, expected[0])


@pytest.mark.parametrize("m", [1, 5, 16, 17, 64])
@pytest.mark.parametrize("use_int_mm", [True, False])
def test_int8_mm_is_exact(m: int, use_int_mm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not use_int_mm:
        monkeypatch.setitem(_int_mm_works, "cpu", False)
    elif not ops.int_mm_available(torch.device("cpu")):
        pytest.skip("torch._int_mm is not available on this CPU build")
    g = torch.Generator().manual_seed(m)
    a = torch.randint(-128, 128, (m, 200), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (24, 200), generator=g, dtype=torch.int8)
    out = ops.int8_mm(a, b)
    assert out.dtype == torch.int32
    assert torch.equal(out.long(), a.long() @ b.long().t())


def test_w8a8_linear_equals_fake_quantized_float_linear() -> None:
    """int8 GEMM with int32 accumulation == float linear of the dequantized activations and weights."""
    g = torch.Generator().manual_seed(3)
    w = torch.randint(-128, 128, (48, 64), generator=g, dtype=torch.int8)
    w_scale = torch.rand(48, 1, generator=g) * 0.01 + 1e-3
    x = torch.randn(7, 64, generator=g, dtype=torch.float64).float()
    bias = torch.randn(48, generator=g)
    out = ops.w8a8_linear_ref(x, w, w_scale, bias)
    q, s = ops.per_token_quant_int8(x)
    ref = (q.double() * s.double()) @ (w.double() * w_scale.double()).t() + bias.double()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)


def test_empty_batch() -> None:
    layer = Linear(32, 16, quant=W8A8_SCHEME)
    layer.load_weight("weight", torch.ones(16, 32, dtype=torch.int8))
    layer.load_weight("weight_scale", torch.ones(16, 1))
    layer.process_weights_after_loading()
    assert layer(torch.zeros(0, 32)).shape == (0, 16)


def test_fused_w4a16_layer_keeps_each_shards_scales_and_zero_points() -> None:
    """Two shards with their own packed weights, group scales and (packed) zero points."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    scheme = LinearScheme("w4a16", 4, "group", 32, False)
    layer = MergedLinear(64, {"gate": 16, "up": 24}, quant=scheme)
    g = torch.Generator().manual_seed(5)
    expected = []
    for shard, rows in (("gate", 16), ("up", 24)):
        q = torch.randint(-8, 8, (rows, 64), generator=g, dtype=torch.int8)
        scale = torch.rand(rows, 2, generator=g) + 0.5
        zp = torch.randint(-8, 8, (rows, 2), generator=g, dtype=torch.int8)
        layer.load_shard("weight_packed", shard, pack_to_int32(q, 4))
        layer.load_shard("weight_scale", shard, scale)
        layer.load_shard("weight_zero_point", shard, pack_to_int32(zp, 4, packed_dim=0))
        assert layer.load_shard("weight_shape", shard, torch.tensor([rows, 64])) is False
        expected.append(((q.view(rows, 2, 32).float() - zp.float().unsqueeze(-1)) * scale.unsqueeze(-1)).view(rows, 64))
    layer.process_weights_after_loading()
    assert torch.equal(layer.weight_dequant, torch.cat(expected))
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(layer(x), x @ torch.cat(expected).t())
    with pytest.raises(ValueError, match="weight_shape"):
        layer.load_shard("weight_shape", "up", torch.tensor([16, 64]))
    with pytest.raises(ValueError, match="unexpected tensor 'weight_g_idx'"):
        layer.load_shard("weight_g_idx", "up", torch.zeros(64, dtype=torch.int32))


def test_a_registered_kernel_is_preferred_where_it_can_run() -> None:
    calls = []

    class FakeGpuW8A8(QuantLinearKernel):
        @classmethod
        def can_implement(cls, scheme: LinearScheme, device: torch.device) -> str | None:
            return None if scheme.method == "w8a8" and device.type == "cpu" else "fake: cpu w8a8 only"

        def process_weights(self, layer: Linear) -> None:
            calls.append("process")

        def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            calls.append("apply")
            return ops.w8a8_linear_ref(x, layer.weight, layer.weight_scale, bias)

    register_kernel(FakeGpuW8A8)
    try:
        assert isinstance(select_kernel(W8A8_SCHEME, torch.device("cpu")), FakeGpuW8A8)
        w4 = LinearScheme("w4a16", 4, "group", 128, True)
        assert isinstance(select_kernel(w4, torch.device("cpu")), kernels_mod.TorchW4A16Kernel)
        layer = Linear(32, 8, quant=W8A8_SCHEME)
        layer.load_weight("weight", torch.ones(8, 32, dtype=torch.int8))
        layer.load_weight("weight_scale", torch.full((8, 1), 0.5))
        layer.process_weights_after_loading()
        layer(torch.ones(2, 32))
        assert calls == ["process", "apply"]
    finally:
        kernels_mod.unregister_kernel(FakeGpuW8A8)
    assert isinstance(select_kernel(W8A8_SCHEME, torch.device("cpu")), kernels_mod.TorchW8A8Kernel)


def test_norm_and_silu_fusion_routes_and_fallbacks() -> None:
    """A kernel that fuses (here a CPU stand-in for the W4A16 CUDA kernel) gets the RMSNorm and
    silu(gate) * up from a norm planned into it (NormRows) and writes the residual sum; where it
    cannot (`fusable` is False: several rows here), the norm runs on its own and the activation
    apart. Either way the results and the residual equal the unfused modules'."""
    from mllmd_kernels.rmsnorm import NormInput

    from mllmd.models.layers import GatedMLP, RMSNorm, SiluAndMul, plan_fusions
    from mllmd.models.layers.fused_inputs import NormRows

    calls: list[tuple[bool, bool]] = []

    class FakeFusingW4A16(kernels_mod.TorchW4A16Kernel):
        fuses_norm = fuses_silu_mul = True

        @classmethod
        def can_implement(cls, scheme: LinearScheme, device: torch.device) -> str | None:
            return None if scheme.method == "w4a16" else "fake: w4a16 only"

        def fusable(self, layer: Linear, x: torch.Tensor, norm: NormInput | None, silu: bool) -> bool:
            return x.shape[0] == 1

        def apply_fused(
            self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None, norm: NormInput | None, silu: bool
        ) -> torch.Tensor | None:
            if not self.fusable(layer, x, norm, silu):
                return None
            calls.append((norm is not None, silu))
            if norm is not None:
                s = x if norm.residual is None else x + norm.residual
                if norm.residual_out is not None:
                    norm.residual_out.copy_(s)
                xf = s.float()
                x = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).to(s.dtype)
            y = self.apply(layer, x, bias)
            return SiluAndMul()(y) if silu else y

    class Block(torch.nn.Module):
        FUSABLE = {"norm": "mlp.gate_up_proj"}

        def __init__(self) -> None:
            super().__init__()
            self.norm = RMSNorm(64)
            self.mlp = GatedMLP(64, 32, torch.float32, quant=None)

    def w4a16(layer: Linear, shards: list[str | None], g: torch.Generator) -> Linear:
        n, k = layer.out_features // len(shards), layer.in_features
        for shard in shards:
            layer.load_weight("weight_packed", torch.randint(-(2**31), 2**31 - 1, (n, k // 8), generator=g,
                                                             dtype=torch.int32), shard)
            layer.load_weight("weight_scale", torch.rand(n, k // 32, generator=g) + 0.5, shard)
        layer.process_weights_after_loading()
        return layer

    scheme = LinearScheme("w4a16", 4, "group", 32, True)
    register_kernel(FakeFusingW4A16)
    try:
        block = Block()
        g = torch.Generator().manual_seed(8)
        block.mlp.gate_up_proj = w4a16(MergedLinear(64, {"gate": 32, "up": 32}, quant=scheme), ["gate", "up"], g)
        block.mlp.down_proj = w4a16(Linear(32, 64, quant=scheme), [None], g)
        block.norm.weight.data.copy_(torch.rand(64, generator=g) + 0.5)
        plan_fusions(block, w4a16_fusions=True)
        assert block.norm.fused_into == (block.mlp.gate_up_proj, True) and block.mlp.silu_in_gate_up
        plain_norm = RMSNorm(64)
        plain_norm.weight.data.copy_(block.norm.weight)
        gate_up, down = block.mlp.gate_up_proj, block.mlp.down_proj
        for rows, fused in ((1, True), (3, False)):
            x, r = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)
            normed, res = plain_norm(x, r)
            calls.clear()
            pending, residual = block.norm(x, r)
            assert isinstance(pending, NormRows) == fused
            out = block.mlp(pending)
            assert calls == ([(True, True)] if fused else [])
            torch.testing.assert_close(out, down(SiluAndMul()(gate_up(normed))))
            assert torch.equal(residual, res)
        first = block.norm(x[:1])  # the first layer: no residual yet; x is the next one
        assert isinstance(first, NormRows) and first.residual_out is first.x
        calls.clear()
        torch.testing.assert_close(block.mlp(first), down(SiluAndMul()(gate_up(plain_norm(x[:1])))))
        assert calls == [(True, True)]
        plan_fusions(block, w4a16_fusions=False)  # MLLMD_W4A16_FUSIONS=0: everything apart
        assert block.norm.fused_into is None and not block.mlp.silu_in_gate_up
    finally:
        kernels_mod.unregister_kernel(FakeFusingW4A16)
