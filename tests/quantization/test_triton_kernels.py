"""The Triton kernels of quantized Linear layers (TritonW8A8Kernel, TritonW4A16Kernel) against the torch
reference kernels, on the same layers: random ones packed by compressed-tensors and layer 0 of the
tiny checkpoints compressed-tensors quantized. Runs on CUDA, or on the CPU under TRITON_INTERPRET=1
(the kernels are then launched directly: on the CPU `select_kernel` keeps the references)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from mllmd_kernels import (
    dequantize_int4_ref,
    int8_quant_ref,
    pack_int4_ref,
    silu_and_mul,
    unpack_int4_ref,
)
from mllmd_kernels import w4a16_mma as mma
from mllmd_kernels.testing import REL_TOL, close_tol, kernel_device, on_gpu, rel_err, skip_reason

from mllmd.models.layers import Linear, MergedLinear, SiluAndMul
from mllmd.models.layers.fused_inputs import Int8Rows
from mllmd.models.quantization import (
    CudaW4A16Kernel,
    LinearScheme,
    QuantLinearKernel,
    TritonW4A16Kernel,
    TritonW8A8Kernel,
    get_linear_scheme,
    ops,
    parse_quant_config,
    select_kernel,
)
from mllmd.models.quantization.kernels import TorchW4A16Kernel, TorchW8A8Kernel

DEVICE = kernel_device()
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

W8A8_CHANNEL = LinearScheme("w8a8", 8, "channel", None, True)
W4A16_SCHEMES = {
    "g128": LinearScheme("w4a16", 4, "group", 128, True),
    "g64": LinearScheme("w4a16", 4, "group", 64, True),
    "g32_asym": LinearScheme("w4a16", 4, "group", 32, False),
    "channel_asym": LinearScheme("w4a16", 4, "channel", None, False),
}
_REFERENCE = {"w8a8": TorchW8A8Kernel, "w4a16": TorchW4A16Kernel}
_TRITON = {"w8a8": TritonW8A8Kernel, "w4a16": TritonW4A16Kernel}


def test_cpu_keeps_the_reference_kernels() -> None:
    cpu = torch.device("cpu")
    assert type(select_kernel(W8A8_CHANNEL, cpu)) is TorchW8A8Kernel
    for scheme in W4A16_SCHEMES.values():
        assert type(select_kernel(scheme, cpu)) is TorchW4A16Kernel
    assert "CUDA" in TritonW8A8Kernel.can_implement(W8A8_CHANNEL, cpu)
    assert TritonW8A8Kernel.can_implement(W4A16_SCHEMES["g128"], cpu) is not None
    assert TritonW4A16Kernel.can_implement(W8A8_CHANNEL, cpu) is not None
    odd_group = LinearScheme("w4a16", 4, "group", 40, True)
    assert "multiple of 16" in TritonW4A16Kernel.can_implement(odd_group, torch.device("cuda"))


@pytest.mark.skipif(not on_gpu(), reason="needs CUDA + triton")
def test_cuda_prefers_the_triton_kernels() -> None:
    cuda = torch.device("cuda")
    assert type(select_kernel(W8A8_CHANNEL, cuda)) is TritonW8A8Kernel
    # W4A16: the CUDA decode kernel where nvcc builds it (a TritonW4A16Kernel for larger batches)
    w4a16 = TritonW4A16Kernel if mma.unavailable_reason(cuda) else CudaW4A16Kernel
    for scheme in W4A16_SCHEMES.values():
        assert type(select_kernel(scheme, cuda)) is w4a16


def test_kernel_library_references_equal_ops() -> None:
    """mllmd_kernels' torch references compute exactly what mllmd's ops (the CPU path) compute."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 200, generator=g) * torch.logspace(-3, 2, 7).view(7, 1)
    x[3] = 0.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, s = int8_quant_ref(x.to(dtype))
        q_ops, s_ops = ops.per_token_quant_int8(x.to(dtype))
        assert torch.equal(q, q_ops) and torch.equal(s, s_ops)
    q4 = torch.randint(-8, 8, (12, 196), generator=g, dtype=torch.int8)
    packed = pack_int4_ref(q4)
    assert torch.equal(packed, ops.pack_int4(q4)) and torch.equal(unpack_int4_ref(packed, 196), q4)
    q4 = q4[:, :192]
    packed = ops.pack_int4(q4)
    scale, zp = torch.rand(12, 6, generator=g), torch.randint(-8, 8, (12, 6), generator=g, dtype=torch.int8)
    for z in (zp, None):
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(
                dequantize_int4_ref(packed, scale, z, 192, dtype),
                ops.dequantize_int4(packed, scale, z, 192, dtype),
            )


def _prepare(layer: Linear, kernel_cls: type[QuantLinearKernel]) -> Linear:
    """Put `layer` (loaded) on the kernel device with `kernel_cls` as its kernel, whatever select_kernel picks."""
    layer.to(DEVICE)
    assert layer.quant_method is not None
    kernel = kernel_cls(layer.quant_method.scheme)
    kernel.process_weights(layer)
    layer.quant_method.kernel = kernel
    return layer


def _param_bytes(layer: Linear) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(p.shape), p.dtype) for name, p in layer.named_parameters()}


def _random_layer(
    scheme: LinearScheme, k: int, shards: dict[str, int], bias: bool, dtype: torch.dtype, seed: int
) -> Linear:
    """A layer whose shards hold random weights in the checkpoint's own format (compressed-tensors packs the int4)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(seed)
    layer = (
        MergedLinear(k, shards, bias=bias, dtype=dtype, quant=scheme)
        if len(shards) > 1
        else Linear(k, sum(shards.values()), bias=bias, dtype=dtype, quant=scheme)
    )
    for shard, rows in shards.items():
        name = shard if len(shards) > 1 else None
        if scheme.method == "w8a8":
            layer.load_weight(
                "weight", torch.randint(-128, 128, (rows, k), generator=g, dtype=torch.int8), name
            )
            layer.load_weight("weight_scale", torch.rand(rows, 1, generator=g) * 0.01 / k**0.5 + 1e-4, name)
        else:
            groups = scheme.num_groups(k)
            q = torch.randint(-8, 8, (rows, k), generator=g, dtype=torch.int8)
            layer.load_weight("weight_packed", pack_to_int32(q, 4), name)
            layer.load_weight(
                "weight_scale", torch.rand(rows, groups, generator=g) * 0.05 / k**0.5 + 1e-4, name
            )
            if not scheme.symmetric:
                zp = torch.randint(-8, 8, (rows, groups), generator=g, dtype=torch.int8)
                layer.load_weight("weight_zero_point", pack_to_int32(zp, 4, packed_dim=0), name)
    if bias:
        layer.load_weight("bias", torch.randn(layer.out_features, generator=g).to(dtype))
    return layer


def _compare(
    make: Any, method: str, dtype: torch.dtype, k: int, tokens: tuple[int, ...], kernel: Any = None
) -> None:
    ref_layer = _prepare(make(), _REFERENCE[method])
    layer = make()
    before = _param_bytes(layer)
    _prepare(layer, kernel or _TRITON[method])
    assert _param_bytes(layer) == before, "the Triton kernel changed what the layer stores"
    g = torch.Generator().manual_seed(sum(tokens))
    for t in tokens:
        x = torch.randn(t, k, generator=g).to(dtype=dtype, device=DEVICE)
        with torch.no_grad():
            out, ref = layer(x), ref_layer(x)
        assert out.shape == ref.shape and out.dtype == ref.dtype == dtype
        if method == "w8a8":  # same int8 activations, exact int32 sums, same epilogue
            torch.testing.assert_close(out, ref, **close_tol(dtype))
        else:  # same dequantized weights; summation order and roundings differ
            assert rel_err(out, ref) < REL_TOL[dtype], f"T={t}"
    x3 = torch.randn(2, 3, k, generator=g).to(dtype=dtype, device=DEVICE)  # leading dims are flattened
    with torch.no_grad():
        assert layer(x3).shape == (2, 3, layer.out_features)
        assert rel_err(layer(x3), ref_layer(x3)) < REL_TOL[dtype]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["w8a8", *W4A16_SCHEMES])
def test_triton_kernel_equals_reference_kernel(variant: str, dtype: torch.dtype) -> None:
    pytest.importorskip("compressed_tensors")
    scheme = W8A8_CHANNEL if variant == "w8a8" else W4A16_SCHEMES[variant]
    k = 256
    fused = {"gate": 40, "up": 24}
    _compare(lambda: _random_layer(scheme, k, fused, False, dtype, 1), scheme.method, dtype, k, (1, 5, 70))
    _compare(lambda: _random_layer(scheme, k, {"o": 24}, True, dtype, 2), scheme.method, dtype, k, (1, 3, 260))  # 260 rows: the dequantize + matmul path


@pytest.mark.skipif(
    not torch.cuda.is_available() or mma.unavailable_reason(torch.device("cuda")) is not None,
    reason="needs CUDA and the w4a16_mma library (nvcc)",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", list(W4A16_SCHEMES))
def test_cuda_w4a16_kernel_equals_reference_kernel(variant: str, dtype: torch.dtype, monkeypatch: Any) -> None:
    """CudaW4A16Kernel: up to 32 rows on w4a16_mma (counted), more on the Triton paths; the o layer of
    N = 24 is not a whole number of 16-row tiles, so all its rows take the Triton paths."""
    pytest.importorskip("compressed_tensors")
    scheme, k = W4A16_SCHEMES[variant], 256
    calls: list[int] = []
    real = mma.w4a16_mma
    monkeypatch.setattr(mma, "w4a16_mma", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    fused = {"gate": 40, "up": 24}
    _compare(lambda: _random_layer(scheme, k, fused, False, dtype, 1), "w4a16", dtype, k, (1, 5, 8, 9, 32, 33, 70),
             CudaW4A16Kernel)  # fmt: skip
    assert calls == [1, 5, 8, 9, 32, 6, 6], calls  # 33 and 70 rows on Triton; the [2, 3, K] input is 6 rows
    calls.clear()
    _compare(lambda: _random_layer(scheme, k, {"o": 32}, True, dtype, 2), "w4a16", dtype, k, (1, 3), CudaW4A16Kernel)
    assert calls == [1, 3, 6, 6], calls
    calls.clear()
    _compare(lambda: _random_layer(scheme, k, {"o": 24}, True, dtype, 2), "w4a16", dtype, k, (1, 3), CudaW4A16Kernel)
    assert calls == []


@needs_kernels
@pytest.mark.parametrize("variant", ["g128", "channel_asym"])
def test_w4a16_kernel_keeps_float32_scales(variant: str) -> None:
    """Scales a bf16 checkpoint stored in bf16 (widened to float32 as loaded) stay float32 on the layer,
    column-major: the one-row gemv is faster with 4-byte scales (see SCALE_DTYPES)."""
    scheme, k = W4A16_SCHEMES[variant], 256
    layer = _random_layer(scheme, k, {"gate": 40, "up": 24}, False, torch.bfloat16, 3)
    loaded = layer.weight_scale.data.to(torch.bfloat16).float()  # as loaded from bf16
    layer.weight_scale.data = loaded.clone()
    _prepare(layer, TritonW4A16Kernel)
    assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.stride(0) == 1
    assert torch.equal(layer.weight_scale.cpu(), loaded)


@needs_kernels
@pytest.mark.parametrize("variant", ["g128", "channel_asym"])
def test_w4a16_layer_takes_the_nibble_planes_where_its_scales_are_values_of_its_dtype(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint's bf16 scales (exact in the layer's dtype) let the tensor-core tilings dequantize
    from the nibble planes, with the float32 path's outputs bit for bit; scales that bf16 cannot hold
    keep the float32 path."""
    monkeypatch.delenv("MLLMD_W4A16_PLANES", raising=False)
    scheme, k = W4A16_SCHEMES[variant], 256
    layer = _random_layer(scheme, k, {"gate": 40, "up": 24}, False, torch.bfloat16, 4)
    wide = layer.weight_scale.data.clone()
    layer.weight_scale.data = wide.to(torch.bfloat16).float()
    _prepare(layer, TritonW4A16Kernel)
    assert layer.quant_method is not None
    kernel = layer.quant_method.kernel
    assert isinstance(kernel, TritonW4A16Kernel) and kernel.exact_scales
    g = torch.Generator().manual_seed(4)
    for rows in (5, 70):
        x = torch.randn(rows, k, generator=g).to(dtype=torch.bfloat16, device=DEVICE)
        planes = layer(x)
        kernel.exact_scales = False
        assert torch.equal(planes, layer(x)), rows
        kernel.exact_scales = True
    other = _random_layer(scheme, k, {"gate": 40, "up": 24}, False, torch.bfloat16, 4)
    other.weight_scale.data = wide + 2.0**-30  # not a bf16 value
    _prepare(other, TritonW4A16Kernel)
    assert other.quant_method is not None and not other.quant_method.kernel.exact_scales


def _checkpoint_layer(
    model_dir: Any, prefix: str, shards: dict[str, int], k: int, dtype: torch.dtype
) -> Linear:
    from safetensors import safe_open

    qc = parse_quant_config(json.loads((model_dir / "config.json").read_text()))
    scheme = get_linear_scheme(qc, *(f"{prefix}.{s}" for s in shards))
    assert scheme is not None
    layer = MergedLinear(k, shards, dtype=dtype, quant=scheme)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for shard in shards:
            for key in f.keys():
                if key.startswith(f"{prefix}.{shard}."):
                    layer.load_shard(key.rsplit(".", 1)[1], shard, f.get_tensor(key))
    return layer


@needs_kernels
@pytest.mark.parametrize("variant", ["w8a8", "w4a16_g32_asym"])
def test_triton_kernel_on_a_compressed_tensors_checkpoint(quantized: Any, variant: str) -> None:
    """Layer 0's fused QKV and gate/up projections as compressed-tensors wrote them (tiny Qwen3)."""
    pytest.importorskip("compressed_tensors")
    model_dir = quantized(variant)
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    qkv = {
        "q_proj": cfg["num_attention_heads"] * hd,
        "k_proj": cfg["num_key_value_heads"] * hd,
        "v_proj": cfg["num_key_value_heads"] * hd,
    }
    method = "w8a8" if variant == "w8a8" else "w4a16"
    for prefix, shards in (
        ("model.layers.0.self_attn", qkv),
        ("model.layers.0.mlp", {"gate_proj": inter, "up_proj": inter}),
    ):
        _compare(
            lambda p=prefix, s=shards: _checkpoint_layer(model_dir, p, s, hidden, torch.bfloat16),
            method,
            torch.bfloat16,
            hidden,
            (1, 7, 80),
        )


@pytest.mark.skipif(not on_gpu(), reason="needs CUDA + triton")
@pytest.mark.parametrize("variant", ["w8a8", "g128", "g32_asym"])
def test_triton_kernel_apply_is_cuda_graph_capturable(variant: str) -> None:
    """apply() does not synchronise with the host: it captures into a CUDA graph and replays correctly."""
    pytest.importorskip("compressed_tensors")
    scheme = W8A8_CHANNEL if variant == "w8a8" else W4A16_SCHEMES[variant]
    layer = _prepare(
        _random_layer(scheme, 4096, {"gate": 512, "up": 512}, False, torch.bfloat16, 3),
        _TRITON[scheme.method],
    )
    for t in (1, 16, 300):
        x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            eager = layer(x)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                layer(x)  # warm up outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = layer(x)
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, layer(x)) and not torch.equal(out, eager)


def _w8a8_mlp(dtype: torch.dtype) -> tuple[Any, int, int]:
    """A GatedMLP of random W8A8 layers on the Triton kernel, its fusions planned: (mlp, hidden, intermediate)."""
    from mllmd.models.layers import GatedMLP, plan_fusions

    pytest.importorskip("compressed_tensors")
    hidden, inter = 96, 160
    mlp = GatedMLP(hidden, inter, dtype)
    mlp.gate_up_proj = _prepare(_random_layer(W8A8_CHANNEL, hidden, {"gate": inter, "up": inter}, False, dtype, 1),
                                TritonW8A8Kernel)
    mlp.down_proj = _prepare(_random_layer(W8A8_CHANNEL, inter, {"down": hidden}, False, dtype, 2), TritonW8A8Kernel)
    plan_fusions(mlp)
    assert mlp.int8_activation
    return mlp, hidden, inter


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a8_mlp_one_row_activates_in_the_gate_up_gemv(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """One row of int8 rows (what rmsnorm_int8 hands the MLP at batch-1 decode): the gate/up gemv
    applies silu(gate) * up in its epilogue and writes max|output| partials, from which the down
    gemv takes its scale; the MLP's output equals, bit for bit, the route that stores the gate/up
    row and activates it in its own launch; several rows keep that route."""
    from mllmd_kernels import int8_quant

    import mllmd.models.quantization.triton_kernels as tk_mod

    calls, down_parts = [], []
    real, real_linear = tk_mod.int8_gemm_silu_mul_amax, tk_mod.w8a8_linear
    monkeypatch.setattr(tk_mod, "int8_gemm_silu_mul_amax",
                        lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))  # fmt: skip
    monkeypatch.setattr(tk_mod, "w8a8_linear",
                        lambda x, *a, **kw: down_parts.append(kw.get("amax_parts") is not None) or real_linear(x, *a, **kw))  # fmt: skip
    mlp, hidden, inter = _w8a8_mlp(dtype)
    g = torch.Generator().manual_seed(6)
    for t in (1, 3):
        x = Int8Rows(*int8_quant(torch.randn(t, hidden, generator=g).to(dtype=dtype, device=DEVICE)), dtype)
        with torch.no_grad():
            fused = mlp(x)
            plain = mlp.down_proj(silu_and_mul(mlp.gate_up_proj(x)))
        assert fused.shape == (t, hidden) and fused.dtype == dtype
        assert torch.equal(fused, plain), f"T={t}: {int((fused != plain).sum())} values differ"
    assert calls == [1], calls
    assert down_parts[0] is True, "the one-row down gemv takes the gate/up gemv's partials"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a8_mlp_quantizes_in_the_activation_kernel(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the Triton W8A8 kernel the MLP hands its down projection silu_and_mul_int8's int8 rows
    (one launch instead of two) for several rows, and for one row the activation in the data type
    (the one-row gemv quantizes it): the same output, bit for bit, as activating then quantizing in
    the layer either way; the reference kernel keeps the plain path."""
    import mllmd.models.layers.activation as act_mod
    import mllmd.models.layers.mlp as mlp_mod

    monkeypatch.setattr(act_mod, "fused_kernels", lambda x: True)  # Triton's SiLU on the CPU too
    calls = []
    real = mlp_mod.silu_and_mul_int8
    monkeypatch.setattr(mlp_mod, "silu_and_mul_int8", lambda h: calls.append(h.shape[0]) or real(h))

    mlp, hidden, inter = _w8a8_mlp(dtype)
    g = torch.Generator().manual_seed(4)
    for t in (1, 5, 70):
        x = torch.randn(t, hidden, generator=g).to(dtype=dtype, device=DEVICE)
        with torch.no_grad():
            fused = mlp(x)
            plain = mlp.down_proj(silu_and_mul(mlp.gate_up_proj(x)))  # int8_quant inside the layer
        assert fused.shape == (t, hidden) and fused.dtype == dtype
        assert torch.equal(fused, plain), f"T={t}: {int((fused != plain).sum())} values differ"
    assert calls == [5, 70], calls
    ref = _prepare(_random_layer(W8A8_CHANNEL, inter, {"down": hidden}, False, dtype, 2), TorchW8A8Kernel)
    assert not ref.kernel.takes_int8_input


@needs_kernels
def test_w8a8_model_takes_int8_rows_from_its_norms_and_activation(quantized: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny W8A8 Qwen3 on the Triton kernels: a prefill of several rows routes every qkv and gate/up
    projection through rmsnorm_int8 and every down projection through silu_and_mul_int8, and its logits
    equal, bit for bit, those of the route that quantizes inside each layer; greedy decoding (one row
    a step) gives that route's tokens and top log-probabilities, bit for bit."""
    pytest.importorskip("compressed_tensors")
    import mllmd.models.layers.activation as act_mod
    import mllmd.models.layers.fusion as fusion_mod
    import mllmd.models.layers.mlp as mlp_mod
    import mllmd.models.layers.norm as norm_mod
    from mllmd import LLM, SamplingParams
    from mllmd.models.layers import plan_fusions

    from .test_numerics import engine_prefill_logits

    # The triton attention backend (the interpreter's on the CPU): its decode kernel writes the max|out|
    # partials the o projection takes its scale from. Decode runs eagerly: the spies below count calls,
    # and the plain route's patches take effect only where each step runs its Python (a CUDA graph
    # replays the route it captured); the CUDA-graph route is checked against it separately.
    options = dict(dtype="bfloat16", device=str(DEVICE), chunked_prefill_size=0, disable_radix_cache=True,
                   max_total_tokens=512, attention_backend="triton")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5)
    graph_tokens = None
    if torch.device(DEVICE).type == "cuda":  # the fused route captured in CUDA graphs (before any patch)
        graphs = LLM(str(quantized("w8a8")), disable_cuda_graph=False, **options)
        assert graphs.engine.runner.graph_runner is not None
        graph_tokens = graphs.generate([[5, 17, 300]], greedy)[0].token_ids
        del graphs
    llm = LLM(str(quantized("w8a8")), disable_cuda_graph=True, **options)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.quant_method is not None]
    for layer in layers:
        if not isinstance(layer.quant_method.kernel, TritonW8A8Kernel):  # the CPU picks the references
            kernel = TritonW8A8Kernel(layer.quant_method.scheme)
            kernel.process_weights(layer)
            layer.quant_method.kernel = kernel
    plan_fusions(model)  # again, for the kernels put in
    calls = {"rmsnorm_int8": 0, "silu_and_mul_int8": 0, "apply_with_amax": 0}

    def spy(mod: Any, name: str) -> None:
        real = getattr(mod, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(mod, name, counted)

    spy(norm_mod, "rmsnorm_int8")
    spy(mlp_mod, "silu_and_mul_int8")
    spy(TritonW8A8Kernel, "apply_with_amax")
    # the plain route's norms and SiLU on the Triton kernels too (the CPU would take torch's): both
    # routes then quantize the same values
    monkeypatch.setattr(norm_mod, "fused_kernels", lambda x: True)
    monkeypatch.setattr(act_mod, "fused_kernels", lambda x: True)
    prompts = [[5, 17, 300, 42, 9, 1000, 77], [3, 8, 2]]
    with torch.no_grad():
        fused = engine_prefill_logits(llm, prompts)
    n_layers = len(model.model.layers)
    assert calls == {"rmsnorm_int8": 2 * n_layers, "silu_and_mul_int8": n_layers, "apply_with_amax": 0}, calls
    for rid in ("p0", "p1"):
        llm.engine.abort(rid)
    # Decode steps (one row: the gate/up gemv applies the activation in its epilogue, and o and down
    # take their scales from the attention's and the gate/up gemv's max|out| partials) too.
    fused_out = llm.generate([[5, 17, 300]], greedy)[0]
    steps = calls["apply_with_amax"] // (2 * n_layers)
    assert steps >= 5 and calls["apply_with_amax"] == 2 * n_layers * steps, calls
    monkeypatch.setattr(fusion_mod, "_kernel_has", lambda linear, capability: False)
    plan_fusions(model)  # the plain route: every layer quantizes its own input
    calls.update(rmsnorm_int8=0, silu_and_mul_int8=0, apply_with_amax=0)
    with torch.no_grad():
        plain = engine_prefill_logits(llm, prompts)
    for rid in ("p0", "p1"):
        llm.engine.abort(rid)
    plain_out = llm.generate([[5, 17, 300]], greedy)[0]
    assert calls == {"rmsnorm_int8": 0, "silu_and_mul_int8": 0, "apply_with_amax": 0}, "the plain route used them"
    for a, b in zip(fused, plain):
        assert a.shape == b.shape and torch.equal(a, b), "the fused route changed the logits"
    assert len(fused_out.token_ids) == 6 and fused_out.token_ids == plain_out.token_ids
    assert fused_out.top_logprobs == plain_out.top_logprobs, "the fused decode route changed the logits"
    if graph_tokens is not None:
        assert graph_tokens == fused_out.token_ids, "the fused route in CUDA graphs decoded other tokens"


@needs_kernels
@pytest.mark.parametrize("variant", ["w4a16_g128_lm_head", "w8a8_lm_head"])
def test_quantized_lm_head_on_the_triton_kernels(quantized: Any, variant: str) -> None:
    """A quantized lm_head (a checkpoint made without ignore=["lm_head"]) computes the logits through
    its scheme's Triton kernel (the whole vocabulary as N): float32 prefill logits follow the same
    model on the same device whose head runs the torch reference kernel (every other layer as the
    device picks it in both, so the head is the only difference)."""
    from mllmd import LLM
    from tests.quantization.test_numerics import engine_prefill_logits, tokenize

    model_dir = quantized(variant)
    prompts = tokenize(model_dir)[:2]
    method = "w8a8" if variant.startswith("w8a8") else "w4a16"
    options = dict(dtype="float32", device=str(DEVICE), chunked_prefill_size=0, disable_radix_cache=True,
                   disable_cuda_graph=True, max_total_tokens=512)  # fmt: skip
    logits = {}
    for kernel_cls in (_REFERENCE[method], _TRITON[method]):
        llm = LLM(str(model_dir), **options)
        head = llm.engine.runner.model.lm_head
        if not isinstance(head.quant_method.kernel, kernel_cls):
            kernel = kernel_cls(head.quant_method.scheme)
            kernel.process_weights(head)
            head.quant_method.kernel = kernel
        logits[kernel_cls] = engine_prefill_logits(llm, prompts)
        assert isinstance(head.quant_method.kernel, kernel_cls)
        del llm
    tol = 2e-3 if method == "w8a8" else 1e-4  # W8A8: a tie in the int8 rounding of x may differ
    for got, want in zip(logits[_TRITON[method]], logits[_REFERENCE[method]]):
        assert got.shape == want.shape and rel_err(got.float(), want.float()) < tol


@pytest.mark.skipif(
    not torch.cuda.is_available() or mma.unavailable_reason(torch.device("cuda")) is not None,
    reason="needs CUDA and the w4a16_mma library (nvcc)",
)
def test_w4a16_model_decodes_on_the_cuda_kernel(tmp_path: Any) -> None:
    """A W4A16 model whose every projection the CUDA kernel takes (hidden 256): the engine picks
    CudaW4A16Kernel for each layer, decode steps launch it (eagerly, and captured in CUDA graphs with
    PDL), greedy tokens are the same with and without graphs, and each layer's one-row product is
    within the output's rounding of the float32 reference (of its words put back in row order)."""
    pytest.importorskip("compressed_tensors")
    from mllmd_kernels import w4a16_gemm_ref

    from mllmd import LLM, SamplingParams
    from mllmd.testing.checkpoints import build_tiny_checkpoint
    from mllmd.testing.quantize import quantize_checkpoint

    shape = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    base = build_tiny_checkpoint(tmp_path / "base", "Qwen3-0.6B", tie_word_embeddings=False, seed=5, **shape)
    model_dir = quantize_checkpoint(base, tmp_path / "w4a16", "W4A16")
    from torch.profiler import ProfilerActivity, profile

    prompts = [[100 + i for i in range(9)], [2000 + 7 * i for i in range(5)]]
    tokens = {}
    for graphs in (False, True):
        llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", disable_cuda_graph=not graphs, max_total_tokens=512)
        layers = [m for m in llm.engine.runner.model.modules()
                  if isinstance(getattr(getattr(m, "quant_method", None), "kernel", None), TritonW4A16Kernel)]  # fmt: skip
        assert len(layers) == 2 * 4  # qkv, o, gate_up, down in each of the 2 layers
        assert all(type(m.quant_method.kernel) is CudaW4A16Kernel and m.quant_method.kernel.mma_ok for m in layers)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:  # the GPU's own list of launched kernels
            outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        launched = [e.key for e in prof.key_averages() if "w4a16_mma_kernel" in e.key]
        assert launched, f"no w4a16_mma launch in the decode steps (graphs={graphs})"
        tokens[graphs] = [o.token_ids for o in outs]
        assert all(len(t) == 12 for t in tokens[graphs])
        g = torch.Generator().manual_seed(1)
        for layer in layers:
            x = torch.randn(1, layer.in_features, generator=g).to(device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                out = layer.quant_method.kernel.apply(layer, x, None)
            words = mma.row_order(layer.weight_packed, layer.quant_method.kernel.mma_vec)  # kept in tile order
            ref = w4a16_gemm_ref(x.float(), words, layer.weight_scale, getattr(layer, "weight_zero_point", None))
            assert rel_err(out, ref) < 3e-3
        del llm
    assert tokens[True] == tokens[False]


@pytest.mark.skipif(
    not torch.cuda.is_available() or mma.unavailable_reason(torch.device("cuda")) is not None,
    reason="needs CUDA and the w4a16_mma library (nvcc)",
)
def test_w4a16_batch1_decode_fuses_the_norms_and_silu_into_the_cuda_kernel(tmp_path: Any, monkeypatch: Any) -> None:
    """One request (one-row decode steps, in CUDA graphs): the qkv and gate/up launches apply the
    layer's norms and gate/up's silu(gate) * up, so the decode steps launch no rmsnorm but the final
    one and no silu_and_mul; greedy tokens equal those of the same model with the fusions off, and a
    fused layer's output is close to the separate kernels'."""
    pytest.importorskip("compressed_tensors")
    from torch.profiler import ProfilerActivity, profile

    from mllmd import LLM, SamplingParams, knobs
    from mllmd.models.layers import RMSNorm
    from mllmd.models.layers.fused_inputs import NormRows
    from mllmd.testing.checkpoints import build_tiny_checkpoint
    from mllmd.testing.quantize import quantize_checkpoint

    shape = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    base = build_tiny_checkpoint(tmp_path / "base", "Qwen3-0.6B", tie_word_embeddings=False, seed=9, **shape)
    model_dir = quantize_checkpoint(base, tmp_path / "w4a16", "W4A16")
    prompt = [[100 + 3 * i for i in range(7)]]
    tokens, counts = {}, {}
    for fused in (False, True):
        monkeypatch.setattr(knobs, "W4A16_FUSIONS", fused)
        llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", max_total_tokens=512)
        llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            outs = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        counts[fused] = {k: sum(k in n for n in names) for k in ("_rmsnorm_kernel", "_silu_and_mul_kernel", "w4a16_mma_kernel")}
        tokens[fused] = outs[0].token_ids
        if fused:
            model = llm.engine.runner.model
            layer = model.model.layers[0]
            g = torch.Generator().manual_seed(4)
            h, r = (torch.randn(1, 256, generator=g).to(device="cuda", dtype=torch.bfloat16) for _ in range(2))
            norm: RMSNorm = layer.post_attention_layernorm
            with torch.no_grad():
                pending = NormRows(h, r, norm, torch.empty_like(h))
                got = layer.mlp.gate_up_proj.forward_silu_mul(pending)
                normed, res = norm(h, r)
                want = SiluAndMul()(layer.mlp.gate_up_proj(normed))
            assert torch.equal(pending.residual_out, res)
            assert rel_err(got.float(), want.float()) < 2e-3
        del llm
    steps = 15  # decode steps of the profiled request; its prefill (7 rows) runs the norms apart
    assert counts[True]["w4a16_mma_kernel"] > 0
    assert counts[False]["_silu_and_mul_kernel"] - counts[True]["_silu_and_mul_kernel"] >= steps * 2  # 2 layers
    assert counts[False]["_rmsnorm_kernel"] - counts[True]["_rmsnorm_kernel"] >= steps * 4
    assert tokens[True] == tokens[False]
