"""Helpers for the kernel tests: where to run (CUDA, or CPU under TRITON_INTERPRET=1) and error metrics."""

from __future__ import annotations

from typing import Any

import torch

from mllmd_kernels._triton import HAS_TRITON, interpreting, triton_available

# ||out - ref|| / ||ref|| bounds against an fp32 reference (METHOD: bf16 operands land 1e-3..1e-2).
REL_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1.5e-2}
DTYPES = [torch.float16, torch.bfloat16]
DTYPES_WITH_FP32 = [torch.float32, torch.float16, torch.bfloat16]


def kernel_device() -> str | None:
    """"cuda" with a GPU and Triton, "cpu" under the Triton interpreter, else None (skip)."""
    if triton_available() and not interpreting():
        return "cuda"
    if HAS_TRITON and interpreting():
        return "cpu"
    return None


def skip_reason() -> str:
    return "needs CUDA + triton (or TRITON_INTERPRET=1 with triton installed)"


def on_gpu() -> bool:
    return kernel_device() == "cuda"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def randn(*shape: int, dtype: torch.dtype, device: str, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Fresh normal values drawn on the CPU generator (reproducible per test case), then moved."""
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel forgets to write fails the check."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def close_tol(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances for kernels that round at the same points as their reference: about
    two units in the last place (fp32 statistics may differ in the last bit; Triton's interpreter
    also truncates fp32 -> bf16 instead of rounding to nearest, so chains of roundings drift further
    there: bf16 gets a wider bound under the interpreter; the GPU run holds the tight one)."""
    if dtype == torch.bfloat16 and interpreting():
        return {"rtol": 4e-2, "atol": 8e-2}
    return {
        torch.float32: {"rtol": 1e-5, "atol": 1e-5},
        torch.float16: {"rtol": 2e-3, "atol": 2e-3},
        torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
    }[dtype]


def make_paged_kv(
    seq_lens: list[int], hkv: int, d: int, dtype: torch.dtype, device: str, g: torch.Generator, rows: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random paged KV layout: (k_buf [S+1, Hkv, D], v_buf, req_to_token [R, L], req_pool_indices [B]).

    Slot 0 is padding, each request's slots are scattered at random, and the table's unused entries
    are garbage (they must never be read)."""
    total = sum(seq_lens)
    slots = total + 17
    max_len = max(seq_lens + [1]) + 5
    rows = max(rows, len(seq_lens) + 3)
    k_buf = randn(slots + 1, hkv, d, dtype=dtype, device=device, gen=g)
    v_buf = randn(slots + 1, hkv, d, dtype=dtype, device=device, gen=g)
    table = torch.randint(0, slots + 1, (rows, max_len), generator=g)
    perm = torch.randperm(slots, generator=g) + 1
    req_rows = torch.randperm(rows, generator=g)[: len(seq_lens)]
    start = 0
    for r, n in zip(req_rows.tolist(), seq_lens):
        table[r, :n] = perm[start : start + n]
        start += n
    return k_buf, v_buf, table.to(device), req_rows.to(device)


def compile_ptx(
    kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], arch: int, num_warps: int, **options: Any
) -> str:
    """PTX of `kernel` compiled offline for sm_`arch` (see compile_asm)."""
    return compile_asm(kernel, signature, constexprs, arch, num_warps, **options)["ptx"]


def compile_asm(
    kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], arch: int, num_warps: int, **options: Any
) -> dict[str, Any]:
    """Every stage of `kernel` compiled offline for sm_`arch` (no GPU needed): "ttgir", "ptx",
    "cubin", ...; `signature` gives the runtime arguments' Triton types ("*i32", "i32"), every pointer
    and integer taken as 16-divisible, as a launch specialises them. Works with Triton 3.0 (Orin's;
    arguments by position) and newer."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "constexprs" in inspect.signature(ASTSource.__init__).parameters:  # Triton 3.3 and newer
        sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}
        src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    else:
        from triton.compiler.compiler import AttrsDescriptor

        names = list(inspect.signature(kernel.fn).parameters)
        src = ASTSource(fn=kernel, signature={names.index(k): v for k, v in signature.items()},
                        constants={names.index(k): v for k, v in constexprs.items()},
                        attrs=AttrsDescriptor(divisible_by_16=tuple(range(len(signature)))))  # fmt: skip
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(src, target=target, options={"num_warps": num_warps, **options}).asm


def int8_gemv_ptx(fuse: bool, block_k: int, warps: int, arch: int, pdl: bool = False, amax_in: int = 0) -> str:
    """PTX of the one-row `_int8_gemv_kernel` (see int8_gemv_asm)."""
    return int8_gemv_asm(fuse, block_k, warps, arch, pdl, amax_in)["ptx"]


def int8_gemv_asm(
    fuse: bool, block_k: int, warps: int, arch: int, pdl: bool = False, amax_in: int = 0
) -> dict[str, Any]:
    """The one-row `_int8_gemv_kernel` compiled as `int8_gemv` launches it with dp4a (BLOCK_N 16, K a
    multiple of the block): on int8 rows, or (`fuse`) on a bf16 row it quantizes, its scale from up
    to `amax_in` max|x| partials if given; `pdl`: a PDL launch (sm90+), with the weight prefetch
    before the wait."""
    from mllmd_kernels.int8_gemv import _int8_gemv_kernel

    sig = {"a_ptr": "*bf16" if fuse else "*i32", "b_ptr": "*i32", "as_ptr": "*fp32", "bs_ptr": "*fp32",
           "bias_ptr": "*fp32", "c_ptr": "*bf16", "part_ptr": "*bf16", "N": "i32", "K": "i32",
           "stride_bn": "i32", "K_PER_SPLIT": "i32", "amax_ptr": "*fp32", "n_amax": "i32"}  # fmt: skip
    consts = dict(BLOCK_N=16, BLOCK_K=block_k, HAS_BIAS=False, IS_SPLIT=False, EVEN_K=True, FUSE_QUANT=fuse,
                  SCALE_BLOCK=8192, DP4A=True, USE_ASM=True, USE_PDL=pdl, SILU_MUL=False, PREFETCH=pdl,
                  AMAX_IN=amax_in, AMAX_OUT=False)  # fmt: skip
    return compile_asm(_int8_gemv_kernel, sig, consts, arch, warps, **({"launch_pdl": True} if pdl else {}))
