"""Barriers inside the K loop of the one-row int8 gemv, per tiling, from an offline compile.

    python scripts/gemv_loop_barriers.py [--arch 90] [--tilings 16x1024x4 16x2048x4 ...]

A `bar.sync` in the loop means the activation words went through shared memory on every K step
(a layout conversion between the 1-D row and the weight tile's columns). The script compiles
`_int8_gemv_kernel` with `triton.compile` for the target (no GPU needed) on int8 rows and with the
quantization fused in (bf16 x), the way `_gemv` launches it with dp4a (K a multiple of the block),
and prints one JSON line per variant: the barriers in the loop and in the whole kernel. It says
nothing about speed: it points at tilings worth timing (bench_quant --m 1 --sweep int8).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def loop_barriers(ptx: str) -> int:
    """bar.sync instructions inside loops: in the basic blocks LLVM marks as in a loop (the label's
    comment says "Loop Header" or "in Loop", wherever the blocks are laid out), or, where labels
    carry no comments (Triton 3.0), between a label and a later branch back to it."""
    lines = ptx.splitlines()
    in_loop = [False] * len(lines)
    where: dict[str, int] = {}
    marked = False
    for i, line in enumerate(lines):
        m = re.match(r"^(\$L__BB\d+_\d+):", line)
        if m:
            where[m.group(1)] = i
            marked = "Loop Header" in line or "in Loop" in line
        in_loop[i] = marked
        back = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if back and back.group(1) in where:  # a backward branch: the lines since its label loop
            for j in range(where[back.group(1)], i + 1):
                in_loop[j] = True
    return sum(1 for i, line in enumerate(lines) if in_loop[i] and "bar.sync" in line)


def compile_gemv(fuse: bool, block_k: int, warps: int, arch: int) -> str:
    import triton
    from mllmd_kernels.int8_gemm import _int8_gemv_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"a_ptr": "*bf16" if fuse else "*i32", "b_ptr": "*i32", "as_ptr": "*fp32", "bs_ptr": "*fp32",
           "bias_ptr": "*fp32", "c_ptr": "*bf16", "part_ptr": "*bf16", "N": "i32", "K": "i32",
           "stride_bn": "i32", "K_PER_SPLIT": "i32"}  # fmt: skip
    consts = dict(BLOCK_N=16, BLOCK_K=block_k, HAS_BIAS=False, IS_SPLIT=False, EVEN_K=True, FUSE_QUANT=fuse,
                  SCALE_BLOCK=8192, DP4A=True, USE_ASM=True, USE_PDL=False, SILU_MUL=False)  # fmt: skip
    if "constexprs" in inspect.signature(ASTSource.__init__).parameters:  # Triton 3.3 and newer
        sig.update(dict.fromkeys(consts, "constexpr"))
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(11)}  # what a launch specialises on
        src = ASTSource(fn=_int8_gemv_kernel, signature=sig, constexprs=consts, attrs=attrs)
    else:  # Triton 3.0 (Orin's): arguments by position
        from triton.compiler.compiler import AttrsDescriptor

        names = list(inspect.signature(_int8_gemv_kernel.fn).parameters)
        src = ASTSource(fn=_int8_gemv_kernel, signature={names.index(k): v for k, v in sig.items()},
                        constants={names.index(k): v for k, v in consts.items()},
                        attrs=AttrsDescriptor(divisible_by_16=tuple(range(11))))  # fmt: skip
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}).asm["ptx"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--tilings", nargs="+", default=["16x1024x4", "16x2048x4", "16x2048x8", "16x4096x8"],
                   help="BLOCK_N x BLOCK_K x warps (BLOCK_N is 16 here, as pick_int8_config uses)")
    args = p.parse_args()
    sys.path[:0] = [str(ROOT / "kernels"), str(ROOT)]
    for tiling in args.tilings:
        _, bk, warps = (int(v) for v in tiling.split("x"))
        for fuse in (False, True):
            ptx = compile_gemv(fuse, bk, warps, args.arch)
            print(json.dumps({"tiling": tiling, "input": "bf16 row, quantized in-kernel" if fuse else "int8 rows",
                              "arch": args.arch, "loop_bar_sync": loop_barriers(ptx),
                              "bar_sync": ptx.count("bar.sync")}))  # fmt: skip


if __name__ == "__main__":
    main()
