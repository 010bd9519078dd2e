"""Render ``docs/benchmarks.md`` from the JSON results under ``docs/benchmarks/``.

Every number on that page is read from a result file written by a benchmark run, next to the
command that produced it.

    python -m benchmark.cp_shared_kv.summarize
"""

from __future__ import annotations

import json
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
RESULTS = DOCS / "benchmarks"

GPU_PREFIX = "PYTHONPATH=python:. NCCL_NVLS_ENABLE=0 "
QUERIES_TEXT = "4096 queries x 128 heads, top-k 2048"


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _table(rows: list[dict], cols: list[tuple[str, str]]) -> list[str]:
    out = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(k, "")) for k, _ in cols) + " |")
    return out


def _env(d: dict) -> str:
    e = d["environment"]
    gpu = f"{e.get('gpu_count', '')} x {e['gpu']}" if e.get("gpu") else f"CPU ({e.get('host_cpus')} cores)"
    return f"{gpu}, torch {e['torch']}, triton {e.get('triton')}, {e['date_utc']}"


def _section(
    title: str, d: dict | None, cols: list[tuple[str, str]], prefix: str, notes: list[str], pending: str = ""
) -> list[str]:
    if d is None:
        return [f"## {title}", "", f"Not run yet{f': {pending}' if pending else ''}.", ""]
    lines = [f"## {title}", "", f"`{prefix}{d['command']}` ({_env(d)})", ""]
    lines += [f"Summary: `{json.dumps(d['summary'])}`", ""]
    lines += _table(d["rows"], cols) + [""] + notes + [""]
    png = RESULTS / f"{d['name']}.png"
    if png.exists():
        lines += [f"![{d['name']}](benchmarks/{png.name})", ""]
    return lines


# Written from docs/benchmarks/pd_soak.json by hand (a pytest run, not a benchmark script).
SOAK_SECTION = """\
## PD soak through SGLang's Mooncake connector: 2 and 4 prefill CP ranks to one decode, with faults (CPU, TCP loopback)

`CP_SHARED_KV_SOAK_REQUESTS=320 CP_SHARED_KV_SOAK_REPORT=docs/benchmarks/pd_soak.json python -m pytest -q -m soak --timeout 3600 test/srt/sglang_wiring/test_pd_soak.py`
(CPU, 2 shared cores, 2026-12-01): **18 passed in 133 s**. Figures in [`benchmarks/pd_soak.json`](benchmarks/pd_soak.json).
It runs with `CP_SHARED_KV_SOAK_RANKS=2,4` only; CI runs the 2-rank soak across two network namespaces instead
(`test_pd_faults.py`, 40 requests, next section). This run predates the plugin's connector bounds
(`connector_bounds`), which now drop the rooms it shows SGLang keeping below.

SGLang 0.5.23's `MooncakeKVManager`/`MooncakeKVSender` on each prefill CP rank (the plugin's CP-shared DSA pool and
allocator, one real Mooncake engine per rank) and `MooncakeKVManager`/`MooncakeKVReceiver` in a decode process (stock
pool and allocator, the plugin's manifest check, SGLang's deferred KV release for failed requests). Requests of 1 token
to over 1024 pages (64 tokens each), sent in 1 to 3 chunks, at most 4 in flight; random client aborts (decode only or
both sides; before the destinations arrive, between chunks, after the last chunk); the decode SIGKILLed and started
again once, and SIGSTOPped for 2 s once, each with requests in flight.

| | 2 prefill ranks | 4 prefill ranks |
|---|---|---|
| requests (1 token ... pages max) | 320 (1 ... 1032) | 320 (1 ... 1047) |
| served, byte-exact vs the replicated pool | 279 (6256 pages) | 268 (6324 pages) |
| aborted (injected / failed by them) | 40 / 37 | 52 / 48 |
| lost with the killed decode (router-aborted at the prefill) | 4 | 4 |
| other failures, corrupt pages | 0, 0 | 0, 0 |
| decode releases after every rank's ABORT_ACK / after the 30 s timeout | 37 / 0 | 48 / 0 |
| kill: requests in flight, decode back after | 4, 10.8 s | 4, 7.4 s |
| SIGSTOP 2 s: requests in flight | 3 | 3 |
| Mooncake batches, entries, largest batch | 1697, 29965, 1032 | 2767, 27222, 524 |
| run wall time (worker loop) | 49 s | 66 s |
| free pages per prefill rank before → after | 1536 → 1536 | 1536 → 1536 |
| decode free pages before → after (restarted decode) | 2048 → 2048 | 2048 → 2048 |
| Mooncake regions per engine before → after, (de)registrations during the run | 5 → 5, 0 | 5 → 5, 0 |

Every connector table of both sides is empty afterwards except for two SGLang behaviours the test allows only where it
shows them: a decode's destinations reaching a prefill rank after that rank's sender was aborted and cleared make
SGLang's bootstrap thread record the room again and nothing clears it (7 rooms per rank in each run, all aborted before
their destinations arrived); and each decode session that ever registered stays in the prefill's
`decode_kv_args_table` (2 per rank: the killed decode's and the restarted one's). One failed Mooncake batch (to the
killed decode, 4 ranks) left one room in `_deferred_ack_poisoned_rooms`. KV pages are compared through a 16-byte BLAKE2b
digest per page (every layer's latent rows and indexer page). The prefill forward writes the indexer keys with the
torch formulation of SGLang's store kernel (checked byte-equal against the kernel at startup), since the Triton
interpreter runs that kernel one Python program per token.
"""


def _pd_faults() -> list[str]:
    """The namespaced PD run (``test_pd_faults.py``), from ``pd_faults.json``."""
    d = _load("pd_faults")
    title = (
        "## PD across two network namespaces: a capped link, a 10 s partition, the decode killed (CPU, TCP over veth)"
    )
    if d is None:
        return [title, "", "Not run yet.", ""]
    s, p, t, link = d["summary"], d["partition"], d["soak_summary"], d["link"]
    cb = t["connector_bounds"]
    rows = [
        ("requests (tokens min ... max)", f"{s['requests_total']} ({t['tokens']['min']} ... {t['tokens']['max']})"),
        ("served, byte-exact vs the replicated pool", f"{s['served_exact']} (corrupt: {s['served_corrupt']})"),
        *[(f"failed: {k[len('failed_') :].replace('_', ' ')}", v) for k, v in s["failed_by_cause"].items()],
        ("hung (not concluded by the run's deadline)", s["hung"]),
        ("leaked (pages, aux slots, registrations, table entries not back)", s["leaked"]),
        ("link cap each way; delay and loss", f"{link['rate_each_way']}; {link['delay_loss']}"),
        (
            "partition: seconds, requests in flight when cut, spanning it",
            f"{p['seconds']}, {p['in_flight']}, {p['requests_spanning_it']}",
        ),
        (
            "partition detected (first transfer failed by it, after the cut)",
            "none failed: TCP held the transfers until the link came back"
            if s["partition_detected_after_s"] is None
            else f"{s['partition_detected_after_s']} s",
        ),
        ("prefill transfer time of served requests p50 / p99", f"{s['transfer_s_p50']} s / {s['transfer_s_p99']} s"),
        (
            "longest prefill transfer time of a request spanning the partition",
            f"{s['transfer_s_max_spanning_partition']} s",
        ),
        ("longest request", f"{s['max_request_s']} s"),
        (
            "decode killed: requests in flight, back after",
            f"{t['faults']['killed']['in_flight']}, {t['faults']['killed']['restart_s']} s",
        ),
        (
            "late destinations dropped per rank; poisoned rooms released per rank",
            f"{cb['late_destinations_dropped']}; {cb['poisoned_rooms_released']}",
        ),
        (
            "most rooms in a table above the requests in flight (sampled)",
            cb["max_room_entries_over_requests_in_flight"],
        ),
        ("end-of-run sweep of the rooms' windows", f"{cb['end_of_run_sweep']} (window {cb['window_s']} s)"),
        ("run wall time", f"{s['wall_s']} s"),
    ]
    figures = "Figures in [`benchmarks/pd_faults.json`](benchmarks/pd_faults.json)."
    lines = [title, "", f"`{d['command']}`", f"(as root; CPU, 2 shared cores, {d['date_utc']}). {figures}", ""]
    lines += [
        "The soak's processes (2 prefill CP ranks: SGLang's Mooncake manager and sender over the plugin's pool, one real",
        "Mooncake engine per rank; the decode: SGLang's manager and receiver with the plugin's manifest check) in two",
        "network namespaces joined by a veth pair, Mooncake and ZMQ over TCP across it, `tc tbf` on both ends. Faults: the",
        "soak's aborts, the decode SIGKILLed and restarted then SIGSTOPped for 2 s, and the link set down for the partition",
        "with transfers in flight, then up. `leaked` counts every page, aux slot, engine region and connector table entry",
        "not back at its start (the decode registrations kept per decode session excepted: one per decode start).",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in rows] + [""]
    lines += [
        "Transfer time is a request's time at the prefill, from admission to its senders' conclusion: the CPU-bound",
        "stand-in forward, the wait for the decode's destinations, the transfer and the statuses. The p99 holds the",
        "requests the router's loop held while the killed decode restarted and those spanning the partition. No",
        "transfer time under delay: there is no delay without `sch_netem`. In CI the same test runs 40 requests.",
        "",
    ]
    return lines


VS_UPSTREAM_COLS = [
    ("scale", "scale"),
    ("batch", "batch"),
    ("kind", "kind"),
    ("shared_prefix", "shared prefix"),
    ("new_tokens", "new tokens"),
    ("seq_tokens", "tokens read"),
    ("ours_bytes_received", "ours bytes received"),
    ("upstream_bytes_received", "SGLang bytes received"),
    ("ours_current_chunk_bytes_gathered", "current-chunk bytes gathered"),
    ("ours_layer_time_us", "ours read µs/layer"),
    ("upstream_layer_time_us", "SGLang read µs/layer"),
    ("ours_forward_us", "ours forward µs"),
    ("upstream_forward_us", "SGLang forward µs"),
    ("stock_forward_us", "stock forward µs"),
    ("ours_plan_host_us", "ours plan host µs"),
    ("upstream_plan_host_us", "SGLang plan host µs"),
    ("ours_read_host_us_per_layer", "ours read host µs/layer"),
    ("upstream_read_host_us_per_layer", "SGLang read host µs/layer"),
    ("ours_correct", "ours bit-exact"),
    ("upstream_correct", "SGLang bit-exact"),
]

SGW_PREFIX = "source .sgw/setup.sh; "


def _pct(ratio: float | None) -> str:
    return "" if ratio is None else f"{(ratio - 1) * 100:+.2f}%"


def _overlap() -> list[str]:
    """The layer-ahead view behind a real layer on one H200: paired run, then the switches' run."""
    d = _load("overlap_1gpu")
    if d is None:
        return ["## Layer-ahead view behind a real layer (1 x H200)", "", "Not run yet.", ""]
    layer, s = d["layer"], d["summary"]
    moe = layer["moe"]
    lines = [
        "## Layer-ahead view behind a real layer (1 x H200)",
        "",
        f"`source .sgw/setup.sh; {d['command']}` ({_env(d)}); the JSON's summary: "
        f"[`benchmarks/overlap_1gpu.json`](benchmarks/overlap_1gpu.json).",
        "",
        "One process stands for CP rank 0 of a CP-2 prefill (`bench_overlap.py`). A layer: the attention SGLang's",
        f"DSA backend runs for an fp8 pool ({layer['attention']['kernel']}, {QUERIES_TEXT}), then a MoE stand-in",
        f"({moe['experts_on_rank']} experts x {moe['rows_per_expert']} rows + the shared expert over",
        f"{moe['tokens_on_rank']} tokens, fp8 `torch._scaled_mm`, {moe['flops'] / 1e12:.2f} TFLOP,",
        f"{moe['weight_bytes'] / 2**30:.2f} GiB of weights; EP {moe['ep_size']}, `layer_compute.moe_shape`). The view of",
        "C prefix tokens: C/2 owned (the Triton gather from a pool of this rank's pages) and C/2 pulled by",
        "`ViewMaterializer`'s copy-engine transport from a local buffer standing for the peer's arena (every",
        "driver call of the real transport; the peer's signals already set; the pull copies within this GPU,",
        "where on two each HBM serves the peer's read of its part: the same traffic per GPU). Each variant ran back to back with the same layer",
        "without any view, 20 pairs, order alternating; `ratio` is the median of the pairs' ratios (per-layer",
        "time over 4 steady-state layers), IQR in brackets. `in line`: the view built before each layer's",
        "attention; `ahead`: the wired prefetch (gather on the compute stream, pull on the side stream),",
        "`ahead, side gather`: gather and pull on the side stream (the former default), `normal priority`: that",
        "with a normal-priority side stream; `attention only`: the same without the MoE (one FlashMLA",
        "kernel per layer).",
        "",
        "| context | view MB | in line | ahead | ahead, side gather | normal priority | attention only: in line | attention only: ahead |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in d["rows"]:
        v = row.get("paired", {}).get("variants", {})

        def cell(name, v=v):
            x = v.get(name)
            return f"{_pct(x['ratio_median'])} [{_pct(x['ratio_q1'])}, {_pct(x['ratio_q3'])}]" if x else ""

        lines.append(
            f"| {row['context_tokens'] // 1024}K | {row['view_bytes'] / 1e6:.0f} | {cell('inline_real')} | "
            f"{cell('prefetch_real_gather_compute')} | {cell('prefetch_real')} | "
            f"{cell('prefetch_real_normal_priority')} | {cell('inline_real_attention_only')} | "
            f"{cell('prefetch_real_attention_only')} |"
        )
    lines += [
        "",
        f"Summary (wired variant `{s['wired_variant']}`): layer overhead prefetched vs no view "
        f"`{json.dumps(s['prefetch_layer_overhead_real_layer'])}`, exposed fraction (overhead prefetched / in line; "
        f"empty where the view in line is below zero) `{json.dumps(s['prefetch_exposed_fraction_real_layer'])}`.",
        "",
        "Side-stream pieces queued beside one FlashMLA kernel (`side_vs_attention`, µs after the fork, medians):",
        "",
        "| context | gather: done | gather alone | copy engines: done | copy engines alone | attention done |",
        "|---|---|---|---|---|---|",
    ]
    for row in d["rows"]:
        g, c = row["side_vs_attention"]["gather_own_pages"], row["side_vs_attention"]["copy_engine_peer_part"]
        lines.append(
            f"| {row['context_tokens'] // 1024}K | {g['side_done_us']} | {g['alone_us']} | {c['side_done_us']} | "
            f"{c['alone_us']} | {g['attention_done_us']} / {c['attention_done_us']} |"
        )
    lines += ["", f"Cause: {s['cause']}", ""]
    sw = _load("overlap_1gpu_switches")
    if sw is not None:
        lines += [
            f"Every suspected cause switched, unpaired (`source .sgw/setup.sh; {sw['command']}`, {_env(sw)}, the",
            "benchmark at its first commit, when the wired prefetch gathered on the side stream): per-layer µs,",
            "median [min, max] of 5 forwards. Forwards swung by up to 15% between clock states here, more than any",
            "switch moved, which is why the table above pairs its runs.",
            "",
            "| variant | " + " | ".join(f"{r['context_tokens'] // 1024}K" for r in sw["rows"]) + " |",
            "|---|" + "---|" * len(sw["rows"]),
        ]
        for name in sw["rows"][0]["per_layer_us"]:
            cells = []
            for r in sw["rows"]:
                x = r["per_layer_us"].get(name)
                cells.append(f"{x['median']:.0f} [{x['min']:.0f}, {x['max']:.0f}]" if x else "")
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
        conn = sw.get("connections", {})
        if conn:
            lines += [
                "",
                "`CUDA_DEVICE_MAX_CONNECTIONS` (one child process per value, 128K, 4 forwards each; the main run's "
                "value is the default 8): per-layer µs, medians.",
                "",
                "| connections | " + " | ".join(f"`{n}`" for n in conn[next(iter(conn))][0]["per_layer_us"]) + " |",
                "|---|" + "---|" * len(conn[next(iter(conn))][0]["per_layer_us"]),
            ]
            for n, rows in conn.items():
                per = rows[0]["per_layer_us"]
                lines.append(f"| {n} | " + " | ".join(f"{x['median']:.0f}" for x in per.values()) + " |")
        lines += [""]
    return lines


def _side_by_side() -> list[str]:
    """Ours vs SGLang's ``--enable-kv-cache-sharding`` (2 GPUs), and the one-GPU correctness run."""
    two = _load("vs_upstream")
    env2 = next(iter((two or {}).get("run_environment", {}).values()), {})
    nccl = env2.get("nccl_version")
    nccl_text = f"{nccl // 10000}.{nccl // 100 % 100}.{nccl % 100}" if isinstance(nccl, int) else str(nccl)
    lines = _section(
        "Side by side with SGLang's own sharding: stock / page-interleave / ours, CP=2 (2 x H200)",
        two,
        VS_UPSTREAM_COLS,
        SGW_PREFIX,
        [
            "Each rank one H200, the CP group on NCCL. SGLang's `PageInterleaveDSATokenToKVPool` (its",
            "`--enable-kv-cache-sharding`) with its page-interleave allocator and its scratch sized by its own rule;",
            f"ours with the view arena the plugin charges, views moved by `{env2.get('ours_transport')}` with",
            f"prefetch {'on' if env2.get('ours_prefetch') else 'off'}. SGLang's zero-SM (copy-engine) gather was asked",
            f"for (`SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER` {env2.get('upstream_zero_sm_gather_setting')}) but not used:",
            f"it needs NCCL >= 2.31.2 and this machine's is {nccl_text}, so SGLang gathered with NCCL kernels.",
            "Every batch and layer: SGLang's CUDA pool writers, the indexer reads and FlashMLA sparse prefill",
            "over each path's buffer, bit-identical to the stock (unsharded) pool (`correct_all`).",
            "",
            "`read µs/layer`: the batch plan spread over the layers plus a layer's indexer and latent reads,",
            "host-inclusive, each section started on both ranks together after the device drained, every",
            "batch's reads once untimed first (compiles, registration). `forward µs`: the whole batch back to",
            "back (plan, per layer the writes, reads and FlashMLA over every query). Host columns: host time",
            "inside the pool's calls while the forward is queued. The 40 µs host goal (plan and per-layer",
            "read) is not met by either sharded pool; the stock pool's own calls take 15 and 92 µs.",
            "`ours_vs_upstream_layer_time` is below its 1.2 goal; `upstream_wins_on` names any key where",
            "SGLang's page-interleave pool wins. Only the 32K scale has run: the 128K scale (31 batches, about",
            "9 minutes of the 2 GPUs) runs in pieces with `--batches FIRST:LAST` and `--merge` (the module's docstring).",
        ],
        pending="`source .sgw/setup.sh; python3 -m benchmark.cp_shared_kv.bench_vs_upstream` on 2 GPUs (copy engines "
        "and prefetch by default; `SGLANG_CP_SHARED_KV_TRANSPORT=nccl` for our NCCL figures)",
    )
    one = _load("vs_upstream_1gpu")
    if one is not None:
        cols = [c for c in VS_UPSTREAM_COLS if "upstream" not in c[0] and "_us" not in c[0]]
        cols += [
            ("ours_plan_host_us", "ours plan host µs"),
            ("stock_plan_host_us", "stock plan host µs"),
            ("ours_read_host_us_per_layer", "ours read host µs/layer"),
            ("stock_read_host_us_per_layer", "stock read host µs/layer"),
        ]
        env = (one.get("run_environment") or {}).get("32k", {})
        lines += _section(
            "The SGLang-wired path on one H200: SGLang's stock DSA pool vs ours, both CP ranks on one GPU",
            one,
            cols,
            SGW_PREFIX,
            [
                f"Both CP ranks share one GPU. Our views moved by `{env.get('ours_transport')}` "
                f"(prefetch {'on' if env.get('ours_prefetch') else 'off'}): each process pulls the other's part",
                "from its view arena through CUDA IPC, ordered by stream memory operations. This run checks",
                "correctness on CUDA and counts bytes: every batch and layer, SGLang's CUDA pool writers, the",
                "indexer reads and FlashMLA sparse prefill (`sgl-flash-mla`, output and LSE) over each path's",
                "buffer and translated rows, bit-identical to the stock pool. Device timings compare nothing here",
                "(two processes time-slice one GPU, and a stream waiting on the other process waits for its time",
                "slice) and are left out. SGLang's page-interleave pool is absent: it builds a NCCL communicator,",
                "which needs one GPU per rank. The shared-prefix batch reads request 0's prefix once, through the",
                "hint the plugin's `ForwardBatch.init_new` hook computes from the radix paths (the harness hands it",
                "over as the hook does), bit-identical.",
                "",
                "Host columns: host time spent inside the pool's calls while the forward is queued, no sync in",
                "between (`plan`: `prepare_kv_shard_forward` + the batch's translation; `read`: a layer's indexer",
                "and latent reads, our view gather and its transfer included). The goal of 40 µs each is not met:",
                "see the summary's `ours_plan_host_us` and `ours_read_host_us_per_layer` against the stock pool's.",
                "`ours_arena_bytes` is the view arena the plugin charges to the KV budget for these server limits",
                "(32K context, 8K chunk, with prefetch's second chunk).",
            ],
        )
    return lines


def _host_cost() -> list[str]:
    """Per-call host costs of the launches and driver calls the SGLang-wired read path makes."""
    calls = _load("host_calls")
    if calls is None:
        return []
    lines = ["## Host cost of the calls on the SGLang-wired read path (1 x H200)", ""]
    lines += [f"`{SGW_PREFIX}{calls['command']}` ({_env(calls)})", ""]
    by_call: dict[str, dict] = {}
    for r in calls["rows"]:
        by_call.setdefault(r["call"], {"call": r["call"]})[r["sync_debug"]] = r["host_us"]
        if r["sync_debug"] == "default":
            by_call[r["call"]]["ratio"] = r["vs_torch_op"]
    lines += _table(
        list(by_call.values()),
        [("call", "call"), ("default", "host µs"), ("warn", "host µs, sync-debug warn"), ("ratio", "x a torch op")],
    )
    lines += [
        "",
        "Each call alone, back to back, the GPU idle (`torch_add_`: one small torch op, the unit). On this",
        "host a Triton launch through the JIT costs several torch ops; the same launch handed to the compiled",
        "kernel's launcher (`PreparedLaunch`, `triton_gather_prepared`) about one. `torch.cuda.current_stream`",
        "builds a Python object; the raw handle (`current_stream_handle`) does not. Each driver call of the",
        "copy-engine all-gather (`driver_*`, through ctypes) costs less than a torch op. The plan and per-layer",
        "read host time of the whole path are in the side-by-side sections above (goal 40 µs each, not met).",
        "",
    ]
    return lines


def render() -> str:
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmark.cp_shared_kv.summarize` from the JSON files in `benchmarks/`;",
        "each JSON holds the raw rows, the machine, the library versions and the exact command. GPU runs",
        "use the working tree with `PYTHONPATH=python:.` and the FlashMLA wheel `sgl-flash-mla==1.0.0`.",
        "Ratios compare two paths in the same run; nothing here is a timed test.",
        "",
        "GPU test logs (marker `gpu`): 2 x H200,",
        "`PYTHONPATH=<flash_mla wheel dir>:python:. python3 -m pytest test/srt/layers test/srt/mem_cache -m gpu -v`",
        "([`log`](benchmarks/gpu_tests.txt)); one H200, `source .sgw/setup.sh; python3 -m pytest -q -m gpu -rs test`",
        "(the 2-GPU tests skip; [`log`](benchmarks/gpu_tests_1gpu.txt)); 2 x H200, `source .sgw/setup.sh; python3 -m",
        "pytest -q -m gpu --timeout 60 test/srt/distributed/test_copy_engine_gpu.py",
        "test/srt/layers/attention/nsa/test_read_state_ranks.py` ([`log`](benchmarks/gpu_tests_2gpu_copy_engine.txt),",
        "6 passed) and `test_read_state_ranks.py` alone ([`log`](benchmarks/gpu_tests_2gpu_read_state.txt), 2 passed).",
        "Each log names the test files of its run.",
        "",
        "Wall times on 2 x H200 (each command after `source .sgw/setup.sh`, about 40 s): the two test files",
        "above 23-54 s, `bench_vs_upstream --scale 32k` 158 s (with the untimed warm pass). The 128K scale is",
        "31 batches of about 20 s each: run it as `--batches` pieces and `--merge` them (the side-by-side section).",
        "",
    ]
    gather = _load("gather")
    lines += _section(
        "Gather kernel: materialize gather vs index_select vs copy (1 x H200)",
        gather,
        [
            ("kv_format", "format"),
            ("tokens", "tokens"),
            ("gather_us", "gather µs"),
            ("index_select_us", "index_select µs"),
            ("copy_us", "copy µs"),
            ("gather_GBps", "gather GB/s"),
            ("gather_vs_copy", "gather / copy bw"),
        ],
        GPU_PREFIX,
        ["Goal: >= 0.9x the copy bandwidth at >= 32K tokens. L2 is flushed before every timed call."],
    )
    plan = _load("plan")
    plan_notes = [
        "`exposed` columns: the plan + gather enqueued behind ~2 ms of queued GPU work (as inside a forward",
        "pass); the unique remap must wait for that work to drain before its host syncs. `view cost`: pages",
        "the slot view holds / pages the unique remap holds (duplicated shared-prefix pages).",
    ]
    if plan and plan.get("graph_rows"):
        plan_notes += ["", "Graph-captured plan + gather at 8K tokens (device time):", ""]
        plan_notes += _table(
            plan["graph_rows"],
            [
                ("tokens", "tokens"),
                ("requests", "requests"),
                ("graph_plan_gather_us", "graph µs"),
                ("eager_plan_gather_us", "eager µs"),
            ],
        )
    lines += _section(
        "Plan: slot plan vs compact unique-page remap (1 x H200, CP=8 plan, rank 0 gathers)",
        plan,
        [
            ("requests", "requests"),
            ("pages", "page positions"),
            ("includes_gather", "+gather"),
            ("plan_kernel", "plan kernel"),
            ("slot_plan_only_us", "slot plan alone µs"),
            ("slot_plan_us", "slot µs (idle)"),
            ("unique_plan_us", "unique µs (idle)"),
            ("slot_plan_exposed_us", "slot exposed µs"),
            ("unique_plan_exposed_us", "unique exposed µs"),
            ("speedup_behind_queued_work", "speedup (queued)"),
            ("view_size_cost", "view cost"),
        ],
        GPU_PREFIX,
        plan_notes,
    )
    lines += _overlap()
    lines += _side_by_side()
    lines += _host_cost()
    lines += _section(
        "PD transfer through SGLang's Mooncake connector: the plugin's sharded send vs SGLang's stock send (CPU, TCP loopback)",
        _load("pd_transfer"),
        [
            ("cp_size", "prefill CP ranks"),
            ("path", "path"),
            ("repeat", "repeat"),
            ("requests", "requests"),
            ("pages_per_request", "pages each"),
            ("bytes", "bytes"),
            ("bytes_per_rank", "bytes per prefill rank"),
            ("seconds", "s"),
            ("gbps", "GB/s"),
            ("exact", "byte-exact"),
        ],
        "PYTHONPATH=python:. ",
        [
            "`sharded`: every prefill CP rank's `MooncakeKVSender` in SGLang's sharded mode sends the pages it owns of",
            "the plugin's CP-shared pool, with the plugin's manifest, and the decode checks the manifests; `stock`: one",
            "prefill rank with SGLang's replicated pool sends every page (flag off). Same KV, same decode, one process,",
            "the real engine over TCP on 127.0.0.1; timed from the first `send` to the last receiver's Success.",
            "SGLang's stock send wins here (`sharded_vs_stock` about 0.5): on one 2-core host the N engines and transfer",
            "workers of the sharded send share the same two cores and loopback, while each prefill rank moves 1/N of the",
            "bytes; across hosts (one NIC per rank) it has not been measured. A shared host: ratios move between runs.",
        ],
        pending="`python -m benchmark.cp_shared_kv.bench_pd_transfer`",
    )
    lines += SOAK_SECTION.splitlines() + [""]
    lines += _pd_faults()
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    out = DOCS / "benchmarks.md"
    out.write_text(render())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
