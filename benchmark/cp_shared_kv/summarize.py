"""Render ``docs/benchmarks.md`` from the JSON results under ``docs/benchmarks/``.

Every number on that page is read from a result file written by a benchmark run, next to the
command that produced it.

    python -m benchmark.cp_shared_kv.summarize
"""

from __future__ import annotations

import json
import statistics
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

`CP_SHARED_KV_SOAK_RANKS=2,4 CP_SHARED_KV_SOAK_REQUESTS=320 CP_SHARED_KV_SOAK_REPORT=docs/benchmarks/pd_soak.json python -m pytest -q -m soak --timeout 1500 test/srt/sglang_wiring/test_pd_soak.py`
(CPU, 2 shared cores, 2026-12-01): **22 passed in 234 s**. Figures in [`benchmarks/pd_soak.json`](benchmarks/pd_soak.json).
It runs with `CP_SHARED_KV_SOAK_RANKS` only; CI runs the 2-rank soak across two network namespaces instead
(`test_pd_faults.py`, 40 requests, next section).

SGLang 0.5.23's `MooncakeKVManager`/`MooncakeKVSender` on each prefill CP rank (the plugin's CP-shared DSA pool and
allocator, one real Mooncake engine per rank) and `MooncakeKVManager`/`MooncakeKVReceiver` in a decode process (stock
pool and allocator, the plugin's manifest check, SGLang's deferred KV release for failed requests). Requests of 1 token
to over 1024 pages (64 tokens each), sent in 1 to 3 chunks, at most 4 in flight; random client aborts (decode only or
both sides; before the destinations arrive, between chunks, after the last chunk) and aborts at the prefill before the
decode is told; the decode SIGKILLed (one request left sending to it) and started again once, and SIGSTOPped for 2 s
once, each with requests in flight.

| | 2 prefill ranks | 4 prefill ranks |
|---|---|---|
| requests (1 token ... pages max) | 320 (1 ... 1051) | 320 (1 ... 1042) |
| served, byte-exact vs the replicated pool | 274 (7265 pages) | 260 (6408 pages) |
| aborted (injected / failed by them) | 47 / 44 | 62 / 57 |
| lost with the killed decode | 2 | 3 |
| other failures, corrupt pages | 0, 0 | 0, 0 |
| decode releases after every rank's ABORT_ACK / after the 30 s timeout | 44 / 0 | 57 / 0 |
| kill: requests in flight, decode back after | 2, 14.0 s | 3, 12.2 s |
| SIGSTOP 2 s: requests in flight | 4 | 4 |
| Mooncake batches, entries, largest batch, failed | 1645, 29857, 1052, 2 | 2726, 27377, 522, 4 |
| late destinations dropped per rank (`connector_bounds`) | 13 | 12 |
| poisoned rooms released per rank (window ended) | 1 | 1 |
| most rooms in a table above the requests in flight (sampled) | 0 | 0 |
| connector table entries left (prefill, decode) | 0, 0 | 0, 0 |
| decode registrations kept per prefill rank (one per decode start) | 2 | 2 |
| run wall time (worker loop) | 96 s | 114 s |
| free pages per prefill rank before → after | 1536 → 1536 | 1536 → 1536 |
| decode free pages before → after (restarted decode) | 2048 → 2048 | 2048 → 2048 |
| Mooncake regions per engine before → after, (de)registrations during the run | 5 → 5, 0 | 5 → 5, 0 |

The failed Mooncake batches are the kill's: the request left sending to the killed decode. The end of the run sweeps
the rooms' windows as the first clear after them would (the 155 s window is not waited out). KV pages are compared
through a 16-byte BLAKE2b digest per page (every layer's latent rows and indexer page). The prefill forward writes the
indexer keys with the torch formulation of SGLang's store kernel (checked byte-equal against the kernel at startup),
since the Triton interpreter runs that kernel one Python program per token.
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
        "transfer time under delay: there is no delay without `sch_netem`. Failures are counted by the cause in their",
        "reason: a transfer error is a Mooncake batch that failed across the partition; after one, SGLang blacklists",
        'the decode\'s session and fails the next requests to it at once ("decode session blacklisted") until its',
        "probe (every 2 s here) takes the session back. In CI the same test runs 40 requests.",
        "",
    ]
    return lines


VS_UPSTREAM_COLS = [
    ("batch", "batch"),
    ("kind", "kind"),
    ("new_tokens", "new tokens"),
    ("seq_tokens", "tokens read"),
    ("stock_layer_time_us", "stock layer µs"),
    ("ours_layer_time_us", "ours layer µs"),
    ("upstream_layer_time_us", "page-interleave layer µs"),
    ("layersplit_layer_time_us", "layer-split layer µs"),
    ("ours_stand_ins_us_per_layer", "stand-ins µs/layer (ours)"),
    ("stock_read_time_us", "stock read µs/layer"),
    ("ours_read_time_us", "ours read µs/layer"),
    ("upstream_read_time_us", "page-interleave read µs/layer"),
    ("layersplit_read_time_us", "layer-split read µs/layer"),
    ("ours_plan_host_us", "ours plan host µs"),
    ("ours_read_host_us_per_layer", "ours read host µs/layer"),
    ("stock_read_host_us_per_layer", "stock read host µs/layer"),
    ("ours_bytes_received", "ours bytes"),
    ("ours_prefix_bytes_expected", "prefix pages' bytes"),
    ("upstream_bytes_received", "page-interleave bytes"),
    ("layersplit_bytes_received", "layer-split bytes"),
    ("ours_correct", "ours bit-exact"),
    ("upstream_correct", "page-interleave bit-exact"),
    ("layersplit_correct", "layer-split bit-exact"),
]

SGW_PREFIX = "source .sgw/setup.sh; "

# Summary keys shown first (the rest stay in the JSON).
VS_UPSTREAM_KEYS = [
    "correct_all",
    "ours_vs_stock_layer_time",
    "ours_vs_stock_layer_time_median_batch",
    "ours_vs_stock_layer_time_without_stand_ins",
    "ours_vs_stock_read_time",
    "ours_vs_upstream_layer_time",
    "ours_vs_upstream_read_time",
    "ours_vs_layersplit_layer_time",
    "ours_vs_layersplit_layer_time_median_batch",
    "ours_vs_layersplit_read_time",
    "peak_scratch_ratio",
    "peak_scratch_ratio_equal_admission",
    "bytes_ratio",
    "bytes_ratio_vs_layersplit",
    "current_chunk_bytes_gathered",
    "host_syncs_ours_per_forward",
    "host_syncs_upstream_per_forward",
    "host_syncs_stock_per_forward",
    "host_syncs_layersplit_per_forward",
    "ours_plan_host_us",
    "ours_metadata_host_us",
    "stock_metadata_host_us",
    "ours_read_host_us_per_layer",
    "stock_read_host_us_per_layer",
]


def _ratio_over(rows: list[dict], num: str, den: str) -> float | None:
    a, b = sum(r.get(num) or 0 for r in rows), sum(r.get(den) or 0 for r in rows)
    return round(a / b, 3) if rows and b else None


def _span(rows: list[dict], key: str, unit: float) -> str:
    vals = [r[key] * unit for r in rows if r.get(key) is not None]
    if not vals:
        return "n/a"
    return f"{min(vals):.3g}" if min(vals) == max(vals) else f"{min(vals):.3g}-{max(vals):.3g}"


def _backend_section(title: str, d: dict | None, notes: list[str], pending: str) -> list[str]:
    if d is None:
        return [f"## {title}", "", f"Not run yet: {pending}.", ""]
    s = d["summary"]
    if "stand_ins" not in s:  # a result of the harness before it drove SGLang's backend
        return [
            f"## {title}",
            "",
            f"Not run yet with SGLang's backend: {pending}. [`benchmarks/{d['name']}.json`](benchmarks/{d['name']}.json)",
            "is the earlier harness's run: it decoded each path's whole buffer before FlashMLA and ran no layer",
            "compute, which inflated its per-forward ratios; its figures are not a measurement of what SGLang runs.",
            "",
        ]
    lines = [f"## {title}", ""]
    for piece in d.get("pieces") or [d]:  # a result merged from pieces: each piece's command and machine
        lines += [f"`{SGW_PREFIX}{GPU_PREFIX}{piece['command']}` ({_env(piece)})", ""]
    if d.get("pieces"):
        lines += [f"merged by `{d['command']}`", ""]
    if d.get("note"):
        lines += [f"This result was {d['note']}.", ""]
    lines += ["| summary key | value |", "|---|---|"]
    lines += [f"| `{k}` | {s[k]} |" for k in VS_UPSTREAM_KEYS if k in s]
    lines += ["", "| goal | value | met |", "|---|---|---|"]
    lines += [f"| `{k}` {g['goal']} | {g['value']} | {g['met']} |" for k, g in s.get("goals", {}).items()]
    lines += ["", "Stand-ins (median time per forward):", ""]
    lines += [f"- `{x['op']}`: {x['us_per_forward_median']} µs; {x['stand_in']} ({x['why']})" for x in s["stand_ins"]]
    cols = [c for c in VS_UPSTREAM_COLS if any(c[0] in r for r in d["rows"])]
    lines += [""] + _table(d["rows"], cols) + [""] + notes + [""]
    png = RESULTS / f"{d['name']}.png"
    if png.exists():
        lines += [f"![{d['name']}](benchmarks/{png.name})", ""]
    return lines


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


def _met(value: float | None, goal: float, at_least: bool = True) -> str:
    if value is None:
        return "not measured"
    return "met" if (value >= goal if at_least else value <= goal) else "not met"


def _one_gpu_notes(d: dict) -> list[str]:
    """What a one-H200 run of the side-by-side harness ran and what its JSON says (every figure from it)."""
    rows, s = d["rows"], d["summary"]
    env = next(iter(d["run_environment"].values()))
    moe = env["moe"]
    per_batch = [{"r": r["stock_layer_time_us"] / r["ours_layer_time_us"]} for r in rows]
    host_ratio = [
        {"r": r["ours_read_host_us_per_layer"] / r["stock_read_host_us_per_layer"]}
        for r in rows
        if r.get("ours_read_host_us_per_layer") and r.get("stock_read_host_us_per_layer")
    ]
    timed = _ratio_over(rows, "ours_pool_host_us_timed_pass", "stock_pool_host_us_timed_pass")
    ours_read, stock_read = s.get("ours_read_host_us_per_layer"), s.get("stock_read_host_us_per_layer")
    read_ratio = ours_read / stock_read if ours_read and stock_read else None
    exact = [r["batch"] for r in rows if r.get("ours_current_chunk_bytes_gathered") == 0]
    layer = s.get("ours_vs_stock_layer_time")
    lines = [
        "What runs, per batch and path: SGLang's `DeepseekSparseAttnBackend.init_forward_metadata` (for",
        "ours SGLang's `prepare_kv_shard_forward` and the page-table translation inside it); per layer the",
        "indexer's pool calls as SGLang's `Indexer._get_topk_ragged` makes them (index-K store,",
        "`get_index_k_scale_buffer` over the logical page table, `fp8_mqa_logits`, `metadata.topk_transform`),",
        f"then `forward_extend` with the prefill impl SGLang resolved for an fp8 cache on SM90 (`{env['prefill_impl']}`:",
        "FlashMLA's fp8 paged kernel with sparse indices over the pool's own buffer), then the MoE stand-in",
        f"(`layer_compute.MoEStandIn`, {moe['experts_on_rank']} routed experts of {moe['rows_per_expert']} rows and the",
        f"shared expert for {moe['tokens_on_rank']} tokens at most, fp8, EP {moe['ep_size']}: a rank's tokens are the",
        f"batch's over the CP size). {env['heads_per_rank']} attention heads, top-k {env['topk']}, {env['layers']} layers.",
        "Not run: the indexer's projections, norms and rope (model weights; the same for every path). Each rank",
        "computes attention for all the batch's queries (SGLang's prefill CP splits them between the ranks), so",
        "the attention share of a layer here is about twice a CP-2 rank's. Every batch is warmed once before it",
        "is measured.",
        "",
        "Layer time: wall clock of the timed forward over its layers, the stand-ins included; `_without_stand_ins`",
        "subtracts their device time (DeepGEMM's logits and sgl_kernel's fused top-k, which dominate here:",
        "torch stand-ins for ops that take a fraction of this on the real kernels, so the figure without them is",
        "closer to what a server sees). Read time: the stream time between CUDA events around the pool's read",
        "calls, per layer. Ratios are totals over the workload, stock over ours: below 1, ours is slower.",
        "",
        "Both CP ranks share one GPU over gloo (NCCL needs a GPU per rank), so SGLang's page-interleave pool",
        "is absent (its NCCL gather communicator) and the layer-split pool is left out (over gloo it would",
        "broadcast through host memory, not its best path). Ours moves its views by",
        f"`{env.get('ours_transport')}` (prefetch {'on' if env.get('ours_prefetch') else 'off'}; "
        + (
            f"views {env['ours_views']})."
            if "ours_views" in env
            else "built in line, a copy-engine group's views are read from the peers' pools, prefetched all-gathered)."
        )
        + " Our read time",
        "includes the wait for the other rank's process: at each batch's fence (views read from the pools) or at",
        "each layer (the all-gather's ready and ack counters). With both processes on one GPU that lockstep is",
        "part of what ours pays, and the stock pool, whose ranks never synchronize, pays none.",
        "",
        f"Result: ours vs stock {layer} on layer time (goal >= 0.99: {_met(layer, 0.99)}), per batch",
        f"{_span(per_batch, 'r', 1)}; {s.get('ours_vs_stock_layer_time_without_stand_ins')} without the stand-ins' time.",
        f"Every timed output bit-exact (`correct_all` {s.get('correct_all')}). Our transport received exactly the prefix",
        f"pages' bytes on {len(exact)} of {len(rows)} batches (`current_chunk_bytes_gathered` 0): nothing of the",
        "current chunk moves.",
        "",
        "Host cost, from the host pass (the device drained before "
        + (
            "the metadata call and each layer's pool calls: the plan's calls run inside the metadata call as in SGLang"
            if env.get("plan_drain") == "metadata"
            else "each pool call"
        )
        + (f"; each figure the minimum of {env['host_passes']} passes" if env.get("host_passes", 1) > 1 else "")
        + "; median over batches): our",
        f"batch plan {s.get('ours_plan_host_us')} µs (goal 200 µs: {_met(s.get('ours_plan_host_us'), 200, False)}"
        + (
            f"; {s['ours_plan_host_us_drained']} µs with the device drained before each of its calls too"
            if s.get("ours_plan_host_us_drained") is not None
            else ""
        )
        + (
            f"; {s['ours_plan_host_us_busy']} µs with the device busy throughout, as under SGLang's overlap scheduler"
            if s.get("ours_plan_host_us_busy") is not None
            else ""
        )
        + "), inside",
        f"SGLang's `init_forward_metadata` of {s.get('ours_metadata_host_us')} µs ({s.get('stock_metadata_host_us')} µs with the",
        f"stock pool); a layer's reads {s.get('ours_read_host_us_per_layer')} µs against the stock pool's",
        f"{s.get('stock_read_host_us_per_layer')} µs, {_span(host_ratio, 'r', 1)}x per batch (goal 1.5x: "
        f"{_met(read_ratio, 1.5, False)}"
        + (
            f"; with the device busy {s['ours_read_host_us_per_layer_busy']} µs against "
            f"{s['stock_read_host_us_per_layer_busy']} µs, SGLang's metadata call {s['ours_metadata_host_us_busy']} "
            f"µs ({s['stock_metadata_host_us_busy']} µs with the stock pool)"
            if s.get("ours_read_host_us_per_layer_busy") is not None
            else ""
        )
        + "). In the",
        f"timed forward the pool calls' host time is {timed}x the stock pool's, launch-queue back-pressure",
        "included (`*_pool_host_us_timed_pass`). Host syncs: 0 per forward for both paths,",
        "`init_forward_metadata` included (CUDA sync-debug mode).",
    ]
    profile = f"{d['name']}_host_profile.txt"
    if (RESULTS / profile).exists():
        lines += [
            "Where the host time goes, call by call (`--profile-host`, inclusive times of named functions, both",
            f"paths): [`{profile}`](benchmarks/{profile}).",
        ]
    lines += [
        "Host figures vary from run to run on this box (the two ranks' processes share it): compare them",
        "within a run.",
        "",
        "Memory: `peak_scratch_ratio` is our default arena (two contexts) over SGLang's page-interleave scratch",
        "(eight contexts and the chunk, twice: its own rule); `_equal_admission` sizes ours for eight contexts",
        f"too: {s.get('peak_scratch_ratio_equal_admission')} (goal 0.5: {_met(s.get('peak_scratch_ratio_equal_admission'), 0.5, False)}).",
        "By the sizing rule (not a measurement) it is (P + 2c) / (2P + 2c) for a prefix budget P and a chunk",
        "c plus a page: above 1/2 by the prefetch's second chunk, 1/2 exactly with the prefetch off.",
    ]
    return lines


def _side_by_side() -> list[str]:
    """SGLang's DSA backend over the stock pool, SGLang's two sharded pools and ours."""
    lines = []
    for name, what in (
        ("vs_upstream_1gpu", "32K"),
        ("vs_upstream_1gpu_prefetch", "32K, prefetch on"),
        ("vs_upstream_1gpu_128k", "128K"),
        ("vs_upstream_1gpu_prefix90", "prefix 90%"),
    ):
        d = _load(name)
        lines += _backend_section(
            f"SGLang's DSA backend over the stock pool and ours, a MoE layer each, {what}, one H200",
            d,
            _one_gpu_notes(d) if d is not None and "stand_ins" in d["summary"] else [],
            pending=f"`source .sgw/setup.sh; python3 -m benchmark.cp_shared_kv.bench_vs_upstream --device cuda --backend "
            f"gloo --paths stock ours --out {name}`",
        )
    lines += _shared_gpu_wait()
    lines += [
        "The 128K scale runs in two pieces (`--batches`), joined by `--merge`. The prefix-90% workload is",
        "SGLang PR #35309's shape: 8 prompts of 100K tokens, 90K of each cached (only written), then 10K new",
        "tokens each in 8K chunks.",
        "",
    ]
    lines += _backend_section(
        "SGLang's DSA backend over the stock, page-interleave, layer-split and our pools, CP=2 (2 x H200)",
        _load("vs_upstream"),
        [],
        pending="`source .sgw/setup.sh; python3 -m benchmark.cp_shared_kv.bench_vs_upstream` on 2 GPUs, one per rank "
        "(NCCL): writes `vs_upstream.json` (the 128K scale in pieces with `--batches`/`--merge`)",
    )
    return lines


def _shared_gpu_wait() -> list[str]:
    """The probe of a device-side wait between two processes on one GPU."""
    d = _load("shared_gpu_wait")
    if d is None:
        return []
    rows = []
    for r in d["rows"]:
        if r["rank"] != 0:
            continue
        row = {"layer_ms_target": r["layer_ms_target"], "gemms": r["gemms_per_step"], "none": r["none"]["median_ms"]}
        row.update({m: r[m]["excess_ms_vs_none"] for m in ("exchange", "exchange_side", "copy_local")})
        rows.append(row)
    lines = [
        "### A device-side wait between two processes on one GPU (`probe_shared_gpu_wait`)",
        "",
        f"`{d['command']}` ({_env(d)}). Two processes on one H200, each a step of bf16 GEMMs (the target is",
        "the step's length for the two together), then a copy-engine all-gather of 12 MB per rank in line",
        "(`exchange`), on a side stream joined at the next step (`exchange_side`, the prefetch's shape), or a",
        "local copy of the same bytes (`copy_local`); medians over 20 steps, rank 0, and each mode's excess",
        "over the step alone (ms):",
        "",
    ]
    lines += _table(
        rows,
        [
            ("layer_ms_target", "target ms"),
            ("gemms", "GEMMs"),
            ("none", "step ms"),
            ("exchange", "in line"),
            ("exchange_side", "side stream"),
            ("copy_local", "local copy"),
        ],
    )
    lines += [
        "",
        "With steps of 20-60 ms the excess of either exchange stays inside the step's own spread between",
        "modes (the local copy, which waits for nobody, moves by as much): a wait for the other process costs",
        "no fixed time slice there. With 5 ms steps the side-stream exchange adds about half a millisecond.",
        "",
    ]
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
    peer, spaced, busy = _load("host_calls_peer"), _load("host_calls_spacing"), _load("host_calls_busy")
    for r in peer["rows"] if peer is not None else []:
        by_call.setdefault(r["call"], {"call": r["call"]})[f"peer_{r['peer']}"] = r["host_us"]
    for r in spaced["rows"] if spaced is not None else []:
        by_call.setdefault(r["call"], {"call": r["call"]})[f"alone_{r['spacing']}"] = r["host_us"]
    for r in busy["rows"] if busy is not None else []:
        if r["spacing"] != "loop":  # the busy run's own back-to-back and drained figures: in its JSON
            by_call.setdefault(r["call"], {"call": r["call"]})[f"alone_{r['spacing']}"] = r["host_us"]
    lines += _table(
        list(by_call.values()),
        [
            ("call", "call"),
            ("default", "host µs"),
            ("warn", "host µs, sync-debug warn"),
            ("warn_recorded", "warn, warnings recorded"),
            ("ratio", "x a torch op"),
            ("peer_idle", "2 processes: peer idle"),
            ("peer_gpu", "peer's GEMMs"),
            ("peer_sync", "peer spinning in sync"),
            ("alone_loop", "alone: back to back"),
            ("alone_drained", "after a drain"),
            ("alone_idle", "after a 2 ms sleep"),
            ("alone_churn", "after 8 MiB written"),
            ("alone_busy", "while 2 ms of GPU work runs"),
        ],
    )
    if peer is not None:
        lines += [
            "",
            f"The peer columns: `{SGW_PREFIX}{peer['command']}` ({_env(peer)}; {peer['cpus_allowed']} CPUs allowed).",
        ]
    if spaced is not None:
        lines += ["", f"The alone columns: `{SGW_PREFIX}{spaced['command']}` ({_env(spaced)})."]
    if busy is not None:
        lines += [
            "",
            f"The last column: `{SGW_PREFIX}{busy['command']}` ({_env(busy)}): each call made right after 2 ms of",
            "GPU work is queued, the device drained before that (which waits for the previous call's 2 ms).",
        ]
    lines += [
        "",
        "Each call alone, back to back, the GPU idle (`torch_add_`: one small torch op, the unit). On this",
        "host a Triton launch through the JIT costs several torch ops; the same launch handed to the compiled",
        "kernel's launcher (`PreparedLaunch`, `triton_gather_prepared`) about one. `torch.cuda.current_stream`",
        "builds a Python object; the raw handle (`current_stream_handle`) does not. Each driver call of the",
        "copy-engine all-gather (`driver_*`, through ctypes) costs less than a torch op. Recording every warning",
        "(`warn_recorded`, as the harness's sync counter does) adds nothing measurable. The peer columns time the",
        "same calls in one of two processes on one GPU, as the one-GPU harness runs its two ranks. The last four",
        "time each call made alone (median per call): back to back as above, after the device is drained (as the",
        "harness's host pass makes each pool call), after the thread slept, and after other work wrote 8 MiB",
        "(more than a core's L2), as a forward's other code runs between two pool calls.",
        "",
    ]
    if busy is not None:
        alone = {(r["spacing"], r["call"]): r["host_us"] for r in busy["rows"]}
        pair = [
            (c, alone.get(("drained", c)), alone.get(("busy", c))) for c in ("translate_locs", "driver_graph_fence")
        ]
        lines += [
            "Made while queued GPU work runs (as SGLang's overlap scheduler makes a batch's calls while the",
            "previous batch runs), after the host waited for earlier work as the harness's busy passes do, a call",
            "costs the host more than on a drained device, not less: in the same run "
            + ", ".join(f"`{c}` {b} µs busy against {d} drained" for c, d, b in pair if d is not None)
            + ".",
            "",
        ]
    lines += _in_forward_cost()
    lines += _graph_calls()
    return lines


def _graph_calls() -> list[str]:
    """Replays of captured CUDA graphs against the calls they hold, made alone in one run."""
    run = _load("host_calls_graph")
    if run is None:
        return []
    by_call: dict[str, dict] = {}
    for r in run["rows"]:
        by_call.setdefault(r["call"], {"call": r["call"]})[r["spacing"]] = r["host_us"]
    names = [c for c in by_call if c.startswith(("graph_", "driver_"))]
    lines = ["## Captured graphs against the calls they hold (1 x H200)", ""]
    lines += [f"`{SGW_PREFIX}{run['command']}` ({_env(run)})", ""]
    lines += _table(
        [by_call[c] for c in names],
        [("call", "call"), ("loop", "back to back µs"), ("churn", "after 8 MiB written µs")],
    )
    s = run["summary"]
    lines += [
        "",
        "`graph_*`: a graph holding the prepared gather launch and the named stream calls (`graph_plan_fence`: a",
        "64-bit write, an 8-byte copy and a satisfied wait, then the launch), replayed by torch. `driver_fence_calls`:",
        "the write, copy and wait one by one through ctypes; `driver_graph_fence`: the same three captured by the",
        "driver and launched with one `cuGraphLaunch`, as the copy engines' fence is. Made alone after 8 MiB",
        f"written, the graph cost {s['driver_graph_fence_us_churn']:.2f} µs, its calls one by one "
        f"{s['driver_fence_calls_us_churn']:.2f} µs.",
        "",
    ]
    return lines


def _in_forward_cost() -> list[str]:
    """A call's host cost inside the harness's forward against its cost in a tight loop, from the last 32K run."""
    run = _load("vs_upstream_1gpu")
    profile = RESULTS / "vs_upstream_1gpu_host_profile.txt"
    if run is None or not profile.exists():
        return []
    calib = [r[k] for r in run["rows"] for k in r if k.endswith("_calibration_current_stream_us")]
    inside = []
    for line in profile.read_text().splitlines():
        if line.startswith("torch.cuda:current_stream "):
            inside.append(float(line.split()[3]))  # calls/fwd, us/fwd, us/call, cpu %
    if not calib or not inside:
        return []
    loop = statistics.median(calib)
    spaced = _load("host_calls_spacing")
    cold = {r["spacing"]: r["host_us"] for r in spaced["rows"] if r["call"] == "current_stream"} if spaced else {}
    text = (
        f"Inside the side-by-side harness's forward the same `torch.cuda.current_stream` call costs "
        f"{min(inside):.1f}-{max(inside):.1f} µs (`vs_upstream_1gpu_host_profile.txt`, per path, with the "
        f"thread on a CPU all the while), against {loop:.2f} µs (median) in a loop of 200 that each host pass "
        f"times just before its forward in the same process (`calibration_*` in `vs_upstream_1gpu.json`): "
        f"{min(inside) / loop:.1f}x or more. Neither a busy peer process nor the sync counter accounts for it."
    )
    if cold:
        text += (
            f" Made alone, the call costs {cold['loop']:.1f} µs back to back, {cold['drained']:.1f} after a "
            f"drain, {cold['churn']:.1f} after other work wrote 8 MiB and {cold['idle']:.1f} after a 2 ms "
            "sleep: a call between other work runs from cold caches, and every pool call in a forward is one. "
            "The harness's in-forward figures, by which the goals are judged, are such cold costs; SGLang's "
            "calls pay them alike, and they count calls and allocations more than instructions."
        )
    return [
        text,
        "",
    ]


def _waited_calls() -> list[str]:
    """Calls made right after the host waited for the device, in the driver or in a busy loop."""
    run = _load("host_calls_wait")
    if run is None:
        return []
    us = {(r["spacing"], r["call"]): r["host_us"] for r in run["rows"]}
    calls = ("torch_add_", "torch_empty", "triton_gather_prepared", "translate_locs", "driver_graph_fence")
    lines = ["## Calls after a wait for the device (1 x H200)", "", f"`{SGW_PREFIX}{run['command']}` ({_env(run)})", ""]
    lines += [
        "Each call made alone after 2 ms of queued GPU work, waited for in `torch.cuda.synchronize`",
        "(`waited`, how the side-by-side harness's host pass drains by default) or in a busy loop on an event",
        "(`polled`, its `--host-drain poll`), beside the same call back to back (`loop`) and after a 2 ms sleep",
        "(`idle`); host µs, median of the calls:",
        "",
        "| call | loop | waited | polled | idle |",
        "|---|---|---|---|---|",
    ]
    for c in calls:
        if ("loop", c) in us:
            lines.append(
                f"| `{c}` | " + " | ".join(str(us.get((sp, c))) for sp in ("loop", "waited", "polled", "idle")) + " |"
            )
    shown = [c for c in calls if ("loop", c) in us]
    ratio = {sp: [us[(sp, c)] / us[("loop", c)] for c in shown] for sp in ("waited", "polled")}
    lines += [
        "",
        f"After a wait these calls cost {min(ratio['waited']):.1f}-{max(ratio['waited']):.1f}x their loop figure "
        f"when it was waited for in the driver and {min(ratio['polled']):.1f}-{max(ratio['polled']):.1f}x in a "
        "busy loop: neither way of waiting keeps the next call at its loop cost, so the host pass's drain puts each",
        "pool call in that state whichever wait it uses (both paths' calls alike).",
        "",
    ]
    return lines


def _host_repeats() -> list[str]:
    """The side-by-side harness's host figures over repeated runs, and the plan's pinned host lengths."""
    reps, placed, unstaged = _load("vs_upstream_1gpu_repeats"), _load("plan_meta_placement"), None
    lines = []
    if reps is not None:
        lines += ["## Host figures over repeated runs (1 x H200)", "", f"`{SGW_PREFIX}{reps['command']}`", ""]
        lines += _table(
            reps["rows"],
            [
                ("commit", "commit"),
                ("date_utc", "date (UTC)"),
                ("ours_vs_stock_layer_time", "layer time stock/ours"),
                ("ours_vs_stock_layer_time_without_stand_ins", "same, w/o stand-ins"),
                ("ours_plan_host_us", "ours plan host µs"),
                ("ours_plan_host_us_begin_shard_extend", "of which begin µs"),
                ("ours_plan_host_us_translate_loc_to_scratch", "of which translate µs"),
                ("ours_plan_host_us_drained", "plan host µs, drained before each call"),
                ("ours_plan_host_us_busy", "plan host µs, device busy"),
                ("stock_metadata_host_us", "stock metadata host µs"),
                ("plan_host_vs_stock_metadata_host", "plan / stock metadata"),
                ("ours_read_host_us_per_layer", "ours read host µs/layer"),
                ("stock_read_host_us_per_layer", "stock read host µs/layer"),
                ("read_host_ratio", "read host ours/stock"),
                ("read_host_ratio_busy", "same, device busy"),
                ("host_passes", "host passes"),
                ("host_drain", "drain"),
                ("plan_drain", "plan drained before"),
            ],
        )
        lines += ["", reps["note"] + ".", ""]
        stock_meta = [r["stock_metadata_host_us"] for r in reps["rows"]]
        lines += [
            "The host runs faster or slower from run to run: SGLang's own `init_forward_metadata` over the stock",
            f"pool, the same code every time, takes {min(stock_meta)}-{max(stock_meta)} µs across these rows. So",
            "the plan is also given as a fraction of that call in the same run (`plan / stock metadata`).",
            "",
        ]
    if placed is not None:
        unstaged = _load("plan_meta_placement_unstaged")
        lines += ["## The plan's host lengths: device memory vs pinned, read in place (1 x H200)", ""]
        lines += [f"`{SGW_PREFIX}{placed['command']}` ({_env(placed)}; {placed.get('note', '')})", ""]
        cols = [
            ("requests", "requests"),
            ("pages", "page positions"),
            ("device_meta_kernel_us", "kernel µs, lengths on device"),
            ("pinned_meta_kernel_us", "kernel µs, pinned"),
            ("copied_meta_issue_us", "host µs to issue, copied"),
            ("pinned_meta_issue_us", "host µs to issue, pinned"),
        ]
        lines += _table(placed["rows"], cols)
        if unstaged is not None:
            lines += ["", f"Before the kernel staged them ({unstaged['note']}):", ""]
            lines += _table(unstaged["rows"], cols)
        lines += [""]
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
        "(the 2-GPU tests skip; [`log`](benchmarks/gpu_tests_1gpu.txt); at 93882a9 one failure, the translator",
        "test's own host-to-device copies under sync-debug mode, [`log`](benchmarks/gpu_tests_1gpu_93882a9.txt);",
        "at 9d5ff84 28 passed, that test fixed, [`log`](benchmarks/gpu_tests_1gpu_9d5ff84.txt); at 807319d 28 passed,",
        "[`log`](benchmarks/gpu_tests_1gpu_807319d.txt); at 9dfb09b 28 passed and one failure, its new test's own",
        "device comparison, which passes fixed, [`log`](benchmarks/gpu_tests_1gpu_9dfb09b.txt); at 36c8f4e 29 passed,",
        "[`log`](benchmarks/gpu_tests_1gpu_36c8f4e.txt); at dbee447 29 passed,",
        "[`log`](benchmarks/gpu_tests_1gpu_dbee447.txt); at 4655a48 the copy-engine file, 10 passed,",
        "[`log`](benchmarks/gpu_tests_1gpu_copy_engine_4655a48.txt); at b1ebdaa 30 passed,",
        "[`log`](benchmarks/gpu_tests_1gpu_b1ebdaa.txt); at 74ed15b 30 passed,",
        "[`log`](benchmarks/gpu_tests_1gpu_74ed15b.txt); at 224956f 30 passed,",
        "[`log`](benchmarks/gpu_tests_1gpu_224956f.txt));",
        "2 x H200, `source .sgw/setup.sh; python3 -m",
        "pytest -q -m gpu --timeout 60 test/srt/distributed/test_copy_engine_gpu.py",
        "test/srt/layers/attention/nsa/test_read_state_ranks.py` ([`log`](benchmarks/gpu_tests_2gpu_copy_engine.txt),",
        "6 passed) and `test_read_state_ranks.py` alone ([`log`](benchmarks/gpu_tests_2gpu_read_state.txt), 2 passed).",
        "Each log names the test files of its run; the one-H200 log also its commit, on its first line.",
        "",
        "Wall times on 2 x H200 (each command after `source .sgw/setup.sh`, about 40 s): the two test files",
        "above 23-54 s. On one H200, `bench_vs_upstream --backend gloo --scale 32k --paths stock ours layersplit`",
        "took 154 s with a warm-up forward at each kind's first batch (every batch's, now: about 1.5x that).",
        "Run the 128K scale as `--batches` pieces and `--merge` them (the side-by-side section).",
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
        "The plan is `plan_batch`, one program for the whole batch (the kernel the SGLang path runs): its",
        "device time grows with the batch's page positions, level with the torch formulation at 131,072 pages",
        "(8M tokens) and slower beyond, far past a prefill batch's prefix.",
        "",
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
    lines += _host_repeats()
    lines += _waited_calls()
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
