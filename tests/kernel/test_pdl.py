"""Programmatic dependent launch: when the kernels launch with PDL (sm90+, Triton with `launch_pdl`,
inside `pdl_launches()`), and that a decode-shaped chain of dependent PDL launches, eager and in a
CUDA graph, gives bit for bit what the same chain gives with PDL off (a kernel reading its
predecessor's output too early would not)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from mllmd_kernels import _triton as kt
from mllmd_kernels import (
    decode_attention,
    gemv,
    int8_gemm,
    pack_int4_ref,
    rmsnorm,
    rmsnorm_int8,
    rope,
    silu_and_mul,
    w4a16_gemm,
    w8a8_linear,
)
from mllmd_kernels.testing import kernel_device, on_gpu, randn


@pytest.fixture
def fresh_pdl(monkeypatch: pytest.MonkeyPatch):
    """pdl_supported re-reads MLLMD_PDL and the device on its next call, and again after the test."""
    kt.pdl_supported.cache_clear()
    yield monkeypatch
    kt.pdl_supported.cache_clear()


def _triton_has_launch_pdl() -> bool:
    if not kt.HAS_TRITON:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def test_no_pdl_on_cpu_tensors() -> None:
    """CPU tensors (the interpreter, CI) never launch with PDL: the kernels get USE_PDL=False only."""
    with kt.pdl_launches():
        assert kt.pdl_args(torch.zeros(1)) == {"USE_PDL": False}


def test_pdl_only_inside_pdl_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A supported GPU launches with PDL only inside the scope (the decode graphs' warm-up and capture),
    where every kernel follows another kernel: a PDL launch is not known to wait for a copy."""
    gpu_tensor = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    monkeypatch.setattr(kt, "pdl_supported", lambda index: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kt.pdl_args(gpu_tensor) == {"USE_PDL": False}
    with kt.pdl_launches():
        with kt.pdl_launches():
            assert kt.pdl_args(gpu_tensor) == {"USE_PDL": True, "launch_pdl": True}
        assert kt.pdl_args(gpu_tensor) == {"USE_PDL": True, "launch_pdl": True}
    assert kt.pdl_args(gpu_tensor) == {"USE_PDL": False}
    with pytest.raises(RuntimeError), kt.pdl_launches():
        raise RuntimeError("a failed capture")
    assert kt.pdl_args(gpu_tensor) == {"USE_PDL": False}, "the scope closes on errors too"


@pytest.mark.skipif(
    not _triton_has_launch_pdl() or kt.interpreting(),
    reason="an offline compile: needs a Triton that launches with PDL (3.4+), not its interpreter",
)
@pytest.mark.parametrize(
    ("fuse", "block_k", "warps", "amax_in"),
    [(False, 1024, 4, 0), (True, 2048, 8, 0), (True, 2048, 8, 2048)],
    ids=["int8_rows", "fused", "fused_amax_partials"],
)
def test_int8_gemv_touches_only_weight_lines_before_the_pdl_wait(fuse: bool, block_k: int, warps: int, amax_in: int) -> None:
    """Under PDL the one-row int8 gemv asks L2 for its first weight tile before griddepcontrol.wait
    (the weights are written by no kernel of the step). Nothing else may come before the wait: a
    load of the activations or a store there would race with the kernel before it. Offline sm_90
    compile: the prefetches precede the wait; no global load, store or atomic does."""
    from mllmd_kernels.testing import int8_gemv_ptx

    lines = int8_gemv_ptx(fuse, block_k, warps, 90, pdl=True, amax_in=amax_in).splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    before = lines[:wait]
    assert sum("prefetch.global.L2" in line for line in before) == block_k * 16 // 128 // (32 * warps), (
        "one prefetch per 128-byte line of the [16, BLOCK_K] tile, spread over the threads"
    )
    early = [line.strip() for line in before if re.search(r"\b(ld|st|atom|red)\.global|\bcp\.async", line)]
    assert not early, f"global memory accessed before griddepcontrol.wait: {early}"
    assert not any("prefetch" in line for line in lines[wait:]), "the prefetch belongs before the wait"


def _kernel_ptx(kernel, constexprs: dict, types: dict[str, str], num_warps: int = 4, **options) -> list[str]:
    """PTX lines of a Triton kernel compiled offline for sm_90 with USE_PDL: every argument not in
    `constexprs` typed from `types` by name (pointers default to *fp32, other arguments to i32)."""
    import inspect

    from mllmd_kernels.testing import compile_ptx

    constexprs = {**constexprs, "USE_PDL": True}
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: types.get(n, "*fp32" if n.endswith("_ptr") else "i32") for n in names if n not in constexprs}
    ordered = {n: constexprs[n] for n in names if n in constexprs}  # in the kernel's parameter order
    return compile_ptx(kernel, sig, ordered, 90, num_warps, **options).splitlines()


def _before_wait(lines: list[str]) -> tuple[list[str], list[str]]:
    """(global loads, global stores / atomics / async copies) before griddepcontrol.wait."""
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    before = lines[:wait]
    loads = [line.strip() for line in before if re.search(r"\bld\.global", line)]
    writes = [line.strip() for line in before if re.search(r"\b(st|atom|red)\.global|\bcp\.async", line)]
    return loads, writes


PDL_OFFLINE = pytest.mark.skipif(
    not _triton_has_launch_pdl() or kt.interpreting(),
    reason="an offline compile: needs a Triton that launches with PDL (3.4+), not its interpreter",
)


@PDL_OFFLINE
@pytest.mark.parametrize("rotary", ["full", "partial"])
def test_rope_reads_only_step_constants_before_the_pdl_wait(rotary: str) -> None:
    """Under PDL the RoPE kernel reads the positions, slots, cos/sin rows and QK-norm weights (which
    the qkv projection before it does not write) before griddepcontrol.wait, so their latency
    overlaps that kernel's tail; it reads q/k/v only after it and writes nothing before it. "partial":
    Qwen3.5's launch (zero-centred norm, dims passed through: their weights early, their rows after)."""
    from mllmd_kernels.rope import _rope_kernel

    types = {"pos_ptr": "*i64", "loc_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "q_out_ptr": "*bf16",
             "k_out_ptr": "*bf16", "v_ptr": "*bf16", "v_cache_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16",
             "eps": "fp32"}  # fmt: skip
    partial = rotary == "partial"
    consts = dict(HAS_NORM=True, ZERO_CENTRED=partial, STORE_KV=True, ROUND_PRODUCTS=True, BLOCK_HEADS=2 if partial else 8,
                  BLOCK=32 if partial else 64, PASS_BLOCK=256 if partial else 0)  # fmt: skip
    lines = _kernel_ptx(_rope_kernel, consts, types)
    loads, writes = _before_wait(lines)
    assert not writes, f"global memory written before griddepcontrol.wait: {writes}"
    # pos, loc, the four cos/sin halves and the two weight halves (and the passed dims' weights):
    # one load instruction a thread each
    assert len(loads) >= 8 + partial, loads
    after = lines[next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line) :]
    after_loads = [line.strip() for line in after if re.search(r"\bld\.global", line)]
    most = 6 if partial else 4
    assert 2 <= len(after_loads) <= most, f"after the wait only the rows of q/k and of v: {after_loads}"


@PDL_OFFLINE
def test_decode_attention_reads_only_the_batch_table_before_the_pdl_wait() -> None:
    """Stage 1 reads the sequence lengths, request rows and its first tile of slots before
    griddepcontrol.wait (no kernel of a layer writes them), but q and the K/V pool (which the RoPE
    kernel before it writes) only after; stage 2 reads only the lengths before it. Neither writes
    anything, nor starts an async copy, before the wait."""
    from mllmd_kernels.decode_attention import (
        _decode_attention_stage1_kernel,
        _decode_attention_stage2_kernel,
    )

    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "req_to_token_ptr": "*i64",
             "req_pool_indices_ptr": "*i64", "seq_lens_ptr": "*i64", "scale": "fp32", "out_ptr": "*bf16"}  # fmt: skip
    stage1 = dict(GROUP=4, NUM_SPLITS=32, BLOCK_H=16, BLOCK_N=128, BLOCK_D=128, DOT_F32=False)
    loads, writes = _before_wait(_kernel_ptx(_decode_attention_stage1_kernel, stage1, types, num_stages=2))
    assert not writes, f"stage 1 writes or copies before griddepcontrol.wait: {writes}"
    # one 64-bit load a thread each of the length, the row and the first tile's slots: no q, K or V data
    assert len(loads) == 3 and all(re.search(r"ld\.global\.b64 ", line) for line in loads), loads
    stage2 = dict(NUM_SPLITS=32, SPLITS_P2=32, BLOCK_N=128, BLOCK_D=128, WRITE_AMAX=True)
    loads, writes = _before_wait(_kernel_ptx(_decode_attention_stage2_kernel, stage2, types))
    assert not writes and len(loads) == 1, (loads, writes)


@pytest.mark.parametrize("capability", [(8, 7), (9, 0)])
@pytest.mark.parametrize("env", [None, "0"])
def test_pdl_needs_sm90_a_triton_with_launch_pdl_and_not_mllmd_pdl_0(
    fresh_pdl: pytest.MonkeyPatch, capability: tuple[int, int], env: str | None
) -> None:
    fresh_pdl.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    if env is None:
        fresh_pdl.delenv("MLLMD_PDL", raising=False)
    else:
        fresh_pdl.setenv("MLLMD_PDL", env)
    expected = capability >= (9, 0) and env != "0" and _triton_has_launch_pdl()
    assert kt.pdl_supported(0) is expected


def _decode_chain(steps: int, gen: torch.Generator) -> tuple:
    """Inputs of a Qwen3-like batch-1 decode chain (hidden 1024, 8 / 2 heads of 128, MLP 3072)."""
    dev, dt = "cuda", torch.bfloat16
    h, hq, hkv, d, inter, ctx = 1024, 8, 2, 128, 3072, 300
    w = {
        "norm": randn(h, dtype=dt, device=dev, gen=gen, scale=0.1) + 1,
        "qkv": randn((hq + 2 * hkv) * d, h, dtype=dt, device=dev, gen=gen, scale=h**-0.5),
        "o": randn(h, hq * d, dtype=dt, device=dev, gen=gen, scale=(hq * d) ** -0.5),
        "gate_up_q": torch.randint(-127, 128, (2 * inter, h), generator=gen, dtype=torch.int8).to(dev),
        "gate_up_s": (torch.rand(2 * inter, 1, generator=gen) * 2e-3 + 1e-4).to(dev),
        "down_packed": pack_int4_ref(torch.randint(-8, 8, (h, inter), generator=gen, dtype=torch.int8)).to(dev),
        "down_s": (torch.rand(h, inter // 128, generator=gen) * 0.02 + 1e-3).to(dev),
        "qn": randn(d, dtype=dt, device=dev, gen=gen, scale=0.1) + 1,
        "kn": randn(d, dtype=dt, device=dev, gen=gen, scale=0.1) + 1,
        "k_cache": randn(ctx + steps, hkv, d, dtype=dt, device=dev, gen=gen),
        "v_cache": randn(ctx + steps, hkv, d, dtype=dt, device=dev, gen=gen),
    }
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(ctx + steps, dtype=torch.float32)[:, None] * inv[None, :]
    w["cos"], w["sin"] = torch.cat([ang.cos()] * 2, -1).to(dev), torch.cat([ang.sin()] * 2, -1).to(dev)
    w["req_to_token"] = torch.arange(ctx + steps, device=dev).view(1, -1)
    return w, (h, hq, hkv, d)


def _run_chain(w: dict, dims: tuple, x0: torch.Tensor, steps: int) -> torch.Tensor:
    """`steps` decoder-like layers, each kernel consuming the one before: rmsnorm -> gemv (qkv) ->
    rope -> decode attention (two launches) -> gemv (o) -> rmsnorm_int8 -> int8 gemv (gate_up) ->
    silu_and_mul -> w4a16 gemv (down) + residual. Returns the last hidden row."""
    h, hq, hkv, d = dims
    x, res = x0, torch.zeros_like(x0)
    zero = torch.zeros(1, dtype=torch.int64, device=x0.device)
    for i in range(steps):
        normed, res = rmsnorm(x, w["norm"], 1e-6, residual=res)
        qkv = gemv(normed, w["qkv"])
        q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], -1)
        pos = torch.full((1,), 300 + i, dtype=torch.int64, device=x0.device)
        q, _ = rope(pos, q.view(1, hq, d), k.view(1, hkv, d), w["cos"], w["sin"], w["qn"], w["kn"], 1e-6)
        seq = torch.full((1,), 200 + 7 * i, dtype=torch.int64, device=x0.device)
        attn = decode_attention(q, w["k_cache"], w["v_cache"], w["req_to_token"], zero, seq, d**-0.5)
        x = gemv(attn.reshape(1, hq * d), w["o"])
        qx, sx, res = rmsnorm_int8(x, w["norm"], 1e-6, residual=res)
        gu = int8_gemm(qx, w["gate_up_q"], sx, w["gate_up_s"], torch.bfloat16)
        x = w4a16_gemm(silu_and_mul(gu), w["down_packed"], w["down_s"])
        x = w8a8_linear(x, w["gate_up_q"][:h], w["gate_up_s"][:h])  # the fused one-row quantizing gemv
    return x + res


@pytest.mark.skipif(not on_gpu() or kernel_device() != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_pdl_chain_equals_the_serial_chain(fresh_pdl: pytest.MonkeyPatch, graph: bool) -> None:
    steps = 6
    w, dims = _decode_chain(steps, torch.Generator().manual_seed(7))
    x0 = randn(1, dims[0], dtype=torch.bfloat16, device="cuda", gen=torch.Generator().manual_seed(8))

    def run() -> torch.Tensor:
        with kt.pdl_launches():
            if not graph:
                torch.cuda.synchronize()  # the inputs' copies have landed (PDL is not known to wait for copies)
                return _run_chain(w, dims, x0, steps)
            _run_chain(w, dims, x0, steps)  # compile outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = _run_chain(w, dims, x0, steps)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        return out.clone()

    fresh_pdl.setenv("MLLMD_PDL", "0")
    kt.pdl_supported.cache_clear()
    serial = run()
    fresh_pdl.delenv("MLLMD_PDL")
    kt.pdl_supported.cache_clear()
    with kt.pdl_launches():
        uses_pdl = kt.pdl_args(x0).get("launch_pdl", False)
    if torch.cuda.get_device_capability()[0] >= 9 and _triton_has_launch_pdl():
        assert uses_pdl, "an sm90 GPU with a PDL-capable Triton should launch with PDL"
    overlapped = run()
    assert torch.isfinite(serial).all()
    torch.testing.assert_close(overlapped, serial, rtol=0, atol=0)
    if not uses_pdl:
        pytest.skip("PDL is off here (pre-sm90 GPU or Triton < 3.4): both chains ran serially")
