"""The README's demo command, small: SGLang's pools with the plugin on CP 2 and 4 gloo ranks, Mooncake to a
decode on 127.0.0.1, every check PASS; ``--help``, one-line errors, and a clean Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO_SH = ROOT / "scripts" / "demo.sh"
ENV = dict(os.environ, TRITON_INTERPRET="1", MC_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1")
# ``python -m demo``: the demo is the repository's top-level package, whatever the test's directory.
ENV["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
ENV.pop("SGLANG_CP_SHARED_KV_ARENA_CONTEXTS", None)  # the view arena's default size
NOISE = ("InitGoogleLogging", "Using default malloc/free", "Local segment descriptor", "Traceback", "Warning")
CHECKS = ("prefill", "transfer", "rebuilt KV", "decode step")


def _demo_sh(args, cwd, timeout=400):
    """``bash scripts/demo.sh ARGS`` run from ``cwd`` (not the repository root)."""
    return subprocess.run(
        ["bash", str(DEMO_SH), *args], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd
    )


@pytest.mark.multirank
@pytest.mark.mooncake
@pytest.mark.sglang
@pytest.mark.parametrize("cp", [2, 4])
def test_demo_passes_every_check_through_sglangs_classes(tmp_path, cp):
    args = ["--cp-size", str(cp), "--requests", "2", "--request-len", "130", "--chunk", "128", "--out", "plots"]
    proc = _demo_sh(args, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    lines = out.splitlines()
    verdicts = [line for line in lines if line.startswith(("PASS", "FAIL"))]
    assert [v.split(":")[0] for v in verdicts] == [f"PASS {c}" for c in CHECKS], out
    for name in ("CPSharedDSATokenToKVPool", "PageInterleavePoolAllocator", "MooncakeKVSender", "MooncakeKVReceiver"):
        assert name in out, name
    assert "stock (replicated)" in out and "kv-cache-sharding" in out and "cp-shared-kv (ours)" in out
    assert not any(n in out + proc.stderr for n in NOISE), out + proc.stderr
    plot = tmp_path / "plots" / "cp_shared_kv_demo.png"  # the relative --out, under the caller's directory
    assert plot.stat().st_size > 0 and lines[-1] == f"plot: {plot}"
    numbers = json.loads((tmp_path / "plots" / "cp_shared_kv_demo.json").read_text())
    assert numbers["passed"] is True and set(numbers["per_rank"]) == {str(r) for r in range(cp)}
    batches = numbers["batches"]
    assert batches[0]["read"] == "current" and any(b["read"] == "materialized" for b in batches)
    for r, rank in numbers["per_rank"].items():
        # Each rank holds 1/cp of the replicated pool's pages (the trash page aside) and receives only prefixes.
        assert rank["kv_held_bytes"] * cp < rank["stock_kv_held_bytes"] * 1.5, (r, rank)
        received = rank["bytes_received_per_batch"]
        assert received[0] == 0 and all(x > 0 for x, b in zip(received, batches) if b["read"] == "materialized")
        assert rank["bytes_sent_to_decode"] > 0
        # Memory: the imports' share measured apart from the peak it is part of.
        assert 0 < rank["rss_after_imports_bytes"] <= rank["peak_rss_bytes"], (r, rank)
    assert 0 < numbers["decode"]["rss_after_imports_bytes"] <= numbers["decode"]["peak_rss_bytes"], numbers["decode"]


def test_demo_help_and_one_line_errors(tmp_path):
    proc = _demo_sh(["--help"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: scripts/demo.sh"), proc.stdout + proc.stderr
    for option in ("--cp-size", "--requests", "--request-len", "--chunk", "--page-size", "--out"):
        assert option in proc.stdout
    for args, message in [
        (["--page-size", "24"], "--page-size must be a power of two"),
        (["--cp-size", "1"], "--cp-size must be >= 2"),
        (["--chunk", "100"], "--chunk must be a multiple of --page-size 64"),
    ]:
        proc = subprocess.run([sys.executable, "-m", "demo", *args], capture_output=True, text=True, env=ENV)
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        assert message in proc.stderr.strip().splitlines()[-1]


@pytest.mark.multirank
@pytest.mark.mooncake
@pytest.mark.sglang
def test_demo_ctrl_c_stops_every_process_without_a_traceback(tmp_path):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it, while the ranks run."""
    # The demo starts as from a terminal: SIGINT not ignored. A test session started as a background
    # job ignores SIGINT, and an ignored signal stays ignored across exec; a handler does not.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "demo", "--cp-size", "2", "--requests", "2"]
            + ["--request-len", "2048", "--out", str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
            start_new_session=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "prefill: batch" in line:
            break
    assert any("prefill: batch" in line for line in seen), "".join(seen) + proc.stderr.read()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert err.strip().splitlines()[-1].startswith("interrupted:"), err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, out + err
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # raises once no process of the group is left
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("processes of the demo are still alive after Ctrl-C")
