"""scripts/gemv_sass.py: the SASS loop finder, and the W4A16 gemv's instruction budget (offline compile)."""

from __future__ import annotations

import os

import pytest

from scripts.gemv_sass import loop_report, main_loop

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0030*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0040*/                   LOP3.LUT R5, R2, 0xf, RZ, 0xc0, !PT ;
        /*0050*/                   FFMA R6, R5, R7, R6 ;
        /*0060*/              @!P1 FFMA R8, R5, R9, R8 ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0080*/                   ISETP.GT.AND P1, PT, R3, 0x2, PT ;
        /*0090*/              @!P1 BRA `(.L_x_1) ;
        /*00a0*/                   EXIT ;
"""


def test_main_loop_is_the_longest_backward_branch_and_counts_predicated_instructions() -> None:
    ops = main_loop(SASS)
    assert ops == ["LOP3", "FFMA", "FFMA", "BAR", "ISETP", "BRA"]
    report = loop_report(ops, weights_per_thread=2)
    assert report["loop_instructions"] == 6 and report["per_weight"] == 3.0 and report["loop_barriers"] == 1
    assert report["ops"]["FFMA"] == 2


def _nvdisasm() -> bool:
    triton = pytest.importorskip("triton")
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for a GPU target")
def test_w4a16_gemv_spends_one_lop3_and_two_float_ops_per_weight_on_sm90() -> None:
    """The one-row W4A16 gemv's design (w4a16_gemm.py): each weight costs one LOP3 (nibble into 2**23's
    mantissa), one FMA (scale, subtract the bias) and one FMA into the partial; the compiler keeps it."""
    if not _nvdisasm():
        pytest.skip("this Triton ships no nvdisasm")
    from scripts.gemv_sass import w4a16_gemv

    r = w4a16_gemv(6144, 4096, 128, 90)
    per_thread = r["weights_per_thread"]
    assert r["ops"]["LOP3"] == per_thread
    float_ops = r["ops"].get("FFMA", 0) + r["ops"].get("FMUL", 0)
    # two per weight (a K step's first plane multiplies with an FMUL); the group scale adds FADDs, not counted
    assert 2 * per_thread <= float_ops <= 2 * per_thread + per_thread // 8
    assert r["per_weight"] < 4.5, r
