"""Compile every Triton kernel the kernel tests launch for a GPU this machine does not have.

    python scripts/compile_check.py --arch 87 [pytest args]
    (default pytest args: tests/kernel tests/quantization/test_triton_kernels.py)

Jetson Orin (sm87) runs torch 2.4 with Triton 3.0, older than the Triton the H200 and CI use: a
kernel that uses a newer language feature, or does not fit sm87's registers and shared memory,
only shows up there. This runs the kernel tests on the CPU with every launch replaced by an offline
compile (`triton.compile` for the target; no driver, no GPU) of the same kernel with the same
argument types, constexprs and launch options, the GPU-sized test cases included. Each distinct
compile is reported once; the exit status is 1 if any failed. The tests' own assertions fail (no
kernel runs), which is expected: only compile errors count. Integer arguments are compiled as plain
i32 / i64, without the launch-time specialisation Triton applies (== 1, multiple of 16), so a
variant that only such a value selects is compiled in its generic form.

Works with Triton 3.0 (Orin's) and newer (ASTSource signatures changed in between), e.g. in a venv
with `pip install --no-deps triton==3.0.0`. Not part of the test suite: it needs a second Triton.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_DTYPES = {
    "bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "int8": "i8", "uint8": "u8",
    "int16": "i16", "int32": "i32", "int64": "i64", "bool": "i1",
}  # fmt: skip
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg", "launch_pdl")


def _arg_type(value: Any) -> str | None:
    """Triton's signature type for a runtime argument (None: not a runtime value)."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


class CompileCheck:
    """Replaces JITFunction.run: compiles each launch for `arch` instead of running it."""

    def __init__(self, arch: int, pdl: bool = False) -> None:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        self.triton, self.ASTSource = triton, ASTSource
        self.target = GPUTarget("cuda", arch, 32)
        self.new_api = "constexprs" in inspect.signature(ASTSource.__init__).parameters
        self.results: dict[str, str | None] = {}  # key -> None (compiled) or the error
        self.pdl = pdl  # compile kernels with a USE_PDL constexpr as PDL launches (sm90+)

    def run(self, fn: Any, args: tuple, kwargs: dict) -> None:
        if self.pdl and "USE_PDL" in kwargs:
            kwargs["USE_PDL"] = kwargs["launch_pdl"] = True
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
        bound = fn.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        sig: dict[Any, str] = {}
        consts: dict[Any, Any] = {}
        for i, (param, (name, value)) in enumerate(zip(fn.params, bound.arguments.items())):
            if param.is_constexpr:
                consts[name if self.new_api else i] = value
                if self.new_api:
                    sig[name] = "constexpr"
                continue
            kind = _arg_type(value)
            if kind is None:  # None for an unused optional pointer: a constant
                consts[name if self.new_api else i] = value
                if self.new_api:
                    sig[name] = "constexpr"
            else:
                sig[name if self.new_api else i] = kind
        key = f"{fn.__name__} {sorted((str(k), str(v)) for k, v in consts.items())} {sorted(options.items())}"
        key += f" {list(sig.values())}"
        if key in self.results:
            return
        try:
            if self.new_api:
                src = self.ASTSource(fn=fn, signature=sig, constexprs=consts)
            else:
                src = self.ASTSource(fn=fn, signature=sig, constants=consts)
            self.triton.compile(src, target=self.target, options=options)
            self.results[key] = None
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            msg = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            self.results[key] = msg[-2000:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=87, help="compute capability as an int (87: Orin, 90: H100/H200)")
    p.add_argument("--pdl", action="store_true", help="compile the kernels that can as PDL launches (sm90+)")
    args, pytest_args = p.parse_known_args()
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path[:0] = [str(ROOT / "kernels"), str(ROOT)]
    import mllmd_kernels.testing as testing
    import pytest
    from triton.runtime.jit import JITFunction

    check = CompileCheck(args.arch, args.pdl)

    def run(self: Any, *a: Any, grid: Any, warmup: bool, **kw: Any) -> None:
        check.run(self, a, kw)

    JITFunction.run = run  # type: ignore[method-assign]
    # The tests run on CPU tensors, with the GPU-sized cases (the test modules import these later).
    testing.kernel_device = lambda: "cpu"
    testing.on_gpu = lambda: True
    pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", "--no-header", "--tb=no", "-rN",
                 *(pytest_args or ["tests/kernel", "tests/quantization/test_triton_kernels.py"])])  # fmt: skip
    failed = {k: v for k, v in check.results.items() if v is not None}
    import triton

    done = f"{len(check.results)} distinct compiles, {len(failed)} failed"
    print(f"\n# Triton {triton.__version__}, sm_{args.arch}{' with PDL' if args.pdl else ''}: {done}")
    for key, msg in failed.items():
        print(f"FAILED {key}\n    {msg.replace(chr(10), chr(10) + '    ')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
