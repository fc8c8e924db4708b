"""Tests for the tegrastats parser's command line (`python -m mllmd.telemetry.tegrastats`).

Checks that the command reads tegrastats output on stdin and prints one JSON object per tegrastats
line (the same object `parse_line` gives, skipping garbage and undecodable bytes), that empty input
prints nothing and `--help` works, and that importing the module does not pull in torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tegrastats_cases import KEYS, REAL_CASES

from mllmd.telemetry.tegrastats import parse_line

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run_cli(stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "mllmd.telemetry.tegrastats"],
        input=stdin,
        capture_output=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=60,
        check=False,
    )


def test_cli_prints_one_json_object_per_tegrastats_line() -> None:
    real = [p.values[0] for p in REAL_CASES]
    garbage = ["", "hello", "Segmentation fault", "CPU [1%@100]"]
    interleaved: list[str] = []
    for i, line in enumerate(real):
        interleaved.append(line)
        interleaved.append(garbage[i % len(garbage)])
    stdin = ("\n".join(interleaved) + "\n").encode() + b"\xff\xfe not utf-8\n"
    proc = _run_cli(stdin)
    assert proc.returncode == 0, proc.stderr.decode()
    out_lines = proc.stdout.decode().splitlines()
    assert len(out_lines) == len(real)
    for line, text in zip(real, out_lines, strict=True):
        obj = json.loads(text)
        assert set(obj) == KEYS
        for cpu in obj["cpus"]:
            assert set(cpu) == {"online", "utilization", "frequency_hz"}
        for rail in obj["power_mw"].values():
            assert set(rail) == {"current", "average"}
        assert obj == parse_line(line).to_json_dict()


def test_cli_empty_input_and_help() -> None:
    proc = _run_cli(b"")
    assert proc.returncode == 0 and proc.stdout == b""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT)
    help_proc = subprocess.run(
        [sys.executable, "-m", "mllmd.telemetry.tegrastats", "--help"],
        capture_output=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=60,
        check=False,
    )
    assert help_proc.returncode == 0 and b"stdin" in help_proc.stdout


def test_module_does_not_import_torch() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT)
    code = "import sys, mllmd.telemetry.tegrastats; assert 'torch' not in sys.modules, 'torch'"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, cwd=REPO_ROOT, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr.decode()
