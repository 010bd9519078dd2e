"""Fill the tables of ``docs/benchmarks.md`` from the result files in ``docs/benchmarks/``.

The page is written by hand; each table sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``
and is replaced by ``TABLES[NAME]`` rendered from its JSON. Nothing else on the page is touched.

    python -m benchmark.cp_shared_kv.summarize           # rewrite the tables in place
    python -m benchmark.cp_shared_kv.summarize --check   # exit 1 if a table differs from its JSON
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "docs" / "benchmarks"
MARKER = re.compile(r"(<!-- table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def table(head: list[str], rows: list[list[object]]) -> str:
    fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def link(name: str) -> str:
    return f"[`{name}`](benchmarks/{name})"


SIDE_BY_SIDE = [("32K", "vs_upstream_1gpu.json"), ("128K", "vs_upstream_1gpu_128k.json"),
                ("prefix 90%", "vs_upstream_1gpu_prefix90.json")]  # fmt: skip


def side_by_side() -> str:
    rows = []
    for label, name in SIDE_BY_SIDE:
        d = load(name)
        s, r = d["summary"], d["rows"]
        diff = statistics.median(x["ours_layer_time_us"] - x["stock_layer_time_us"] for x in r)
        stand_ins = sum(x["ours_stand_ins_us_per_layer"] for x in r) / sum(x["ours_layer_time_us"] for x in r)
        syncs = f"{s['host_syncs_ours_per_forward']}, {s['host_syncs_stock_per_forward']}"
        rows.append([label, link(name), d["environment"]["date_utc"], len(r), s["ours_vs_stock_layer_time"],
                     s["ours_vs_stock_layer_time_without_stand_ins"], f"{diff:+.0f}", f"{stand_ins:.0%}",
                     s["correct_all"], syncs, s["current_chunk_bytes_gathered"],
                     s["peak_scratch_ratio_equal_admission"]])  # fmt: skip
    head = ["workload", "result", "date (UTC)", "batches", "layer time, stock / ours",
            "the same without stand-ins' time", "ours - stock, µs per layer (median batch)",
            "stand-ins' share of our layer time", "timed outputs bit-exact", "host syncs per forward (ours, stock)",
            "current-chunk bytes moved", "scratch / SGLang's at equal admission"]  # fmt: skip
    return table(head, rows)


def host_cost() -> str:
    rows = []
    for label, name in SIDE_BY_SIDE:
        s = load(name)["summary"]
        plan, meta, reads, stock_reads = (s["ours_plan_host_us"], s["stock_metadata_host_us"],
                                          s["ours_read_host_us_per_layer"], s["stock_read_host_us_per_layer"])  # fmt: skip
        rows.append([label, plan, s["ours_metadata_host_us"], meta, round(plan / meta, 3), reads, stock_reads,
                     round(reads / stock_reads, 2)])  # fmt: skip
    head = ["workload", "our batch plan µs (goal 200)", "SGLang's metadata call over ours µs",
            "the same over the stock pool µs", "plan / stock metadata call", "our reads µs per layer",
            "stock reads µs per layer", "reads, ours / stock (goal 1.5)"]  # fmt: skip
    return table(head, rows)


OVERLAP = [("in line", "inline_real"), ("ahead (wired)", "prefetch_real_gather_compute"),
           ("ahead, gather on the side stream", "prefetch_real"),
           ("ahead, normal-priority side stream", "prefetch_real_normal_priority"),
           ("attention only: in line", "inline_real_attention_only"),
           ("attention only: ahead", "prefetch_real_gather_compute_attention_only")]  # fmt: skip


def overlap() -> str:
    rows = []
    for r in load("overlap_1gpu.json")["rows"]:
        v = r["paired"]["variants"]
        cells = [f"{v[k]['ratio_median'] - 1:+.2%} [{v[k]['ratio_q1'] - 1:+.2%}, {v[k]['ratio_q3'] - 1:+.2%}]"
                 for _, k in OVERLAP]  # fmt: skip
        rows.append([f"{r['context_tokens'] // 1024}K", round(r["view_bytes"] / 1e6), *cells])
    return table(["context", "view MB", *(label for label, _ in OVERLAP)], rows)


def two_gpus() -> str:
    d = load("vs_upstream.json")
    s = d["summary"]
    return table(
        ["result", "date (UTC)", "GPUs", "bytes received, ours / SGLang's sharding", "the same, shared-prefix turn",
         "scratch bytes, ours / SGLang's", "host syncs per forward, ours", "the same, SGLang's sharding",
         "reads bit-exact"],
        [[link("vs_upstream.json"), d["environment"]["date_utc"], f"{d['environment']['gpu_count']} x H200",
          s["bytes_ratio"], s["bytes_ratio_shared_prefix_turn"], s["peak_scratch_ratio"],
          s["host_syncs_ours_per_forward"], s["host_syncs_upstream_per_forward"], s["correct_all"]]],
    )  # fmt: skip


def pd_transfer() -> str:
    d = load("pd_transfer.json")
    s = d["summary"]
    rows = [[n, s[f"cp{n}_sharded_gbps"], s[f"cp{n}_stock_gbps"], s[f"cp{n}_sharded_vs_stock"]] for n in (2, 4)]
    rows = [[*row, s["all_exact"]] for row in rows]
    head = ["prefill CP ranks", "sharded send GB/s", "stock send GB/s", "sharded / stock", "byte-exact"]
    return table(head, rows)


def pd_faults() -> str:
    d = load("pd_faults.json")
    s, soak, part = d["summary"], d["soak_summary"], d["partition"]
    killed = soak["faults"]["killed"]
    causes = ", ".join(f"{k.removeprefix('failed_').replace('_', ' ')} {v}" for k, v in s["failed_by_cause"].items())
    exposed = ", ".join(f"{k} {v}" for k, v in s["not_aborted_exposed_by_fault"].items())
    detected = s["partition_detected_after_s"]
    rows = [
        ["requests (tokens min ... max)", f"{s['requests_total']} ({soak['tokens']['min']} ... {soak['tokens']['max']})"],
        ["served, byte-exact vs the replicated pool (corrupt)", f"{s['served_exact']} ({s['served_corrupt']})"],
        ["served floor: requests neither aborted nor exposed to a fault", s["served_floor"]],
        ["failed, by cause", causes],
        ["failed, unexplained", s["failed_unexplained"]],
        ["not aborted, exposed to a fault", exposed],
        ["hung (not concluded by the run's deadline) / leaked", f"{s['hung']} / {s['leaked']}"],
        ["link cap each way", f"{d['link']['rate_each_way']} (delay and loss skipped: no `sch_netem`)"],
        ["partition: seconds, requests in flight when cut, spanning it",
         f"{s['partition_s']}, {part['in_flight']}, {part['requests_spanning_it']}"],
        ["partition detected (a transfer failed by it)", "no transfer failed" if detected is None else f"{detected} s"],
        ["prefill transfer time p50 / p99", f"{s['transfer_s_p50']} s / {s['transfer_s_p99']} s"],
        ["longest transfer spanning the partition", f"{s['transfer_s_max_spanning_partition']} s"],
        ["decode killed: requests in flight, restarted after", f"{killed['in_flight']}, {killed['restart_s']} s"],
        ["run wall time; commit", f"{s['wall_s']} s; `{d['commit'][:7]}`"],
    ]  # fmt: skip
    return table(["", ""], rows)


def decode_dcp() -> str:
    d = load("decode_dcp.json")
    s, rows = d["summary"], d["rows"]
    by = {(r["layout"], r["cp_size"]): r for r in rows}
    sizes = sorted({r["cp_size"] for r in rows})
    out = []
    for n in sizes:
        repl, dcp, ours = by["replicated", n], by["sglang_dcp", n], by["sharded", n]
        out.append([n, repl["tokens_per_gpu"], dcp["tokens_per_gpu"], dcp["capacity_ratio"],
                    ours["tokens_per_gpu"], ours["capacity_ratio"]])  # fmt: skip
    head = [
        "DCP ranks",
        f"tokens per GPU, replicated ({s['budget_gib']} GiB, 61 layers)",
        "SGLang's DCP (index replicated)",
        "ratio",
        "sharded (latent + index)",
        "ratio",
    ]
    ties = f"{s['topk_edge_ties']} of {len(s['topk_lengths'])} rows tied at the edge"
    topk = (
        f"\nGlobal top-{s['topk_k']} equal to the replicated indexer's at {s['topk_cp_sizes']} ranks, contexts "
        f"{s['topk_lengths']} ({ties}): **{s['topk_exact']}**. "
        f"{link('decode_dcp.json')}, commit `{(d['environment']['commit'] or '?')[:7]}`.\n"
    )
    return table(head, out) + topk + "\n" + decode_dcp_step()


def decode_dcp_step() -> str:
    if not (RESULTS / "decode_dcp_step.json").exists():
        return "Step time: not measured (the step model, `decode_dcp_step`, needs a GPU).\n"
    d = load("decode_dcp_step.json")
    s, env = d["summary"], d["environment"]
    rows = [[r["batch"], f"{r['context'] // 1024}K", r["replicated_us"], r["sharded_us"], r["overhead_pct"],
             r["topk_equal"]] for r in d["rows"]]  # fmt: skip
    head = ["batch", "context", "replicated (us)", f"sharded, rank 0 of {s['cp_size']} (us)", "overhead %",
            "merged top-k = replicated"]  # fmt: skip
    if all("merge_us" in r for r in d["rows"]):  # the merge by one top-k against two sorts, same run
        head += ["merge: one top-k / two sorts (us)", "sharded with the two-sort merge (us)"]
        for row, r in zip(rows, d["rows"]):
            row += [f"{r['merge_us']} / {r['merge_sorting_us']}", r["sharded_sorting_merge_us"]]
    if all("attn_owned_first_us" in r for r in d["rows"]):  # the attention over owned rows only, same run
        head += ["rank 0's attention: all k / its rows first (us)", "largest output difference"]
        for row, r in zip(rows, d["rows"]):
            row += [f"{r['attn_us']} / {r['attn_owned_first_us']}", f"{r['owned_first_max_diff']:.2g}"]
    link_s = s["link"]
    note = (
        f"\nOverhead: {s['what']}; CUDA-graph replays; all-gathers paced to "
        f"{link_s['link_gbps']} GB/s with {link_s['copy_engine_latency_us']} us per collective (an assumption). "
        f"Stand-ins, the same on both sides: {'; '.join(s['stand_ins'])}. {env.get('gpu', '?')}, "
        f"{link('decode_dcp_step.json')}, commit `{(env.get('commit') or '?')[:7]}`.\n"
    )
    return table(head, rows) + note


def fail_stop() -> str:
    """One column per run: ``fail_stop.json`` and any ``fail_stop_cp<N>.json`` (another CP size)."""
    files = sorted(RESULTS.glob("fail_stop*.json"))
    if not files:
        return "Not run yet: `fail_stop` needs a GPU.\n"
    runs = [load(f.name) for f in files]
    cells = [
        ("CP size; kill trials (a rank SIGKILLed mid-batch)", lambda s, e: f"{s['cp_size']}; {s['kill_trials']}"),
        ("survivors hung / failed otherwise than the peer-lost line",
         lambda s, e: f"{s['kill_hangs']} / {s['kill_other_errors']}"),
        ("slowest peer-lost line after the kill (deadline)",
         lambda s, e: f"{s['kill_max_seconds']} s ({s['deadline_s']} s)"),
        ("survivors whose batch loop then ended with the line", lambda s, e: s["kill_loops_ended"]),
        ("GPU still runs work after the line", lambda s, e: s["gpu_usable_after"]),
        ("rounds read wrong on all ranks, fence on / off (rounds per rank)",
         lambda s, e: f"{s['fence_on_wrong_rounds']} / {s['fence_off_wrong_rounds']} ({s['fence_rounds_per_rank']})"),
        ("device; commit", lambda s, e: f"{e.get('gpu', '?')}; `{(e.get('commit') or '?')[:7]}`"),
    ]  # fmt: skip
    rows = [[name] + [cell(d["summary"], d["environment"]) for d in runs] for name, cell in cells]
    return table([""] + [link(f.name) for f in files], rows)


TABLES: dict[str, Callable[[], str]] = {
    "side-by-side": side_by_side,
    "host-cost": host_cost,
    "overlap": overlap,
    "two-gpus": two_gpus,
    "pd-transfer": pd_transfer,
    "pd-faults": pd_faults,
    "decode-dcp": decode_dcp,
    "fail-stop": fail_stop,
}


def render(text: str) -> str:
    """``text`` with every marked table rendered from its JSON; an unknown name raises."""
    return MARKER.sub(lambda m: m.group(1) + TABLES[m.group("name")]() + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a table differs from its JSON")
    args = ap.parse_args(argv)
    text = DOC.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{DOC.relative_to(ROOT)}: tables out of date: python -m benchmark.cp_shared_kv.summarize")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
