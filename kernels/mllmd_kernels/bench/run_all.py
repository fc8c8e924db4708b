"""Run every kernel benchmark on CUDA: JSON lines per case, then a table.

    python -m mllmd_kernels.bench.run_all [--out DIR] [--sweep-m 1 16 64] [--only gemv ops attention]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--only", nargs="+", default=["gemv", "ops", "attention"])
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--sweep-m", type=int, nargs="*", default=[])
    p.add_argument("--gemv-dtypes", nargs="+", default=["bfloat16"])
    p.add_argument("--sweep-attention", action="store_true", help="also time attention tilings")
    args = p.parse_args(argv)
    from mllmd_kernels.bench import bench_attention, bench_gemv, bench_ops, common

    if not torch.cuda.is_available() and not common.SMOKE:
        sys.exit("the kernel benchmarks need CUDA")
    import triton

    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "bench.jsonl"), "w")  # noqa: SIM115
    common.set_log(log)
    t0 = time.time()
    copy = common.copy_bandwidth_gbps()
    common.emit({"kernel": "env", "device": common.DEVICE if common.SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "copy_gbps": round(copy, 1)})
    if "gemv" in args.only:
        dtypes = [getattr(torch, d) for d in args.gemv_dtypes]
        bench_gemv.bench(args.m, dtypes, args.sweep_m, copy, list(bench_gemv.SHAPES))
        print(f"# gemv done in {time.time() - t0:.0f}s", flush=True)
    if "ops" in args.only:
        bench_ops.main(copy)
        print(f"# ops done in {time.time() - t0:.0f}s", flush=True)
    if "attention" in args.only:
        bench_attention.main(copy, sweep=args.sweep_attention)
        print(f"# attention done in {time.time() - t0:.0f}s", flush=True)
    sweep = [r for r in common.ROWS if "best_config" in r]
    if sweep:
        print("# sweeps: best tiling per case")
        for r in sweep:
            print(json.dumps({k: r[k] for k in ("kernel", "shape", "ours_us", "best_us", "best_config")}))
    print(f"# copy bandwidth {copy:.0f} GB/s; total {time.time() - t0:.0f}s")
    common.print_table(common.ROWS)
    log.close()


if __name__ == "__main__":
    main()
