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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--tilings", nargs="+", default=["16x1024x4", "16x2048x4", "16x2048x8", "16x4096x8"],
                   help="BLOCK_N x BLOCK_K x warps (BLOCK_N is 16 here, as pick_int8_config uses)")
    args = p.parse_args()
    sys.path[:0] = [str(ROOT / "kernels"), str(ROOT)]
    from mllmd_kernels.testing import int8_gemv_ptx

    for tiling in args.tilings:
        _, bk, warps = (int(v) for v in tiling.split("x"))
        for fuse in (False, True):
            ptx = int8_gemv_ptx(fuse, bk, warps, args.arch)
            print(json.dumps({"tiling": tiling, "input": "bf16 row, quantized in-kernel" if fuse else "int8 rows",
                              "arch": args.arch, "loop_bar_sync": loop_barriers(ptx),
                              "bar_sync": ptx.count("bar.sync")}))  # fmt: skip


if __name__ == "__main__":
    main()
