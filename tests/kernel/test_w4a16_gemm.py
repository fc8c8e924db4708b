"""w4a16_gemm (int4 weights unpacked and dequantized in the kernel) against dequantize + matmul."""

from __future__ import annotations

import json

import pytest
import torch
from mllmd_kernels import (
    W4A16Config,
    dequantize_int4_ref,
    pack_int4_ref,
    prefers_dequant,
    splitk_counter_len,
    w4a16_dequantize,
    w4a16_gemm,
    w4a16_gemm_ref,
)
from mllmd_kernels.testing import (
    DTYPES,
    DTYPES_WITH_FP32,
    REL_TOL,
    kernel_device,
    on_gpu,
    poisoned,
    randn,
    rel_err,
    skip_reason,
)

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

# (M, N, K, group or None for channel-wise, asymmetric): gemv (M == 1), skinny (2..64) and gemm (> 64)
# paths; every group size, channel-wise with K off the block and off a whole word (K % 8 != 0).
SMALL = [
    (1, 40, 256, 128, False),
    (1, 33, 196, None, True),
    (3, 24, 256, 32, True),
    (17, 40, 128, 64, False),
    (40, 72, 192, 64, True),
    (37, 20, 100, None, False),
    (70, 24, 128, 32, True),
]
GPU = [
    (1, 6144, 4096, 128, False),
    (1, 4096, 12288, 32, True),
    (4, 24576, 4096, 128, False),
    (16, 4096, 4096, 64, True),
    (64, 6144, 4096, 128, False),
    (333, 6152, 4096, None, False),
    (2048, 4096, 12288, 128, False),
    (2048, 6144, 4096, 32, True),
]
SHAPES = SMALL + (GPU if on_gpu() else [])


def make_weights(
    n: int, k: int, group: int | None, asym: bool, g: torch.Generator, col_major: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random int4 weights packed as compressed-tensors packs them, with scales (and zero points)."""
    groups = 1 if group is None else k // group
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, groups, generator=g) * 0.02 / k**0.5 + 1e-4
    zp = torch.randint(-8, 8, (n, groups), generator=g, dtype=torch.int8) if asym else None
    if col_major:  # what TritonW4A16Kernel keeps (.to() below preserves the strides)
        scale = scale.t().contiguous().t()
        zp = zp.t().contiguous().t() if zp is not None else None
    return pack_int4_ref(q).to(DEVICE), scale.to(DEVICE), zp.to(DEVICE) if zp is not None else None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "group", "asym"), SHAPES)
def test_w4a16_gemm_matches_reference(
    m: int, n: int, k: int, group: int | None, asym: bool, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    packed, scale, zp = make_weights(n, k, group, asym, g)
    x = randn(m, k, dtype=dtype, device=DEVICE, gen=g)
    out = poisoned((m, n), dtype, DEVICE)
    w4a16_gemm(x, packed, scale, zp, out=out)
    assert not out.isnan().any(), "some outputs were never written"
    ref = w4a16_gemm_ref(x.float(), packed, scale, zp)  # float32 weights: the unrounded function
    assert rel_err(out, ref) < REL_TOL[dtype]
    # Against the reference in x's dtype (weights rounded to it, as the torch kernel does).
    assert rel_err(out, w4a16_gemm_ref(x, packed, scale, zp)) < REL_TOL[dtype]


CONFIGS = [
    W4A16Config("gemv", 1, 16, 32, 1, 3, 4, 1),  # split-K with a partial last split
    W4A16Config("gemv", 1, 32, 128, 1, 1, 4, 2),
    W4A16Config("skinny", 16, 16, 32, 1, 3, 4, 2),
    W4A16Config("skinny", 32, 32, 64, 1, 2, 4, 3),
    W4A16Config("gemm", 16, 32, 32, 2, 1, 4, 2),  # swizzled groups of tiles, partial edge tiles
    W4A16Config("gemm", 32, 16, 64, 3, 1, 4, 3),
]


@pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: f"{c.mode}-m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}"
)
@pytest.mark.parametrize(("group", "asym", "col_major"), [(32, True, True), (None, False, False)])
def test_w4a16_gemm_explicit_tilings(
    cfg: W4A16Config, group: int | None, asym: bool, col_major: bool
) -> None:
    """Explicit tilings (split-K included) on a strided x with bias; row- and column-major scales."""
    m = 1 if cfg.mode == "gemv" else (min(cfg.block_m - 3, 13) if cfg.mode == "skinny" else 45)
    n, k = 50, 224 if group else 220
    g = torch.Generator().manual_seed(cfg.block_n * 100 + cfg.split_k + cfg.block_m)
    packed, scale, zp = make_weights(n, k, group, asym, g, col_major)
    assert scale.stride() == ((1, n) if col_major else (1, 1))
    x = randn(m, k + 8, dtype=torch.bfloat16, device=DEVICE, gen=g)[:, 4 : 4 + k]  # row stride k + 8
    bias = randn(n, dtype=torch.bfloat16, device=DEVICE, gen=g)
    out = w4a16_gemm(x, packed, scale, zp, bias, config=cfg)
    assert out.shape == (m, n) and not out.isnan().any()
    ref = w4a16_gemm_ref(x.float(), packed, scale, zp, bias.float())
    assert rel_err(out, ref) < REL_TOL[torch.bfloat16]


# M == 1 (the "gemv" kernel), (N, K, group or None for channel-wise, asymmetric, tiling or None for the
# default): every group size, N off the block, channel-wise K off the block (K % 8 != 0 too), one K split
# and several (the last one partial), the default tiling's group-wise and channel-wise picks.
GEMV = [
    (40, 256, 32, True, W4A16Config("gemv", 1, 16, 32, 1, 1, 4, 1)),
    (72, 384, 64, False, W4A16Config("gemv", 1, 32, 64, 1, 3, 4, 2)),
    (50, 512, 128, True, W4A16Config("gemv", 1, 64, 128, 1, 2, 4, 3)),
    (24, 256, 64, True, W4A16Config("gemv", 1, 16, 128, 1, 1, 2, 1)),  # block_k cut to the group
    (33, 200, None, True, W4A16Config("gemv", 1, 16, 64, 1, 3, 4, 2)),  # splits [0, 128), [128, 200)
    (20, 100, None, False, W4A16Config("gemv", 1, 16, 256, 1, 1, 4, 1)),
    (130, 1024, 128, False, None),
    (36, 300, None, True, None),
    # sub-steps (several K steps per loop trip, each with its own group's scale): trips across group
    # borders, a trip past K (channel-wise, K % 8 != 0), a split whose last trip is partial
    (40, 512, 32, True, W4A16Config("gemv", 1, 16, 32, 1, 1, 2, 2, sub_steps=4)),
    (72, 768, 64, False, W4A16Config("gemv", 1, 32, 64, 1, 2, 4, 3, sub_steps=2)),
    (33, 200, None, True, W4A16Config("gemv", 1, 16, 32, 1, 1, 4, 2, sub_steps=4)),
    (50, 480, 32, False, W4A16Config("gemv", 1, 16, 32, 1, 2, 2, 2, sub_steps=4)),
    (24, 2048, 128, False, W4A16Config("gemv", 1, 16, 128, 1, 1, 2, 1, sub_steps=8)),  # no smem pipeline
]


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("n", "k", "group", "asym", "cfg"), GEMV)
def test_w4a16_gemv(
    n: int, k: int, group: int | None, asym: bool, cfg: W4A16Config | None, bias: bool, dtype: torch.dtype
) -> None:
    """One row: the nibble-plane kernel against the float32 reference, every output written."""
    g = torch.Generator().manual_seed(n * 31 + k + bias)
    packed, scale, zp = make_weights(n, k, group, asym, g)
    x = randn(1, k, dtype=dtype, device=DEVICE, gen=g)
    b = randn(n, dtype=dtype, device=DEVICE, gen=g) if bias else None
    out = poisoned((1, n), dtype, DEVICE)
    w4a16_gemm(x, packed, scale, zp, b, out=out, config=cfg)
    assert not out.isnan().any(), "some outputs were never written"
    ref = w4a16_gemm_ref(x.float(), packed, scale, zp, b.float() if bias else None)
    assert rel_err(out, ref) < REL_TOL[dtype]


SPLIT = [
    (1, W4A16Config("gemv", 1, 16, 32, 1, 3, 4, 1)),  # the last split partial
    (1, W4A16Config("gemv", 1, 16, 32, 1, 2, 2, 2, sub_steps=2)),
    (1, W4A16Config("gemv", 1, 32, 64, 1, 4, 2, 2)),
    (5, W4A16Config("skinny", 16, 16, 32, 1, 3, 4, 2)),
    (13, W4A16Config("skinny", 16, 32, 64, 1, 2, 4, 2)),
]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("m", "cfg"), SPLIT, ids=lambda v: getattr(v, "mode", v))
def test_w4a16_serial_splitk_equals_reduce_launch(m: int, cfg: W4A16Config, bias: bool) -> None:
    """With counters, the last program of each tile adds the split-K partials itself: the same bits
    as the separate reduce launch (same order), every output written, the counters back at 0 so the
    next call (with other inputs) is right too."""
    n, k, group = 70, 224, 32
    g = torch.Generator().manual_seed(m * 100 + cfg.block_n + bias)
    packed, scale, zp = make_weights(n, k, group, True, g)
    counters = torch.zeros(splitk_counter_len(n), dtype=torch.int32, device=DEVICE)
    b = randn(n, dtype=torch.bfloat16, device=DEVICE, gen=g) if bias else None
    for _ in range(2):
        x = randn(m, k, dtype=torch.bfloat16, device=DEVICE, gen=g)
        out = poisoned((m, n), torch.bfloat16, DEVICE)
        w4a16_gemm(x, packed, scale, zp, b, out=out, config=cfg, splitk_counters=counters)
        assert not out.isnan().any(), "some outputs were never written"
        assert torch.equal(out, w4a16_gemm(x, packed, scale, zp, b, config=cfg))
        assert not counters.any(), "the counters were not reset"
    ref = w4a16_gemm_ref(x.float(), packed, scale, zp, b.float() if bias else None)
    assert rel_err(out, ref) < REL_TOL[torch.bfloat16]


def test_w4a16_gemm_float32_activations() -> None:
    g = torch.Generator().manual_seed(5)
    packed, scale, zp = make_weights(24, 128, 64, True, g)
    for m in (1, 5, 40):
        x = randn(m, 128, dtype=torch.float32, device=DEVICE, gen=g)
        out = w4a16_gemm(x, packed, scale, zp)
        assert rel_err(out, w4a16_gemm_ref(x, packed, scale, zp)) < REL_TOL[torch.float32]


def test_prefill_dequantizes_where_the_fused_tiling_is_slower() -> None:
    """Below 128 rows always the fused kernels, from 256 always dequantize + cuBLAS (1,024 on the
    nibble planes), in between the fused tiling only where it has two output tiles or more per SM (a
    CPU tensor counts 16 SMs)."""
    x = torch.empty(0, 4096)
    assert not prefers_dequant(x.new_empty(127, 4096), 24576, 128)
    assert prefers_dequant(x.new_empty(256, 4096), 24576, 128)
    assert prefers_dequant(x.new_empty(128, 4096), 24, 128)  # 2 x 1 tiles
    assert not prefers_dequant(x.new_empty(128, 4096), 24576, 128)  # 2 x 192 tiles
    assert prefers_dequant(x.new_empty(255, 4096), 1024, 4096)  # channel-wise, 2 x 8 tiles
    # On the nibble planes the tile rule holds up to 1,024 rows
    assert not prefers_dequant(x.new_empty(512, 4096), 24576, 128, planes=True)  # 4 x 192 tiles
    assert prefers_dequant(x.new_empty(512, 4096), 24576, 128)
    assert prefers_dequant(x.new_empty(512, 4096), 24, 128, planes=True)  # 4 x 1 tiles
    assert prefers_dequant(x.new_empty(1024, 4096), 24576, 128, planes=True)


def test_w4a16_gemm_empty_batch() -> None:
    g = torch.Generator().manual_seed(0)
    packed, scale, _ = make_weights(8, 64, 32, False, g)
    assert w4a16_gemm(torch.zeros(0, 64, dtype=torch.float16, device=DEVICE), packed, scale).shape == (0, 8)


DEQUANT_SHAPES = [(40, 256, 128, False), (33, 196, None, True), (24, 256, 32, True), (72, 100, None, False)]
if on_gpu():
    DEQUANT_SHAPES += [(24576, 4096, 128, False), (4096, 12288, 32, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k", "group", "asym"), DEQUANT_SHAPES)
def test_w4a16_dequantize_equals_reference(
    n: int, k: int, group: int | None, asym: bool, dtype: torch.dtype
) -> None:
    """The large-M path's weight (then cuBLAS): exactly the reference's rounding, every element written."""
    g = torch.Generator().manual_seed(n * 31 + k)
    packed, scale, zp = make_weights(n, k, group, asym, g)
    out = poisoned((n, k), dtype, DEVICE)
    w4a16_dequantize(packed, scale, zp, k, dtype, out=out)
    ref = dequantize_int4_ref(packed, scale, zp, k, dtype)
    if dtype == torch.bfloat16 and not on_gpu():  # the interpreter rounds to bf16 differently: one ulp
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=0)
    else:
        assert torch.equal(out, ref)


def test_tuned_gemv_tilings_file(tmp_path, monkeypatch) -> None:
    """MLLMD_W4A16_TUNED names a {"N,K": tiling} file that overrides the one-row pick for those shapes
    only (the tiling runs and matches the reference); a tiling that is not a gemv is refused."""
    from mllmd_kernels.w4a16_config import pick_w4a16_config, tuned_gemv_configs

    tuned = W4A16Config("gemv", 1, 16, 32, 1, 2, 2, 2, sub_steps=4)
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"40,512": tuned.__dict__}))
    monkeypatch.setenv("MLLMD_W4A16_TUNED", str(path))
    for f in (tuned_gemv_configs, pick_w4a16_config):
        f.cache_clear()
    try:
        assert pick_w4a16_config(1, 40, 512, 32, 132, 200_000) == tuned
        assert pick_w4a16_config(1, 48, 512, 32, 132, 200_000) != tuned  # other shapes: the default
        assert pick_w4a16_config(2, 40, 512, 32, 132, 200_000).mode == "skinny"
        g = torch.Generator().manual_seed(5)
        packed, scale, zp = make_weights(40, 512, 32, False, g)
        x = randn(1, 512, dtype=torch.bfloat16, device=DEVICE, gen=g)
        out = w4a16_gemm(x, packed, scale, zp)
        assert rel_err(out, w4a16_gemm_ref(x.float(), packed, scale, zp)) < REL_TOL[torch.bfloat16]
        path.write_text(json.dumps({"40,512": W4A16Config("skinny", 16, 16, 32, 1, 1, 4, 2).__dict__}))
        tuned_gemv_configs.cache_clear()
        with pytest.raises(ValueError, match="not a one-row gemv tiling"):
            tuned_gemv_configs()
        path.write_text(json.dumps({"40,512": W4A16Config("gemv", 1, 16, 32, 1, 1, 2, 2, load_only=True).__dict__}))
        tuned_gemv_configs.cache_clear()
        with pytest.raises(ValueError, match="bench probes"):
            tuned_gemv_configs()
    finally:
        monkeypatch.delenv("MLLMD_W4A16_TUNED")
        for f in (tuned_gemv_configs, pick_w4a16_config):
            f.cache_clear()


@pytest.mark.parametrize("sub", [1, 2])
def test_tiled_words_probe_equals_stored_layout(sub: int) -> None:
    """bench_quant's DRAM-locality probe: `tile_words` re-lays the words tile by tile and the gemv
    reading that layout (tiled_w) gives the stored layout's outputs bit for bit."""
    from mllmd_kernels.w4a16_gemv import tile_words

    n, k, group = 64, 512, 64
    g = torch.Generator().manual_seed(11 + sub)
    packed, scale, _ = make_weights(n, k, group, False, g)
    x = randn(1, k, dtype=torch.bfloat16, device=DEVICE, gen=g)
    cfg = W4A16Config("gemv", 1, 16, 64, 1, 2, 2, 2, sub_steps=sub)
    tiled_cfg = W4A16Config("gemv", 1, 16, 64, 1, 2, 2, 2, sub_steps=sub, tiled_w=True)
    tiled = tile_words(packed, 16, 64)
    assert not torch.equal(tiled, packed)
    assert torch.equal(tiled.flatten()[:128], packed[:16, :8].flatten())  # the first tile leads
    want = w4a16_gemm(x, packed, scale, config=cfg)
    assert torch.equal(w4a16_gemm(x, tiled, scale, config=tiled_cfg), want)
    assert rel_err(want, w4a16_gemm_ref(x.float(), packed, scale)) < REL_TOL[torch.bfloat16]


def test_narrow_scales_give_the_float32_bits_on_every_path() -> None:
    """bf16 / fp16 scales holding the float32 values exactly give the float32 scales' outputs bit for
    bit (gemv, skinny, gemm, dequantize); integer scales are refused, the dtype named."""
    n, k, group = 48, 256, 64
    g = torch.Generator().manual_seed(21)
    packed, scale, zp = make_weights(n, k, group, True, g)
    bf16_exact = scale.to(torch.bfloat16).float()
    fp16_only = (scale * 0 + 1 + 2.0**-9).clone()  # 1 + 2**-9: exact in fp16, not in bf16
    for wide, narrow_dtype in ((bf16_exact, torch.bfloat16), (fp16_only, torch.float16)):
        narrow = wide.to(narrow_dtype)
        assert torch.equal(narrow.float(), wide)
        for m in (1, 5, 70):
            x = randn(m, k, dtype=torch.bfloat16, device=DEVICE, gen=g)
            assert torch.equal(w4a16_gemm(x, packed, narrow, zp), w4a16_gemm(x, packed, wide, zp)), f"M={m}"
        assert torch.equal(
            w4a16_dequantize(packed, narrow, zp, k, torch.bfloat16), w4a16_dequantize(packed, wide, zp, k, torch.bfloat16)
        )
    with pytest.raises(AssertionError, match="torch.int32"):
        w4a16_gemm(randn(1, k, dtype=torch.bfloat16, device=DEVICE, gen=g), packed, scale.to(torch.int32))


# (M, N, K, group or None, asymmetric): words in w4a16_mma's tile order (16-row tiles, 256-column
# stages) on the skinny tiling (one row takes it instead of the gemv) and the gemm tiling; every chunk
# width (groups of 32 / 64 / 128+ columns: 1 / 2 / 4 words a lane).
MMA_ORDER = [(1, 48, 512, 128, False), (3, 32, 256, 32, True), (17, 64, 512, 64, False), (70, 32, 768, None, True)]


@pytest.mark.parametrize(("m", "n", "k", "group", "asym"), MMA_ORDER)
def test_w4a16_paths_read_mma_tile_order(m: int, n: int, k: int, group: int | None, asym: bool) -> None:
    """mma_vec: the Triton paths read the CUDA kernel's tile_order (what CudaW4A16Kernel keeps on a
    layer): the product equals the row-major words' (bit for bit where the tiling is the same), and so
    does the dequantized weight; row-major words read as tile order would not."""
    from mllmd_kernels import w4a16_mma as mma

    g = torch.Generator().manual_seed(m * 131 + n + k)
    packed, scale, zp = make_weights(n, k, group, asym, g)
    layout = mma.mma_layout(k, group or k)
    assert layout is not None
    vec = layout[0]
    tiled = mma.tile_order(packed, vec)
    assert not torch.equal(tiled, packed)
    x = randn(m, k, dtype=torch.bfloat16, device=DEVICE, gen=g)
    out = w4a16_gemm(x, tiled, scale, zp, mma_vec=vec)
    ref = w4a16_gemm_ref(x, packed, scale, zp)
    assert rel_err(out, ref) < REL_TOL[torch.bfloat16]
    if m > 1:
        assert torch.equal(out, w4a16_gemm(x, packed, scale, zp))
    assert rel_err(w4a16_gemm(x, packed, scale, zp, mma_vec=vec), ref) > 0.3  # the order matters
    deq = w4a16_dequantize(tiled, scale, zp, k, torch.float32, mma_vec=vec)
    assert torch.equal(deq, w4a16_dequantize(packed, scale, zp, k, torch.float32))
    assert torch.equal(mma.row_order(tiled, vec), packed)


# (M, N, K, group or None, asymmetric, tiling or None): the skinny and gemm tilings, which take the
# nibble planes with exact scales; channel-wise K off a whole word; a partial last K step.
PLANES = [
    (2, 40, 256, 64, True, None),
    (13, 50, 224, 32, False, W4A16Config("skinny", 16, 16, 32, 1, 3, 4, 2)),
    (45, 50, 256, 128, True, W4A16Config("gemm", 16, 32, 32, 2, 1, 4, 2)),
    (70, 24, 100, None, True, None),
    (100, 72, 256, 128, False, None),
]
PLANES_GPU = [(48, 4096, 4096, 128, False, None), (200, 6144, 4096, 128, True, None), (2048, 4096, 12288, 32, False, None)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "group", "asym", "cfg"), PLANES + (PLANES_GPU if on_gpu() else []))
def test_nibble_planes_give_the_float32_paths_bits(
    m: int, n: int, k: int, group: int | None, asym: bool, cfg: W4A16Config | None, dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """exact_scales: the tensor-core tilings build the weight tile from its nibble planes in x's dtype
    (on the GPU in packed 16-bit PTX arithmetic, under the interpreter in Triton ops): the same
    products, bit for bit, as the float32 dequantization; and the column order matters (a tile built
    in the wrong order would not give them)."""
    from mllmd_kernels.w4a16_dequant import DEQUANT_F32, dequant_mode, scales_exact_in

    g = torch.Generator().manual_seed(m * 17 + n + k)
    packed, scale, zp = make_weights(n, k, group, asym, g)
    scale = scale.to(dtype).float()  # a 16-bit checkpoint's scales, widened as the layer keeps them
    assert scales_exact_in(scale, dtype)
    x = randn(m, k, dtype=dtype, device=DEVICE, gen=g)
    monkeypatch.delenv("MLLMD_W4A16_PLANES", raising=False)  # on by default
    assert dequant_mode(x, True) != DEQUANT_F32 and dequant_mode(x, False) == DEQUANT_F32
    out = poisoned((m, n), dtype, DEVICE)
    w4a16_gemm(x, packed, scale, zp, out=out, config=cfg, exact_scales=True)
    assert torch.equal(out, w4a16_gemm(x, packed, scale, zp, config=cfg))
    assert rel_err(out, w4a16_gemm_ref(x.float(), packed, scale, zp)) < REL_TOL[dtype]
    monkeypatch.setenv("MLLMD_W4A16_PLANES", "0")  # the A/B switch: the float32 path
    assert dequant_mode(x, True) == DEQUANT_F32


def test_scales_exact_in_names_the_dtypes_whose_values_the_scales_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    from mllmd_kernels.w4a16_dequant import dequant_mode, scales_exact_in

    monkeypatch.delenv("MLLMD_W4A16_PLANES", raising=False)
    bf16_values = torch.tensor([[0.0078125, 3.0], [1.5, 2.0**-20]])
    assert scales_exact_in(bf16_values, torch.bfloat16) and scales_exact_in(bf16_values.t(), torch.bfloat16)
    assert not scales_exact_in(bf16_values + 2.0**-12, torch.bfloat16)
    assert scales_exact_in(torch.tensor([[1 + 2.0**-9]]), torch.float16)
    assert not scales_exact_in(torch.tensor([[1 + 2.0**-9]]), torch.bfloat16)
    assert not scales_exact_in(torch.tensor([[1e-6]]), torch.float16)  # below fp16's normal range: rounded
    assert not scales_exact_in(bf16_values, torch.float32)
    assert dequant_mode(torch.zeros(2, 8), True) == 0  # float32 activations keep the float32 path
