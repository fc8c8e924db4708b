"""The rope launches' compile options, checked offline (no GPU): Qwen3.5's launch (partial rotary, the
zero-centred norm) turns FP fusion off, so that no rounded product folds into an FMA with the add
after it (on an H200 that fold, fma.rn.bf16x2, changed about 6% of its bf16 outputs against the torch
route); the full-rotary launches keep Triton's default."""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import pytest
import torch
from mllmd_kernels import _triton as kt
from mllmd_kernels import rope

pytestmark = pytest.mark.skipif(not kt.HAS_TRITON or kt.interpreting(), reason="an offline compile: needs Triton, not its interpreter")


class _Recorder:
    """Stands in for _rope_kernel: records a launch's arguments instead of running it."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _launch(monkeypatch: pytest.MonkeyPatch, d: int, r: int, zero_centred: bool) -> dict[str, Any]:
    rope_mod = importlib.import_module("mllmd_kernels.rope")  # the module (the package exports the function)
    recorder = _Recorder()
    monkeypatch.setattr(rope_mod, "_rope_kernel", recorder)
    q, k = torch.zeros(1, 8, d, dtype=torch.bfloat16), torch.zeros(1, 2, d, dtype=torch.bfloat16)
    cos = torch.zeros(4, r)
    w = torch.zeros(d, dtype=torch.bfloat16)
    rope(torch.zeros(1, dtype=torch.int64), q, k, cos, cos, w, w, 1e-6, zero_centred_norm=zero_centred)
    ((_, kwargs),) = recorder.launches
    return kwargs


def test_qwen3_5_launch_has_no_fma_and_the_others_are_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    from mllmd_kernels.rope import _rope_kernel
    from mllmd_kernels.testing import compile_ptx

    assert "enable_fp_fusion" not in _launch(monkeypatch, 128, 128, zero_centred=False)  # Qwen3: as before
    kwargs = _launch(monkeypatch, 256, 64, zero_centred=True)  # Qwen3.5-2B
    assert kwargs["enable_fp_fusion"] is False and kwargs["PASS_BLOCK"] == 256 and kwargs["ZERO_CENTRED"]
    names = list(inspect.signature(_rope_kernel.fn).parameters)
    consts = {n: kwargs[n] for n in names if n in kwargs}
    types = {"pos_ptr": "*i64", "loc_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "eps": "fp32"}
    sig = {n: types.get(n, "*bf16" if n.endswith("_ptr") else "i32") for n in names if n not in consts}
    for fusion in (False, True):
        ptx = compile_ptx(_rope_kernel, sig, consts, 90, kwargs["num_warps"], enable_fp_fusion=fusion)
        fmas = len(re.findall(r"\bfma\.", ptx))
        assert fmas > 0 if fusion else fmas == 0  # with fusion the compiler does fold them
