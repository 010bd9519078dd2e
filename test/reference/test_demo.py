"""The README's demo command, small: CP ranks + Mooncake decode on 127.0.0.1, every check PASS.

Also what a user meets first: ``--help``, one-line errors before any work, relative ``--out`` from
another directory, no Mooncake log noise, a clean Ctrl-C, peak memory per rank against the chunk,
the tables and plot at CP 1, 3 and 16, and the per-batch bytes and view arena in the table and the JSON.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sglang_cp_shared_kv.reference.demo import (
    _fmt_bytes,
    capacity_multiplier,
    format_batches,
    format_report,
    plot_demo,
    wait_while_progressing,
)
from sglang_cp_shared_kv.reference.mooncake.transfer_state import TransferState
from sglang_cp_shared_kv.srt.sglang_wiring.view_arena import ARENA_CONTEXTS, ARENA_CONTEXTS_ENV

ROOT = Path(__file__).resolve().parents[2]
DEMO_SH = ROOT / "scripts" / "demo.sh"
ENV = dict(os.environ, TRITON_INTERPRET="1", MC_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1")
ENV.pop(ARENA_CONTEXTS_ENV, None)  # the view arena's default size
NOISE = ("InitGoogleLogging", "Using default malloc/free", "Local segment descriptor", "Traceback")
RSS_ROW = re.compile(r"^\s+(\d+)\s.*\s([\d.]+) (B|KiB|MiB|GiB)$")
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _demo_sh(args, cwd, timeout=300):
    """``bash scripts/demo.sh ARGS`` run from ``cwd`` (not the repository root)."""
    return subprocess.run(
        ["bash", str(DEMO_SH), *args], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd
    )


def _peak_rss_per_rank(out: str) -> list[int]:
    rss = []
    for line in out.splitlines():
        m = RSS_ROW.match(line)
        if m and line.split()[0].isdigit() and " s " in line:
            rss.append(int(float(m.group(2)) * UNITS[m.group(3)]))
    return rss


@pytest.mark.multirank
@pytest.mark.mooncake
@pytest.mark.parametrize(
    "cp, requests",
    [(3, 3), (1, 1)],
    ids=["cp3-shared-prefixes", "cp1-baseline-one-request"],
)
def test_demo_small_settings_pass(tmp_path, cp, requests):
    args = ["--cp-size", str(cp), "--requests", str(requests), "--request-len", "160", "--chunk", "128"]
    args += ["--layers", "1", "--kv-format", "bf16", "--out", "plots"]
    proc = _demo_sh(args, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    lines = out.splitlines()
    passes = [i for i, line in enumerate(lines) if line.startswith("PASS")]
    assert len(passes) == 3 and "FAIL" not in out, out
    # The relative --out lands under the caller's directory, printed absolute, after the verdicts.
    plot = tmp_path / "plots" / "cp_shared_kv_demo.png"
    assert plot.stat().st_size > 0
    plot_line = next(i for i, line in enumerate(lines) if line.startswith("plot: "))
    assert lines[plot_line] == f"plot: {plot}" and plot_line > passes[-1]
    assert f"output: {plot}" in out
    assert not any(n in out + proc.stderr for n in NOISE), out + proc.stderr
    assert max(len(line) for line in lines) <= 120
    assert "share of a full copy" in out and "current-reuse" in out
    assert len(_peak_rss_per_rank(out)) == cp
    header = lines[0]
    if requests > 1:
        assert "share their first 80 tokens" in header and "shared prefix page goes once per request" in out
    else:
        assert "share" not in header and "shared prefix" not in out
    if cp == 1:
        assert "CP size 1: the baseline" in out
    _check_batch_bytes(out, tmp_path / "plots" / "cp_shared_kv_demo.json", cp, requests)


def _check_batch_bytes(out: str, json_path: Path, cp: int, requests: int) -> None:
    """The view arena and each batch's bytes, in the JSON and the table, against what host lengths predict.

    The run: page size 16, bf16 rows, one layer, requests of 160 + 7 i tokens, chunk 128."""
    numbers = json.loads(json_path.read_text())
    assert numbers["passed"] is True and numbers["options"]["cp_size"] == cp
    ps, page_bytes = 16, 16 * (1152 + 132)  # a page of bf16 rows and indexer records, one layer
    arena = numbers["view_arena"]
    context = 160 + 7 * (requests - 1)
    prefix = ARENA_CONTEXTS * -(-context // (cp * ps)) * cp * ps  # whole rotations of cp pages
    assert (arena["contexts"], arena["context_len"], arena["prefix_tokens"], arena["chunk_tokens"]) == (
        ARENA_CONTEXTS,
        context,
        prefix,
        128,
    )
    assert arena["bytes"] == {3: 677952, 1: 595776}[cp] == (prefix + 128 + ps) // ps * page_bytes
    assert all(r["arena_bytes"] == arena["bytes"] for r in numbers["ranks"])  # one arena on every rank
    batches = numbers["batches"]
    for b in batches:
        prefix_pages = [-(-p // ps) for p in b["prefix_lens"]]
        view = cp * sum(-(-q // cp) for q in prefix_pages)  # the prefixes only, N * sum ceil(pages / N)
        staged = sum(-(-n // ps) for n in b["seq_lens"]) - sum(prefix_pages)
        assert b["current_chunk_bytes_gathered"] == 0, b  # the chunk is staged, never all-gathered
        if b["kind"] == "current":
            assert (b["current_reuse_hits"], b["view_pages"], b["bytes_materialized"], b["bytes_received"]) == (
                1,
                0,
                0,
                0,
            ), b
            continue
        assert (b["view_pages"], b["pages_staged"]) == (view, staged), b
        assert (view + staged) * ps <= arena["tokens"], b  # inside the arena
        assert b["bytes_materialized"] == view * page_bytes, b
        assert b["bytes_received"] * cp == b["bytes_materialized"] * (cp - 1), b  # (N - 1) / N of it
        assert b["bytes_received"] == (view - view // cp) * page_bytes, b
    kinds = {b["kind"] for b in batches}
    assert kinds == ({"current", "history", "mixed"} if requests > 1 else {"current", "history"})
    if cp > 1:
        assert sum(b["bytes_received"] for b in batches) > 0
    for r in numbers["ranks"]:  # every rank moves the same bytes
        for key in ("bytes_received", "bytes_materialized", "current_chunk_bytes_gathered"):
            assert r[key] == sum(b[key] for b in batches), (key, r)
    # The table: the arena in MiB above it, one row per batch carrying the JSON's numbers.
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("view arena: "))
    assert lines[at].startswith(f"view arena: {arena['bytes'] / 2**20:.2f} MiB per rank, allocated once: ")
    assert (
        lines[at + 1].split()
        == "batch kind reqs tokens view pages staged pages received materialized chunk gathered".split()
    )
    for b, line in zip(batches, lines[at + 2 :]):
        cols = line.split()
        assert cols[:4] == [str(b["batch"]), b["kind"], str(len(b["requests"])), str(b["tokens"])], line
        assert cols[4:6] == [str(b["view_pages"]), str(b["pages_staged"])], line
        moved = (_fmt_bytes(b[k]) for k in ("bytes_received", "bytes_materialized", "current_chunk_bytes_gathered"))
        assert line.endswith(" ".join(f"{m:>{w}}" for m, w in zip(moved, (12, 12, 14)))), line
    assert lines[at + 2 + len(batches)].split()[0] == "all"


def test_demo_help_names_the_script_and_shows_every_default(tmp_path):
    proc = _demo_sh(["--help"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert text.startswith("usage: scripts/demo.sh")
    # Each option's entry: from its line in "options:" to the next option's.
    entries = {}
    for chunk in re.split(r"\n  (?=--)", proc.stdout.split("options:", 1)[1])[1:]:
        entries[chunk.split()[0]] = " ".join(chunk.split())
    for option, default in [
        ("--cp-size", "4"),
        ("--page-size", "16"),
        ("--kv-format", "fp8"),
        ("--requests", "4"),
        ("--request-len", "384"),
        ("--chunk", "256"),
        ("--layers", "2"),
        ("--out", "demo_out"),
        ("--triton", "False"),
    ]:
        entry = entries[option]
        assert entry.endswith(f"(default: {default})"), (option, entry)
        assert len(entry.split("(default:")[0].split()) > 4, f"{option} has no help: {entry}"
    assert "1 runs the baseline" in text and "--triton" in text


def _one_line_error(args, env=None, cwd=None):
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_cp_shared_kv.reference.demo", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env or ENV,
        cwd=cwd,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""  # nothing started: no log line, no baseline
    assert time.monotonic() - t0 < 30
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--page-size", "24"], "--page-size must be a power of two"),
        (["--cp-size", "0"], "--cp-size must be >= 1"),
        (["--kv-format", "fp16"], "invalid choice"),
    ],
)
def test_demo_rejects_bad_options_in_one_line(args, message):
    assert message in _one_line_error(args)


def test_demo_rejects_what_cannot_fit_or_be_written_before_any_work(tmp_path):
    line = _one_line_error(["--request-len", "1000000000"])
    assert "of memory" in line and "is available" in line and re.search(r"--request-len \d+ fits", line), line
    line = _one_line_error(["--page-size", "1048576"])
    assert "--page-size 1048576 is larger than --request-len 384" in line and "--page-size 256 or less" in line
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = _one_line_error(["--out", str(blocker / "plots")])
    assert line.endswith(f"--out {blocker / 'plots'} is not writable: Not a directory"), line
    line = _one_line_error(["--out", str(blocker)])
    assert "is not writable: it is a file, not a directory" in line
    line = _one_line_error(["--triton"], env=dict(ENV, TRITON_INTERPRET="0"))
    assert "--triton" in line and "TRITON_INTERPRET=1" in line
    # The view arena's size comes from the plugin's setting; a stream past it is refused up front.
    line = _one_line_error([], env=dict(ENV, **{ARENA_CONTEXTS_ENV: "0"}))
    assert line.endswith(f"{ARENA_CONTEXTS_ENV} must be an int >= 1, got '0'"), line
    args = ["--cp-size", "2", "--page-size", "64", "--requests", "8", "--request-len", "64", "--chunk", "256"]
    # Arena: 2 prefix pages (one context of 113 tokens, 2 x 64 aligned) + 4 chunk pages + 1. Batch 2: request 3
    # (prefix 43: a 2-page view, 1 page staged) and requests 4, 5, 6 (2 + 2 + 1 pages staged) = 8 pages.
    line = _one_line_error(args, env=dict(ENV, **{ARENA_CONTEXTS_ENV: "1"}))
    assert line.endswith(
        f"prefill batch 2 reads 8 pages, more than the view arena's 7 ({ARENA_CONTEXTS_ENV}=1): raise {ARENA_CONTEXTS_ENV}"
    ), line


@pytest.mark.multirank
@pytest.mark.mooncake
def test_demo_ctrl_c_stops_every_process_without_a_traceback(tmp_path):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it, while the ranks run."""
    # The demo starts as from a terminal: SIGINT not ignored. A test session started as a background
    # job ignores SIGINT, and an ignored signal stays ignored across exec; a handler does not.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_cp_shared_kv.reference.demo", "--cp-size", "2", "--requests", "1"]
            + ["--request-len", "4096", "--layers", "1", "--out", str(tmp_path)],
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


@pytest.mark.multirank
@pytest.mark.mooncake
def test_demo_peak_memory_per_rank_grows_with_the_chunk_not_chunk_times_context(tmp_path):
    """3072 tokens, chunk 128 vs 1024: 896 more tokens per batch. The whole-batch indexer held fp32 keys
    per query (chunk x context x 512 B, 1.3 GiB more here); the blocked one adds only per-token work."""
    rss = {}
    for chunk in (128, 1024):
        args = ["--cp-size", "2", "--requests", "1", "--request-len", "3072", "--layers", "1"]
        proc = _demo_sh(args + ["--chunk", str(chunk), "--out", str(tmp_path)], cwd=tmp_path, timeout=400)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        rss[chunk] = _peak_rss_per_rank(proc.stdout)
        assert len(rss[chunk]) == 2, proc.stdout
    growth = max(rss[1024]) - max(rss[128])
    assert growth < (1024 - 128) * (256 << 10), rss  # < 256 KiB per extra chunk token (224 MiB)
    assert max(rss[1024]) < 1 << 30, rss


def _rows(owned, sent=1 << 20):
    return [{"owned_pages": n, "sent_bytes": sent if n else 0, "send_s": 0.5, "peak_rss": 450 << 20} for n in owned]


@pytest.mark.parametrize("cp", [1, 3, 16])
def test_report_table_fits_120_columns_and_counts_only_ranks_that_hold_pages(cp):
    owned = [10] * cp if cp < 16 else [10, 10, 10, 10] + [0] * 12
    lines = format_report(_rows(owned), sum(owned), 1 << 16, shared_prefixes=False, layers=2)
    assert max(len(line) for line in lines) <= 120
    assert lines[0].split()[:2] == ["rank", "KV"] and "sent to decode" in lines[0]
    assert sum(1 for line in lines if line.split() and line.split()[0].isdigit()) == cp
    at = next(i for i, line in enumerate(lines) if line.startswith("capacity per rank"))
    capacity = lines[at] + lines[at + 1]
    if cp == 16:
        assert "4.0x" in capacity and "4 of 16 ranks hold pages" in capacity
        assert capacity_multiplier([10, 0, 0], 10) == 1.0
    elif cp == 3:
        assert "3.0x" in capacity and "all 3 ranks" in capacity
    else:
        assert "1.0x" in capacity and "CP size 1: the baseline" in capacity
    assert not any("shared prefix" in line for line in lines)


@pytest.mark.parametrize("cp", [1, 3, 16])
def test_batch_table_fits_120_columns_and_lists_the_first_and_last_batches(cp):
    gib = 1 << 30
    batches = [
        {"batch": i + 1, "kind": ("current", "history", "mixed")[i % 3], "requests": [i, i + 1], "tokens": 16384}
        | {"view_pages": 99999, "pages_staged": 9999, "bytes_materialized": 1023 * gib}
        | {"bytes_received": 1023 * gib * (cp - 1) // cp, "current_chunk_bytes_gathered": 0}
        for i in range(45)
    ]
    arena = {"bytes": 950 * gib, "prefix_tokens": 2 * 1048576, "chunk_tokens": 65536, "contexts": 2}
    lines = format_batches(batches, arena | {"context_len": 1048576}, cp, 61)
    assert max(len(line) for line in lines) <= 120
    assert lines[0].startswith("view arena: 972800.00 MiB per rank, allocated once: 2097152 prefix tokens (2 contexts")
    rows = [line.split()[0] for line in lines[2:] if line.split()[0].isdigit()]
    assert rows == [str(i) for i in [*range(1, 11), *range(36, 46)]]
    assert any(line.split()[:2] == ["...", "(25"] for line in lines)
    total = next(line for line in lines if line.split()[0] == "all")
    assert total.split()[1:3] == ["46", str(45 * 16384)] and _fmt_bytes(45 * 1023 * gib) in total
    assert ("none at CP 1" in lines[-2]) == (cp == 1) and (f"{cp - 1}/{cp} of materialized" in lines[-2]) == (cp > 1)


@pytest.mark.parametrize("cp", [1, 3, 16])
def test_plot_is_written_at_every_cp_size(tmp_path, cp):
    pytest.importorskip("matplotlib")
    batches = [("current", {"bytes_materialized": 0, "current_reuse_hits": 2})]
    batches += [("history", {"bytes_materialized": (i + 1) << 20, "current_reuse_hits": 0}) for i in range(2)]
    path = plot_demo(tmp_path / "p.png", [3 << 20] * cp, (3 << 20) * cp, batches, [3 << 20] * cp, [0.4] * cp)
    assert path.stat().st_size > 10_000


class _Transfer:
    """A transfer that completes ``after_s`` from now; ``wait`` blocks like the receiver's."""

    def __init__(self, after_s):
        self.done = threading.Event()
        timer = threading.Timer(after_s, self.done.set)
        timer.daemon = True
        timer.start()

    def wait(self, timeout_s):
        return TransferState.SUCCESS if self.done.wait(timeout_s) else TransferState.WAITING


def test_decode_waits_past_the_stall_limit_while_the_ranks_report_progress():
    beat = [time.time()]
    stop = threading.Event()

    def ranks():  # a batch every 0.2 s
        while not stop.wait(0.2):
            beat[0] = time.time()

    threading.Thread(target=ranks, daemon=True).start()
    t0 = time.monotonic()
    try:
        state = wait_while_progressing(_Transfer(2.5).wait, lambda: beat[0], 1.0, "req-0", tick_s=0.1)
    finally:
        stop.set()
    assert state == TransferState.SUCCESS and time.monotonic() - t0 >= 2.4  # 2.5 x the stall limit


def test_decode_gives_up_in_one_line_once_the_ranks_go_quiet():
    beat = time.time()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^no progress from the prefill ranks for 1 s while waiting for req-3$"):
        wait_while_progressing(_Transfer(30).wait, lambda: beat, 0.8, "req-3", tick_s=0.1)
    assert time.monotonic() - t0 < 2
