"""The README's demo command, small: SGLang's pools with the plugin on CP 2 to 8 gloo ranks, Mooncake to a
decode on 127.0.0.1 (one, or 2 and 3 ranks sharing its KV), every check PASS; ``--help``, one-line errors, and a clean Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from demo import limits

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
@pytest.mark.parametrize(
    "cp, dcp, shape",
    [
        (2, 1, ["--requests", "2", "--request-len", "130", "--chunk", "128"]),
        (3, 1, ["--requests", "2", "--request-len", "130", "--chunk", "128"]),
        (4, 1, ["--requests", "2", "--request-len", "130", "--chunk", "128"]),
        # One request of 9 pages: every rank of 8 owns one or two, and 2 of its 3 batches read a prefix view.
        (8, 1, ["--requests", "1", "--request-len", "520", "--chunk", "256"]),
        # A decode sharded 2 and 3 ways: each page from its prefill owner to its decode owner.
        (2, 2, ["--requests", "2", "--request-len", "330", "--chunk", "128"]),
        (2, 3, ["--requests", "2", "--request-len", "330", "--chunk", "128"]),
    ],
)
def test_demo_passes_every_check_through_sglangs_classes(tmp_path, cp, dcp, shape):
    args = ["--cp-size", str(cp), "--decode-cp-size", str(dcp), *shape, "--out", "plots"]
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
    decode = numbers["decode"]
    assert 0 < decode["rss_after_imports_bytes"] <= decode["peak_rss_bytes"], decode
    assert decode["cp_size"] == dcp and decode["step"]["ok"] and len(decode["kv_held_bytes"]) == dcp, decode
    if dcp > 1:  # every decode rank's step saw the replicated top-k and merged within the tolerance
        assert decode["step"]["top_equal"] and decode["step"]["ranks_agree"], decode
        assert f"each of the {dcp} decode ranks holds" in out
    # The driver's refusal of a --cp-size past the open-file limit estimates at least what every process held.
    files = [rank["open_files"] for rank in numbers["per_rank"].values()] + [numbers["decode"]["open_files"]]
    assert 0 < max(files) <= limits.FILES_BASE + limits.FILES_PER_RANK * (cp + dcp - 1), files


def test_demo_help(tmp_path):
    proc = _demo_sh(["--help"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: scripts/demo.sh"), proc.stdout + proc.stderr
    for option in (
        "--cp-size",
        "--decode-cp-size",
        "--requests",
        "--request-len",
        "--chunk",
        "--page-size",
        "--topk",
        "--out",
    ):
        assert option in proc.stdout
    assert "power of two" not in proc.stdout  # 64 is the only page size SGLang's DSA pool stores


# (arguments, environment, what the one line says): each refused in the driver, before any rank starts.
BAD_INPUTS = [
    (["--topk", "5000"], {}, "--topk 5000 is larger than the longest prompt (334 tokens)"),
    (["--topk", "65", "--request-len", "64", "--requests", "1"], {}, "use --topk 64 or less"),
    (["--request-len", "32760"], {}, "need a 33024-token context"),
    (["--request-len", "32640", "--chunk", "128"], {}, "use --request-len 32626 or less"),
    (["--request-len", "32000", "--requests", "1", "--chunk", "1024"], {}, "use --request-len 31744 or less"),
    (["--request-len", "64", "--requests", "1", "--chunk", "32768"], {}, "use --chunk 32704 or less"),
    (["--page-size", "32"], {}, "--page-size 32: SGLang's DSA pool stores 64-token pages only: use --page-size 64"),
    (["--page-size", "128"], {}, "use --page-size 64"),
    (["--chunk", "100"], {}, "--chunk 100 is not whole 64-token pages"),
    (["--cp-size", "1"], {}, "--cp-size 1: a CP-shared pool spans two ranks or more"),
    (["--cp-size", "100000"], {}, "--cp-size 100000 needs about"),
    (["--cp-size", "two"], {}, "argument --cp-size: invalid int value: 'two'"),
    (["--decode-cp-size", "0"], {}, "--decode-cp-size 0: use 1 (one decode) to 8 (decode CP ranks)"),
    (["--requests", "0"], {}, "--requests 0: use 1 or more"),
    ([], {"SGLANG_CP_SHARED_KV_ARENA_CONTEXTS": "0"}, "SGLANG_CP_SHARED_KV_ARENA_CONTEXTS must be an int >= 1"),
    ([], {"SGLANG_CP_SHARED_KV_PREFETCH": "2"}, 'SGLANG_CP_SHARED_KV_PREFETCH: "2" is not a valid boolean value'),
    ([], {"SGLANG_CP_SHARED_KV_TRANSPORT": "rdma"}, "SGLANG_CP_SHARED_KV_TRANSPORT must be one of"),
]


@pytest.mark.parametrize("args, env, says", BAD_INPUTS, ids=[" ".join(a) or next(iter(e)) for a, e, _ in BAD_INPUTS])
def test_demo_refuses_what_it_cannot_run_in_one_line(tmp_path, args, env, says):
    """Exit code 2 and one line on stderr, nothing on stdout, within seconds: no rank was started."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "demo", *args, "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=dict(ENV, **env),
        timeout=60,
    )
    took = time.monotonic() - t0
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], proc.stderr
    assert took < 20, took  # about a second on an idle machine (the settings check imports torch, not SGLang)


def test_demo_settings_line_is_the_servers(monkeypatch):
    """A bad setting is refused with the line the server's startup check prints for it."""
    from demo import limits
    from sglang_cp_shared_kv.srt.sglang_wiring import startup_checks

    monkeypatch.setenv("SGLANG_CP_SHARED_KV_ARENA_CONTEXTS", "two")
    with pytest.raises(limits.Refusal) as e:
        limits.check_settings()
    assert str(e.value) == "\n".join(startup_checks._setting_rejections())
    assert str(e.value).startswith("--enable-cp-shared-kv: SGLANG_CP_SHARED_KV_ARENA_CONTEXTS")
    monkeypatch.delenv("SGLANG_CP_SHARED_KV_ARENA_CONTEXTS")
    limits.check_settings()  # unset: nothing to refuse


def test_demo_open_files_limit_is_the_processes(monkeypatch):
    """The host check reads the open-file limit the ranks inherit, and refuses past it, naming a size that fits."""
    import resource

    from demo import limits

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert limits.open_files_limit() >= soft
    most = (1000 - limits.FILES_BASE) // limits.FILES_PER_RANK
    limits.check_host(most, 1000, None)
    with pytest.raises(limits.Refusal, match=f"use --cp-size {most} or less"):
        limits.check_host(most + 1, 1000, None)
    with pytest.raises(limits.Refusal, match="use --cp-size 3 or less"):
        limits.check_host(8, 1 << 20, 4 * limits.RANK_BYTES)


@pytest.mark.sglang
def test_demo_context_limit_is_sglangs(tmp_path):
    """The context the demo checks against is the one SGLang derives from the tiny model: SGLang accepts a
    ``--context-length`` of exactly it and refuses one more token, as the demo does."""
    from sglang.srt.configs.model_config import ModelConfig

    from demo import limits
    from demo.sglang_parts import MODELS, write_model_dirs

    limit = limits.model_context(MODELS["dsa"])
    assert limit >= limits.context_len(16384, 1024)  # the README's long prompt
    model_dir = write_model_dirs(tmp_path, ["dsa"])["dsa"]
    assert ModelConfig(str(model_dir), context_length=limit).context_len == limit
    with pytest.raises(ValueError, match=f"context_length \\({limit + 1}\\)"):
        ModelConfig(str(model_dir), context_length=limit + 1)
    # The demo's own arithmetic, at the boundary: the longest request whose context fits, and one token more.
    most = limit - 128 - limits.STRIDE * 2
    limits.check_context(most, 3, 128, limit)
    with pytest.raises(limits.Refusal, match=f"use --request-len {most} or less"):
        limits.check_context(most + 1, 3, 128, limit)


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
