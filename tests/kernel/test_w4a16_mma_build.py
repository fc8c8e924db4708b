"""w4a16_mma's host side without a GPU: which shapes it takes, where cuda_build finds nvcc and caches
the library, how a failed or disabled build is reported; and, where an nvcc is at hand (CI installs one
beside the venv: MLLMD_NVCC), the CUDA source compiled for Jetson Orin (sm87) and the H200 (sm90)."""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from mllmd_kernels import cuda_build
from mllmd_kernels import w4a16_mma as mma


@pytest.fixture(autouse=True)
def _fresh_library_cache():
    mma._library_for.cache_clear()
    yield
    mma._library_for.cache_clear()


@pytest.mark.parametrize(
    ("k", "group", "layout"),
    [
        (4096, 128, (4, 0)),
        (4096, 256, (4, 1)),
        (12288, 1024, (4, 3)),
        (4096, 64, (2, 0)),
        (4096, 32, (1, 0)),
        (4096, 4096, (4, 30)),  # channel-wise
        (9728, 9728, (4, 30)),
        (4096, 96, None),  # three 32-column chunks a group: not a power of two
        (4096, 384, None),
        (4096, 16, None),  # a chunk would span groups
        (4000, 4000, None),  # K not a multiple of 256 (a loop stage)
        (4224, 128, None),
    ],
)
def test_mma_layout(k: int, group: int, layout: tuple[int, int] | None) -> None:
    assert mma.mma_layout(k, group) == layout


def test_supports_rows_dtypes_and_n() -> None:
    bf = torch.bfloat16
    assert mma.supports(1, 6144, 4096, 128, bf) and mma.supports(8, 16, 256, 32, torch.float16)
    assert mma.supports(9, 6144, 4096, 128, bf) and mma.supports(32, 6144, 4096, 128, bf)  # 2 and 4 column tiles
    assert not mma.supports(33, 6144, 4096, 128, bf)  # at most 4 tiles of the MMA's 8 columns
    assert not mma.supports(0, 6144, 4096, 128, bf)
    assert not mma.supports(1, 6152, 4096, 128, bf)  # N % 16
    assert not mma.supports(1, 6144, 4096, 128, torch.float32)


def test_unsupported_shape_is_refused_by_name() -> None:
    x = torch.zeros(33, 256, dtype=torch.bfloat16)
    w = torch.zeros(16, 32, dtype=torch.int32)
    s = torch.ones(16, 2)
    with pytest.raises(ValueError, match="M=33 N=16 K=256 group=128"):
        mma.w4a16_mma(x, w, s)


def test_scales_must_be_g_major_float32() -> None:
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    w = torch.zeros(16, 32, dtype=torch.int32)
    with pytest.raises(ValueError, match="G-major"):
        mma.w4a16_mma(x, w, torch.ones(16, 2))  # row-major [N, G]
    with pytest.raises(ValueError, match="float32"):
        mma.w4a16_mma(x, w, torch.ones(2, 16, dtype=torch.bfloat16).t())


def _fake_nvcc(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "nvcc"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_find_nvcc_prefers_mllmd_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nvcc = _fake_nvcc(tmp_path, "exit 0\n")
    monkeypatch.setenv("MLLMD_NVCC", str(nvcc))
    assert cuda_build.find_nvcc() == str(nvcc)
    monkeypatch.setenv("MLLMD_NVCC", str(tmp_path / "missing"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "toolkit"))
    (tmp_path / "toolkit" / "bin").mkdir(parents=True)
    other = _fake_nvcc(tmp_path / "toolkit" / "bin", "exit 0\n")
    assert cuda_build.find_nvcc() == str(other)


def test_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLLMD_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cuda_build.cache_dir() == tmp_path / "xdg" / "mllmd" / "cuda"
    monkeypatch.setenv("MLLMD_KERNEL_CACHE", str(tmp_path / "k"))
    assert cuda_build.cache_dir() == tmp_path / "k"


def test_build_once_then_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake nvcc that counts its builds: the second build() of the same source and arch reuses the
    file; another arch builds again."""
    log = tmp_path / "calls"
    nvcc = _fake_nvcc(
        tmp_path,
        f'if [ "$1" = "--version" ]; then echo "fake nvcc 1.0"; exit 0; fi\n'
        f'echo build >> {log}\nwhile [ "$1" != "-o" ]; do shift; done\necho lib > "$2"\n',
    )
    monkeypatch.setenv("MLLMD_KERNEL_CACHE", str(tmp_path / "cache"))
    first = cuda_build.build(mma.SOURCE, str(nvcc), "87")
    assert first.read_text() == "lib\n" and first.parent == tmp_path / "cache"
    assert cuda_build.build(mma.SOURCE, str(nvcc), "87") == first
    assert log.read_text().count("build") == 1
    assert cuda_build.build(mma.SOURCE, str(nvcc), "90") != first
    assert log.read_text().count("build") == 2
    assert not list((tmp_path / "cache").glob("*.tmp"))  # no partial file left


def test_failed_build_names_the_compiler_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nvcc = _fake_nvcc(
        tmp_path,
        'if [ "$1" = "--version" ]; then echo v; exit 0; fi\necho "w4a16_mma.cu(3): error: no mma here" >&2\nexit 2\n',
    )
    monkeypatch.setenv("MLLMD_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MLLMD_NVCC", str(nvcc))
    monkeypatch.delenv("MLLMD_CUDA_KERNELS", raising=False)
    with pytest.raises(RuntimeError, match="no mma here"):
        cuda_build.build(mma.SOURCE, str(nvcc), "87")
    assert mma._library_for("87") is None
    assert "build failed" in mma._REASONS["87"] and "no mma here" in mma._REASONS["87"]
    assert not list((tmp_path / "cache").glob("*"))  # nothing half-built is kept


def test_turned_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLLMD_CUDA_KERNELS", "0")
    assert mma._library_for("90") is None
    assert "MLLMD_CUDA_KERNELS" in mma._REASONS["90"]
    assert "CUDA device" in mma.unavailable_reason(torch.device("cpu"))


def _real_nvcc() -> str | None:
    nvcc = cuda_build.find_nvcc()
    if nvcc is None:
        return None
    try:
        subprocess.run([nvcc, "--version"], capture_output=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return nvcc


@pytest.mark.skipif(_real_nvcc() is None, reason="no nvcc (CI installs one: MLLMD_NVCC)")
@pytest.mark.parametrize("arch", ["87", "90"])
def test_source_compiles_without_spills(arch: str, tmp_path: Path) -> None:
    """The CUDA source builds for Orin and the H200 (every template: bf16 / fp16, 4 / 2 / 1 words a
    vector, with and without zero points, bf16's offset form for one row; the bench probes), with no
    register spills; the library's shared-memory sizes are smem_bytes'."""
    out = tmp_path / f"w4a16_mma_sm{arch}.so"
    cmd = cuda_build.build_command(mma.SOURCE, _real_nvcc(), arch, str(out)) + ["-Xptxas", "-v"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=cuda_build.BUILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.stat().st_size > 0
    found = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores", proc.stderr, re.S)
    # exact: bf16 (3 vectors x zero points or not) x (1, 2, 4 column tiles) + the offset form (3 x 2),
    # fp16 (3 x 2 x 3); the fused offset form (3 x 2); probes: 3 x 2
    assert len(found) == 54, proc.stderr[-3000:]
    one_tile = [int(sp) for name, sp in found if name.endswith("Li1EEEvPKtPKjPKfPKaS2_PtiiiiiiiiNS_4FuseE")]
    assert len(one_tile) == 30 and all(sp == 0 for sp in one_tile), proc.stderr[-3000:]
    # the 2- and 4-tile kernels under the launch bounds' 128 registers: a few spilled words (the source's
    # header says why); a change that spills their loop's operands would show here
    assert all(int(sp) <= 32 for _, sp in found), proc.stderr[-3000:]
    assert os.access(out, os.R_OK)
    smem = ctypes.CDLL(str(out)).mllmd_w4a16_mma_smem  # loads without a GPU (the CUDA runtime is static)
    smem.argtypes, smem.restype = [ctypes.c_int] * 5, ctypes.c_int
    for m, k, vec, warps, dtype in itertools.product(
        (1, 3, 9, 17, 32), (256, 768, 4096, 12288), (4, 2, 1), (1, 4, 6, 8), (torch.bfloat16, torch.float16)
    ):
        want = smem(m, k, vec, warps, int(dtype == torch.bfloat16))
        assert mma.smem_bytes(m, k, vec, warps, dtype) == want, (m, k, vec, warps, dtype)


def test_default_launch_splits_are_the_measured_ones() -> None:
    """On an H200 (132 SMs) the Qwen3-8B shapes get the launches the bench_quant sweep picked there (issue 7):
    qkv / o / down split 8, gate_up 2, CTAs of 8 warps; every pick is a valid launch, also on an Orin's 16
    SMs (where the rows' length sets the split)."""
    shapes = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
    picks = {shape: mma.pick_config(*shape, 128, 132) for shape in shapes}
    assert [(c.split, c.warps) for c in picks.values()] == [(8, 8), (8, 8), (2, 8), (8, 8)]
    assert [mma.pick_config(*shape, 128, 16).split for shape in shapes] == [2, 2, 2, 8]
    for (n, k), _ in picks.items():
        for sms in (16, 132):
            for group in (32, 64, 128, k):
                assert mma.valid_config(mma.pick_config(n, k, group, sms), k, group)


def test_several_column_tiles_take_the_measured_launches() -> None:
    """Over 8 rows (2 or 4 column tiles) the Qwen3-8B shapes on 132 SMs get the 2026-12-03 H200 sweep's
    fastest launches at 16 and 32 rows: qkv split 4 on 4 warps, o and down 8 on 8, gate_up 1 on 4 (at 16
    rows 11.9 / 9.2 / 38.0 / 20.0 us against the one-tile picks' 16.1 / 9.2 / 47.8 / 20.0); valid on an
    Orin's 16 SMs too."""
    shapes = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
    for rows in (9, 16, 32):
        picks = [mma.pick_config(*shape, 128, 132, rows=rows) for shape in shapes]
        assert [(c.split, c.warps) for c in picks] == [(4, 4), (8, 8), (1, 4), (8, 8)]
        for (n, k) in shapes:
            assert mma.valid_config(mma.pick_config(n, k, 128, 16, rows=rows), k, 128)
    assert mma.pick_config(6144, 4096, 128, 132, rows=8) == mma.MmaConfig(8, 8)  # one tile: as before


def test_silu_launches_hold_gate_and_up_tiles_in_pairs() -> None:
    """With silu a CTA must hold an even number of tiles (gate tile i with up tile i): the pick keeps
    gate_up's split of 2 on the H200, halves a split that would leave one tile a CTA, and a launch of one
    tile a CTA is not valid for silu."""
    assert mma.pick_config(24576, 4096, 128, 132, silu=True) == mma.MmaConfig(2, 8)
    assert mma.pick_config(1024, 4096, 128, 132).split == 8
    assert mma.pick_config(1024, 4096, 128, 132, silu=True).split == 4
    assert not mma.valid_config(mma.MmaConfig(8, 8), 4096, 128, silu=True)
    assert mma.valid_config(mma.MmaConfig(8, 8), 4096, 128)
    for n, k in ((24576, 4096), (1024, 256), (6144, 12288)):
        for sms in (16, 132):
            assert mma.valid_config(mma.pick_config(n, k, 128, sms, silu=True), k, 128, silu=True)


def test_tuned_launch_splits_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLLMD_W4A16_MMA_TUNED overrides the split of the shapes it names; one that is not a launch (3
    parts over 4 warps) falls back to the default."""
    path = tmp_path / "tuned.json"
    path.write_text('{"6144,4096": [4, 4], "4096,4096": [3, 4]}')
    monkeypatch.setenv("MLLMD_W4A16_MMA_TUNED", str(path))
    mma.tuned_configs.cache_clear()
    try:
        assert mma.pick_config(6144, 4096, 128, 132) == mma.MmaConfig(4, 4)
        assert mma.pick_config(4096, 4096, 64, 132) == mma.MmaConfig(8, 8)  # not a launch: the default
        assert mma.pick_config(24576, 4096, 128, 132) == mma.MmaConfig(2, 8)  # not named: the default
    finally:
        mma.tuned_configs.cache_clear()


def test_offset_form_and_shared_memory_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """One bf16 row stages x (2 bytes a column, and a float32 sum a chunk) in shared memory; where that
    would not fit the GPU's shared memory per block the layer keeps the Triton kernels (fits)."""
    bf, fp = torch.bfloat16, torch.float16
    assert mma.offset_form(1, bf) and not mma.offset_form(2, bf) and not mma.offset_form(1, fp)
    base = mma.smem_bytes(2, 12288, 4, 8, bf)
    assert base == 8 * 16 * 8 * 4  # the split-K partials only
    assert mma.smem_bytes(1, 12288, 4, 8, bf) == base + 2 * 12288 + (12288 // 128) * 4
    assert mma.smem_bytes(1, 12288, 4, 8, fp) == base
    assert mma.smem_bytes(1, 12288, 1, 8, bf) == base + 2 * 12288 + (12288 // 32) * 4  # a sum every 32 columns
    monkeypatch.setattr(mma, "_smem_limit", lambda index: mma.smem_bytes(1, 12288, 4, 8, bf))
    dev = torch.device("cuda", 0)
    assert mma.fits(1, 12288, 128, bf, dev)
    assert not mma.fits(1, 16384, 128, bf, dev)  # a longer row's x does not fit
    assert mma.fits(2, 16384, 128, bf, dev)  # several rows stage no x
    assert not mma.fits(1, 12288, 32, bf, dev)  # nor do the sums of 32-column chunks


@pytest.mark.parametrize(("props", "limit"), [
    ({"major": 8, "minor": 7}, 166912),  # torch < 2.7 (Orin's 2.4): no shared_memory_per_block_optin
    ({"major": 9, "minor": 0}, 232448),
    ({"major": 8, "minor": 7, "shared_memory_per_block_optin": 100000}, 100000),
])  # fmt: skip
def test_shared_memory_limit_without_the_optin_property(
    props: dict[str, int], limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from mllmd_kernels import tiling

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(**props))
    tiling._smem_per_block.cache_clear()
    try:
        assert mma._smem_limit(0) == limit
    finally:
        tiling._smem_per_block.cache_clear()


def test_misaligned_x_is_refused_by_name() -> None:
    x = torch.zeros(1, 264, dtype=torch.bfloat16)[:, 8:]  # starts 16 bytes in: aligned
    assert mma.aligned(x)
    x = torch.zeros(1, 260, dtype=torch.bfloat16)[:, 4:]  # 8 bytes in
    assert not mma.aligned(x)
    with pytest.raises(ValueError, match="16 bytes"):
        mma.w4a16_mma(x, torch.zeros(16, 32, dtype=torch.int32), torch.ones(2, 16).t())
