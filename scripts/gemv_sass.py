"""Instructions per weight in the K loop of the one-row W4A16 and int8 gemvs, from an offline compile.

    python scripts/gemv_sass.py [--arch 90] [--shapes 6144x4096 4096x4096 24576x4096 4096x12288] [--group 128]

A one-row gemv that issues more instructions per weight than the SMs can retire at memory speed is
bound by instructions, not bytes. The script compiles each kernel the way its wrapper launches it for
an N x K weight (`pick_w4a16_config`, the int8 gemv's dp4a tiling; K split as for an H200's 132 SMs),
disassembles the cubin with the nvdisasm that ships with Triton, and prints one JSON line per kernel
and shape: the instructions in the main K loop (the longest backward branch), the weights each thread
handles per trip, their ratio, the loop's barriers and its commonest opcodes. It counts static
instructions, so it says nothing about stalls: it points at what to time, not at a speed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
H200_SMS = 132
SMEM = 232448  # an H200 SM's shared memory per block (opt-in), as max_shared_memory reports it

_OP = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def main_loop(sass: str) -> list[str]:
    """The opcodes of the longest loop in nvdisasm output: the instructions between a label and the
    last branch back to it."""
    lines = sass.splitlines()
    labels: dict[str, int] = {}
    best: tuple[int, int] = (0, -1)
    for i, line in enumerate(lines):
        m = re.match(r"^\s*\.(L_x_\d+):", line)
        if m:
            labels[m.group(1)] = i
        b = re.search(r"\bBRA\b.*?\.(L_x_\d+)", line)
        if b and b.group(1) in labels and i - labels[b.group(1)] > best[1] - best[0]:
            best = (labels[b.group(1)], i)
    ops = [_OP.search(line) for line in lines[best[0] : best[1] + 1]]
    return [m.group(1) for m in ops if m]


def disassemble(cubin: bytes) -> str:
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def loop_report(ops: list[str], weights_per_thread: int) -> dict[str, Any]:
    counts = collections.Counter(ops)
    return {"loop_instructions": len(ops), "weights_per_thread": weights_per_thread,
            "per_weight": round(len(ops) / weights_per_thread, 2), "loop_barriers": counts["BAR"],
            "ops": dict(counts.most_common(8))}  # fmt: skip


def w4a16_gemv(n: int, k: int, group: int, arch: int) -> dict[str, Any]:
    from mllmd_kernels.splitk import k_splits
    from mllmd_kernels.testing import compile_asm
    from mllmd_kernels.w4a16_config import group_block_k, pick_w4a16_config
    from mllmd_kernels.w4a16_gemv import _w4a16_gemv_kernel

    cfg = pick_w4a16_config(1, n, k, group, H200_SMS, SMEM)
    bk = group_block_k(cfg.block_k, group, k)
    step = bk * cfg.sub_steps  # K columns per loop trip, as w4a16_gemm splits K
    split = k_splits(k, cfg.split_k, step)[1]
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*fp32", "bias_ptr": "*fp32",
           "y_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32", "N": "i32", "K": "i32", "KW": "i32",
           "SPLIT_K": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_sg": "i32", "stride_zn": "i32",
           "stride_zg": "i32", "K_PER_SPLIT": "i32"}  # fmt: skip
    pdl = arch >= 90
    consts = dict(BLOCK_N=cfg.block_n, BLOCK_K=bk, SUB_STEPS=cfg.sub_steps, TILED_W=False, LOAD_ONLY=False,
                  GROUP_STEPS=0 if group >= k else group // bk, HAS_ZP=False,
                  HAS_BIAS=False, IS_SPLIT=split > 1, SERIAL=split > 1, EVEN_K=k % step == 0,
                  NUM_STAGES=cfg.num_stages, USE_PDL=pdl)  # fmt: skip
    opts: dict[str, Any] = {"num_stages": cfg.num_stages, "enable_fp_fusion": True}
    if pdl:
        opts["launch_pdl"] = True
    asm = compile_asm(_w4a16_gemv_kernel, sig, consts, arch, cfg.num_warps, **opts)
    per_thread = cfg.block_n * step // (32 * cfg.num_warps)
    tiling = f"{cfg.block_n}x{bk} {cfg.num_warps} warps {cfg.num_stages} stages, split {split}"
    return {"kernel": "w4a16_gemv", "tiling": tiling, **loop_report(main_loop(disassemble(asm["cubin"])), per_thread)}


def int8_gemv(arch: int) -> dict[str, Any]:
    from mllmd_kernels.testing import int8_gemv_asm

    block_k, warps = 1024, 4  # the dp4a tiling of the one-row int8 gemv on int8 rows
    asm = int8_gemv_asm(False, block_k, warps, arch)
    report = loop_report(main_loop(disassemble(asm["cubin"])), 16 * block_k // (32 * warps))
    return {"kernel": "int8_gemv", "tiling": f"16x{block_k} {warps} warps (int8 rows)", **report}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--shapes", nargs="+", default=["6144x4096", "4096x4096", "24576x4096", "4096x12288"],
                   help="N x K of each weight (Qwen3-8B's qkv, o, gate_up, down)")
    p.add_argument("--group", type=int, default=128, help="W4A16 group size (K for channel-wise)")
    args = p.parse_args()
    sys.path[:0] = [str(ROOT / "kernels"), str(ROOT)]
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        print(json.dumps({"arch": args.arch, "shape": shape, "group": args.group,
                          **w4a16_gemv(n, k, min(args.group, k), args.arch)}))  # fmt: skip
    print(json.dumps({"arch": args.arch, **int8_gemv(args.arch)}))


if __name__ == "__main__":
    main()
