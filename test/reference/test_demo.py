"""The README's demo command, small: CP ranks + Mooncake decode on 127.0.0.1, every check PASS."""

import os
import subprocess
import sys

import pytest

ENV = dict(os.environ, TRITON_INTERPRET="1", MC_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1")


@pytest.mark.multirank
@pytest.mark.mooncake
def test_demo_small_settings_pass(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "sglang_cp_shared_kv.reference.demo",
        "--cp-size",
        "2",
        "--requests",
        "3",
        "--request-len",
        "160",
        "--chunk",
        "128",
        "--layers",
        "1",
        "--kv-format",
        "bf16",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    passes = [line for line in out.splitlines() if line.startswith("PASS")]
    assert len(passes) == 3 and "FAIL" not in out, out
    assert "share of replicated" in out and "current-reuse hits" in out
    assert (tmp_path / "cp_shared_kv_demo.png").stat().st_size > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--page-size", "24"], "--page-size must be a power of two"),
        (["--cp-size", "0"], "--cp-size must be >= 1"),
        (["--kv-format", "fp16"], "invalid choice"),
    ],
)
def test_demo_rejects_bad_options_in_one_line(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_cp_shared_kv.reference.demo", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert proc.returncode == 2
    assert message in proc.stderr.strip().splitlines()[-1]
