"""PD soak: 2 and 4 prefill CP ranks to one decode through SGLang's Mooncake connector, with faults.

The processes (``pd_soak_worker.py``):

- one prefill process holding the N prefill CP ranks: per rank SGLang 0.5.23's ``MooncakeKVManager``
  (prefill mode) over the plugin's CP-shared DSA pool, the allocator SGLang's configurator builds
  with the plugin (every rank runs its own and they must draw the same pages), a real Mooncake
  engine over TCP on 127.0.0.1, SGLang's bootstrap thread and transfer worker, and SGLang's
  ``MooncakeKVSender`` per request and rank. It also plays the router: it admits requests (at
  most 4 in flight), tells the decode, and injects the faults;
- one decode process (killed and started again once): SGLang's ``MooncakeKVManager`` (decode mode,
  with the plugin's manifest check), a stock DSA pool and ``PagedTokenToKVPoolAllocator`` built by
  SGLang's configurator, SGLang's ``MooncakeKVReceiver`` per request, and SGLang's release policy
  for failed requests (deferred decode KV release, SGLang's default: the pages are held until every
  prefill rank acknowledged the abort, or SGLang's 30 s release timeout).

Requests: lengths log-uniform from 1 token to 128 pages (64 tokens each), plus huge ones of more
than 1024 pages (positions, i.e. manifest entries and destination pages; on 2 ranks each rank's
Mooncake batch then holds more than 1024 (source, destination, length) entries), sent in 1 to 3
chunks. Faults: ~15 % of requests aborted (a client abort reaching the decode only or both sides,
before the destinations arrive, between chunks, or after the last chunk) and ~3 % aborted at the
prefill before the decode is told; the decode SIGKILLed with requests in flight (one of them still
sending, which the router leaves to fail at the prefill) and started again (a new Mooncake session that registers anew), then SIGSTOPped
for 2 s with requests in flight and continued. Huge requests are never aborted, and the kill and the
stop wait until no huge request is being sent, so every huge transfer completes and is checked.

Why a subprocess for the decode: SGLang's connector threads and the Mooncake engine cannot be
killed or frozen inside a process, so the decode runs as its own process and gets the real
signals; the prefill ranks share one process (threads per rank, each with its own engine and
sockets), since the faults under test are the decode's. When the decode is killed, the router
aborts at the prefill the requests that were routed to it (what a client disconnect does), but
one that is still sending; the killed decode's pages are freed by its exit.

Checks, after the run: every allocator's free pages (each prefill rank's and the last decode's)
and aux slots are back at their start; every Mooncake engine still holds exactly the regions it
registered at start and no (de)registration happened during the run; every connector table of
both sides is empty; every failed request was cleaned on both sides when it concluded; every
successful request's pages on the decode equal the replicated pool's pages (the unsharded pool
the prefill ranks wrote alongside theirs) byte for byte, compared through a 16-byte BLAKE2b
digest of each page (all layers' latent rows and DSA indexer page).

Connector state (``sglang_wiring.connector_bounds``): requests aborted at the prefill before the
decode is told (abort phase ``pre``) make every prefill rank receive destinations for a cleared
room, which SGLang 0.5.23 would record again for ever; the decode kill leaves one request sending,
so its next Mooncake batch fails and poisons the room, which SGLang would keep for ever. The plugin
drops the first at once and the second when the room's window ends (the end of the run sweeps as the
first clear after the window does); the tables are sampled through the run (never more rooms than
requests in flight at the prefill) and are empty at the end. Every decode session that ever
registered stays in the prefill's ``decode_kv_args_table``: one entry per decode start.

SGLang's per-token KV writers run under the Triton interpreter at one Python program per token; the
prefill process writes through their plain-torch twins (``reference.sglang_writers``, compared with the
kernels in ``test_sglang_writers.py``; the bf16 cache here reaches only the indexer-key one). Nothing
else is replaced.

``CP_SHARED_KV_SOAK_RANKS=2,4`` runs it with 2 and 4 prefill ranks, ``CP_SHARED_KV_SOAK_REQUESTS``
requests each (40 by default); without it the module is skipped: CI runs the same soak with 2 ranks
across two network namespaces, with link faults on top (``test_pd_faults.py``). The long one
is the same test with more requests and ``CP_SHARED_KV_SOAK_BOUNDS_WAIT=real`` (the end of the run
waits out the rooms' windows); see docs/benchmarks.md. ``CP_SHARED_KV_SOAK_REPORT=path``
writes the figures as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from plugin_models import write_model_dirs

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake, pytest.mark.soak]

HERE = Path(__file__).resolve().parent
REQUESTS = int(os.environ.get("CP_SHARED_KV_SOAK_REQUESTS", "40"))
SEED = int(os.environ.get("CP_SHARED_KV_SOAK_SEED", "13"))
PS = 64


def _config(n: int, model_dir: Path, log: Path) -> dict:
    return {
        "n": n,
        "ps": PS,
        "model_dir": str(model_dir),
        "seed": SEED + n,
        "requests": REQUESTS,
        "huge_fraction": 0.01,  # at least one
        "max_small_pages": 128,
        "abort_fraction": 0.15,
        "concurrency": 4,
        "prefill_pages": 1536,
        "decode_pages": 2048,
        "kill_at": 0.35,
        "stop_at": 0.7,
        "stop_s": 2.0,
        "release_timeout_s": 30.0,  # SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT's default
        "waiting_timeout_s": 120,
        "bootstrap_timeout_s": 120,
        "decode_start_timeout_s": 120,
        "finish_timeout_s": 60,
        "run_timeout_s": 60 + 4 * REQUESTS,
        "room_base": 1000,
        "decode_log": str(log),
        "prefill_ip": "127.0.0.1",
        "decode_ip": "127.0.0.1",
        # How the end of the run releases the poison of failed batches' rooms (connector_bounds):
        # "real" waits out each room's window (waiting + release timeouts + margin, ~155 s), "clock"
        # sweeps with the clock at the window's end, as the first clear after it does.
        "bounds_wait": os.environ.get("CP_SHARED_KV_SOAK_BOUNDS_WAIT", "clock"),
    }


# The prefill managers' per-room tables the worker reports (sizes), SGLang's and the plugin's.
PREFILL_TABLES = [
    "request_status",
    "transfer_infos",
    "failure_records",
    "req_to_decode_prefix_len",
    "staging_outstanding",
    "deferred_ack_targets",
    "manifest_shares",
    "queued_chunks",
    "poisoned_ack_rooms",
]


def _summary(r: dict) -> dict:
    rows = r["rows"]
    outcome = Counter()
    for x in rows:
        if x["decode"] == "success":
            outcome["success_exact" if x["exact"] else "success_corrupt"] += 1
        elif x["decode"] == "lost":
            outcome["lost_with_killed_decode"] += 1
        elif x["abort"]:
            outcome["aborted"] += 1
        else:
            outcome["failed_other"] += 1
    dl, pe = r["decode_ledger"], r["prefill_engines"]
    return {
        "prefill_cp_ranks": r["n"],
        "page_size": r["page_size"],
        "seed": r["seed"],
        "requests": len(rows),
        "wall_s": r["wall_s"],
        "outcomes": dict(sorted(outcome.items())),
        "aborts_injected": sum(1 for x in rows if x["abort"]),
        "aborts_by_side_and_phase": dict(sorted(Counter("/".join(x["abort"]) for x in rows if x["abort"]).items())),
        "decode_releases": {
            "after_every_rank_acked": sum(1 for x in rows if x["decode"] == "failed" and x["drained"]),
            "after_release_timeout": sum(1 for x in rows if x["decode"] == "failed" and x["drained"] is False),
        },
        "tokens": {"min": min(x["tokens"] for x in rows), "max": max(x["tokens"] for x in rows)},
        "pages": {
            "min": min(x["pages"] for x in rows),
            "max": max(x["pages"] for x in rows),
            "total_exact": sum(x["pages"] for x in rows if x["decode"] == "success"),
        },
        "requests_over_1024_pages": sum(1 for x in rows if x["pages"] > 1024),
        "mooncake_batches": {
            "prefill_batches": sum(e["batches"] for e in pe),
            "entries": sum(e["entries"] for e in pe),
            "max_entries_per_batch": max(e["max_entries_per_batch"] for e in pe),
            "failed_batches": sum(e["failed_batches"] for e in pe),
        },
        "faults": r["faults"],
        "decode_starts": [{k: i[k] for k in ("session", "start_s")} for i in r["incarnations"]],
        "prefill_free_pages": r["prefill_free_pages"],
        "decode_free_pages": {"start": dl["free_pages_start"], "end": dl["free_pages_end"]},
        "registrations": {
            "prefill_engines": [
                {"start": e["regions_at_start"], "end": e["regions_held_at_end"], **e["registration_calls_during_run"]}
                for e in pe
            ],
            "decode_engine": {
                "start": dl["engine"]["regions_at_start"],
                "end": dl["engine"]["regions_held_at_end"],
                **dl["engine"]["registration_calls_during_run"],
            },
            "prefill_decode_kv_args_table": [len(t["decode_registrations"]) for t in r["prefill_tables"]],
        },
        "connector_bounds": {
            "max_room_entries_over_requests_in_flight": [t["max_excess_over_in_flight"] for t in r["prefill_tables"]],
            "max_poisoned_rooms": [t["max_poisoned"] for t in r["prefill_tables"]],
            "poisoned_rooms_at_end_before_sweep": [t["poisoned_before_sweep"] for t in r["prefill_tables"]],
            "late_destinations_dropped": [t["bounds"]["late_dropped"] for t in r["prefill_tables"]],
            "poisoned_rooms_released": [t["bounds"]["poison_dropped"] for t in r["prefill_tables"]],
            "window_s": r["bounds_window_s"],
            "end_of_run_sweep": r["bounds_wait"],
            "table_samples": r["table_samples"],
        },
        "tables_left": {
            "prefill": [{k: t[k] for k in PREFILL_TABLES if t[k]} for t in r["prefill_tables"]],
            "decode": {k: v for k, v in dl["tables"].items() if v},
        },
    }


def run_soak(cfg: dict, root: Path, prefix: tuple[str, ...] = (), name: str = "") -> tuple[dict, str]:
    """Run the soak's prefill process (``prefix``: e.g. ``ip netns exec NS``) on ``cfg``; its result and stderr."""
    env = {**os.environ, "SGLANG_PLUGINS": "cp_shared_kv", "TRITON_INTERPRET": "1", "MC_LOG_LEVEL": "WARNING"}
    env.pop("SGLANG_DEBUG_CP_SHARED_KV", None)
    # The timeouts SGLang reads from its environment, as the decode is configured (both sides alike).
    env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(cfg["waiting_timeout_s"])
    env["SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"] = str(cfg["release_timeout_s"])
    env.update(cfg.get("sglang_env", {}))
    proc = subprocess.run(
        [*prefix, sys.executable, str(HERE / "pd_soak_worker.py"), "prefill", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=cfg["run_timeout_s"] + 500,
        env=env,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT:")]
    decode_log = (root / "decode.log").read_text(errors="replace")[-3000:] if (root / "decode.log").exists() else ""
    assert proc.returncode == 0 and line, (
        f"soak worker failed (rc={proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}\n"
        f"decode log:\n{decode_log}"
    )
    result = json.loads(line[-1][len("RESULT:") :])
    result["summary"] = _summary(result)
    dump = os.environ.get("CP_SHARED_KV_SOAK_DUMP")  # a folder: every request's row, for a failure's analysis
    if dump:
        Path(dump, f"{name or 'pd_soak'}_{cfg['n']}.json").write_text(json.dumps(result, indent=1))
        Path(dump, f"{name or 'pd_soak'}_{cfg['n']}.stderr").write_text(proc.stderr)
    return result, proc.stderr


# CI runs the 2-rank soak across two network namespaces (test_pd_faults.py) instead of this module.
RANKS = [int(x) for x in os.environ.get("CP_SHARED_KV_SOAK_RANKS", "").split(",") if x]
if not RANKS:
    pytestmark.append(
        pytest.mark.skip(reason="the loopback soak runs with CP_SHARED_KV_SOAK_RANKS=2,4; CI runs test_pd_faults.py")
    )
    RANKS = [2]


@pytest.fixture(scope="module", params=RANKS, ids=[f"{n}_prefill_ranks" for n in RANKS])
def soak(request, tmp_path_factory) -> dict:
    n = request.param
    root = tmp_path_factory.mktemp(f"soak{n}")
    write_model_dirs(root, ["mla", "dsa"])
    cfg = _config(n, root, root / "decode.log")
    result, _ = run_soak(cfg, root)
    report = os.environ.get("CP_SHARED_KV_SOAK_REPORT")
    if report:
        path = Path(report)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[f"{n}_prefill_ranks"] = result["summary"]
        path.write_text(json.dumps(data, indent=2) + "\n")
    return result


def test_every_request_concludes(soak):
    assert soak["stuck"] == []
    assert soak["requests_finished"] == soak["requests_planned"] == REQUESTS
    assert all(x["prefill"] in ("success", "failed") for x in soak["rows"])
    assert all(x["decode"] in ("success", "failed", "lost") for x in soak["rows"]), Counter(
        x["decode"] for x in soak["rows"]
    )


def test_the_faults_hit_requests_in_flight(soak):
    killed, stopped = soak["faults"]["killed"], soak["faults"]["stopped"]
    assert killed and killed["in_flight"] >= 1, killed
    assert stopped and stopped["in_flight"] >= 1, stopped
    assert len(soak["incarnations"]) == 2  # the decode came back under a new Mooncake session
    assert soak["incarnations"][0]["session"] != soak["incarnations"][1]["session"]
    rows = soak["rows"]
    assert sum(1 for x in rows if x["decode"] == "lost") == killed["in_flight"]
    assert any(x["abort"] for x in rows)
    assert all(x["incarnation"] == 0 for x in rows if x["decode"] == "lost")  # only the killed decode's


def test_lengths_span_one_token_to_over_1024_pages(soak):
    rows = soak["rows"]
    assert min(x["tokens"] for x in rows) == 1
    huge = [x for x in rows if x["pages"] > 1024]
    assert huge
    if soak["n"] == 2:  # each rank's Mooncake batch of a huge request holds its ~513 pages x 2 layers
        assert max(e["max_entries_per_batch"] for e in soak["prefill_engines"]) > 1024


def test_every_successful_request_equals_the_replicated_pool(soak):
    ok = [x for x in soak["rows"] if x["decode"] == "success"]
    assert len(ok) >= REQUESTS // 2, Counter(x["decode"] for x in soak["rows"])
    assert [x["room"] for x in ok if not x["exact"]] == []
    # A request served whole was never aborted at the prefill before its last status left.
    assert all(x["prefill"] == "success" or x["abort"] for x in ok)


def test_unaborted_requests_fail_only_through_the_killed_decode(soak):
    other = [x for x in soak["rows"] if x["decode"] == "failed" and not x["abort"]]
    assert other == []


def test_every_failed_request_is_freed_on_both_sides(soak):
    failed = [x for x in soak["rows"] if x["decode"] != "success"]
    assert failed
    # At its conclusion no connector table of the prefill ranks still names the room, except where
    # the decode's destination pages reached a rank after its sender was aborted and cleared (SGLang
    # records the room again then; see test_connector_tables_are_empty).
    assert [
        x["room"] for x in soak["rows"] if not x["prefill_clean"] and not x["concluded_before_metadata_on_ranks"]
    ] == []
    assert [x["room"] for x in soak["rows"] if not x["decode_clean"]] == []
    # The decode held each failed request's pages until every prefill rank acknowledged the abort.
    assert [x["room"] for x in failed if x["decode"] == "failed" and not x["drained"]] == []
    # Pages: every request's prefill pages went back (the free counts at the end are checked below).
    assert sum(x["prefill_pages_taken"] for x in soak["rows"]) == sum(x["prefill_pages_returned"] for x in soak["rows"])


def test_free_pages_are_back_where_they_started(soak):
    pages = soak["prefill_free_pages"]
    assert pages["end"] == pages["start"] and len(pages["start"]) == soak["n"]
    assert soak["prefill_aux_free_end"] == 64
    ledger = soak["decode_ledger"]
    assert ledger["left_active"] == [] and ledger["left_held"] == []
    assert ledger["free_pages_end"] == ledger["free_pages_start"]
    assert ledger["aux_free_end"] == 64


def test_connector_tables_are_empty(soak):
    """Every connector table of both sides is empty at the end, ``decode_kv_args_table`` aside.

    Without the plugin's bounds SGLang 0.5.23 keeps a room whose destinations reached a rank after
    its sender was cleared, and every poisoned room; ``connector_bounds`` drops the first at once and
    the second when the room's window ends (swept at the end of the run). The decode registrations
    are one per decode session (see test_engine_registrations_are_back_where_they_started).
    """
    for rank, t in enumerate(soak["prefill_tables"]):
        assert t["rooms_left"] == [], (rank, t)
        assert {k: t[k] for k in PREFILL_TABLES if t[k]} == {}, (rank, t)
        assert t["poisoned_ack_rooms"] == 0, (rank, t)
        assert t["poisoned_all_in_open_windows"], (rank, t)  # nothing was released early
        assert t["poisoned_before_sweep"] <= soak["prefill_engines"][rank]["failed_batches"], (rank, t)
        assert t["bounds"]["live"] == t["bounds"]["unclaimed"] == 0, (rank, t)
    assert {k: v for k, v in soak["decode_ledger"]["tables"].items() if v} == {}


def test_late_destinations_and_poisoned_rooms_are_released(soak):
    """The two rooms SGLang 0.5.23 keeps, provoked on purpose and released by ``connector_bounds``.

    - requests aborted at the prefill before the decode sent its destination pages (abort phase
      ``pre``): every rank receives destinations for a room it has cleared, and drops them;
    - the request left sending when the decode was killed: its next chunk's Mooncake batch to the
      dead decode fails, which poisons the room on the ranks that sent it; the poison is released
      only once the room's window has ended (never earlier), and then it is.
    """
    pre = [x for x in soak["rows"] if x["abort"] == ["both", "pre"] and x["decode"] != "lost"]
    assert pre
    for rank, t in enumerate(soak["prefill_tables"]):
        assert t["bounds"]["late_dropped"] >= len(pre), (rank, t["bounds"], len(pre))
    victim = soak["faults"]["killed"]["left_sending"]
    assert victim is not None
    row = next(x for x in soak["rows"] if x["room"] == victim)
    assert row["prefill"] == "failed" and row["decode"] == "lost", row
    poisoned = [t["poisoned_before_sweep"] for t in soak["prefill_tables"]]
    assert sum(poisoned) >= 1, poisoned
    assert [t["bounds"]["poison_dropped"] for t in soak["prefill_tables"]] == poisoned


def test_room_tables_never_exceed_the_requests_in_flight(soak):
    """Sampled through the run (every 0.1 s): no prefill rank's per-room table held more rooms than
    the requests in flight at the prefill; the poisoned rooms, held for their window, stay few."""
    assert soak["table_samples"] >= 10
    for rank, t in enumerate(soak["prefill_tables"]):
        assert t["max_excess_over_in_flight"] <= 0, (rank, t)
        assert t["max_poisoned"] <= soak["prefill_engines"][rank]["failed_batches"], (rank, t)


def test_engine_registrations_are_back_where_they_started(soak):
    engines = [*soak["prefill_engines"], soak["decode_ledger"]["engine"]]
    for e in engines:
        assert e["regions_held_at_end"] == e["regions_at_start"] == 5, e  # 2 latent + 2 indexer layers + aux
        assert set(e["registration_calls_during_run"].values()) == {0}, e
    sessions = sorted(i["session"] for i in soak["incarnations"])
    for t in soak["prefill_tables"]:
        # SGLang keeps every decode session that ever registered: one per decode start, not per request.
        assert t["decode_registrations"] == sessions


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
