"""PD across two network namespaces: the soak's prefill and decode on two "hosts" joined by a veth pair.

The test makes two network namespaces (root only; skipped with the reason where they cannot be
made), joins them by a veth pair (10.231.X.1 for the prefill, 10.231.X.2 for the decode), caps the
link with ``tc ... tbf`` both ways, and runs ``test_pd_soak``'s processes there: the prefill CP
ranks (SGLang's ``MooncakeKVManager`` and ``MooncakeKVSender``, the plugin's pool and hooks, a real
Mooncake engine per rank) in one namespace, the decode (SGLang's manager and ``MooncakeKVReceiver``
with the plugin's manifest check) in the other, Mooncake and ZMQ over TCP across the link. The
router's messages to the decode go over the decode process's stdin (the control plane is not
under test). Faults on top of the soak's (aborts, the decode killed and restarted, then stopped for
2 s): the link cut (the prefill's end set down) for ``partition_s`` with transfers in flight, then
set up again.

SGLang's own recovery runs as in a server: the prefill's failed-session probe (a decode session
that failed a transfer is blacklisted, probed every 2 s here, and taken back once it answers), the
decode's waiting timeout (45 s here) for a request whose prefill's Failed status was lost on the cut
link, and the receiver's bootstrap lookup after a failure (answered from its cache, as the bootstrap
server would).

Delay and loss: with ``sch_netem`` the link also gets ``netem delay/loss``. This kernel has no
``sch_netem`` (nor ``act_gact`` or netfilter to steer the flows through a relay of ours, and
Mooncake's handshake advertises each engine's own address), so they are skipped with the reason
recorded (``delay_loss``) and printed.

Faults at request indices, not on the clock: the kill once ``kill_at`` of the requests have started
(and one is still sending), the cut at ``partition_at`` (after the kill, with transfers in flight), the
stop at ``stop_at``. The worker records each window on its monotonic clock (SIGKILL to the new decode
ready, link down to up, SIGSTOP to SIGCONT) and every window in which a prefill rank had a decode
session blacklisted (SGLang's ``failed_sessions``).

Checks: every request concludes (none stuck past the run's deadline); every success is byte-exact
to the replicated pool; every failure of a request its client did not abort has a cause matched by
SGLang's exact message for this request's room (or decode session), and the fault that cause belongs
to reached the request (``judge``): a failed transfer only for a request at the prefill while the
link was cut or the decode stopped, the blacklisted session only while it was blacklisted after such
a fault (and the probe took it back within its window), the decode's waiting timeout only for a
request in flight while the link was cut; every request neither aborted nor exposed to a fault is
served byte-exact, and they are at least half of all (``served_floor``); free pages, aux slots,
engine registrations and every connector table (``connector_bounds``) back where they started;
decode registrations one per decode start.

``CP_SHARED_KV_FAULTS_REQUESTS`` (CI: 40); ``CP_SHARED_KV_FAULTS_REPORT=path`` writes the figures
(``docs/benchmarks/pd_faults.json``); the long run uses ``CP_SHARED_KV_SOAK_BOUNDS_WAIT=real``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from plugin_models import write_model_dirs
from test_pd_soak import PREFILL_TABLES, _config, run_soak

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake, pytest.mark.soak]

REQUESTS = int(os.environ.get("CP_SHARED_KV_FAULTS_REQUESTS", "40"))
N = 2
RATE = os.environ.get("CP_SHARED_KV_FAULTS_RATE", "400mbit")  # the link's cap, each way
PARTITION_S = 10.0
WAITING_S = 45  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT on both sides


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=20)


class TwoHosts:
    """Two network namespaces joined by a capped veth pair; removed by ``close``."""

    def __init__(self):
        tag = os.getpid() % 10_000
        self.ns_p, self.ns_d = f"cpkvP{tag}", f"cpkvD{tag}"
        self.if_p, self.if_d = f"cpkvp{tag}", f"cpkvd{tag}"
        sub = 1 + os.getpid() % 250
        self.ip_p, self.ip_d = f"10.231.{sub}.1", f"10.231.{sub}.2"
        self.made: list[str] = []

    def open(self) -> str | None:
        """Make the namespaces and the link; the reason if they cannot be made."""
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
            return "network namespaces need root and iproute2 (ip, tc)"
        for ns in (self.ns_p, self.ns_d):
            r = _sh("ip", "netns", "add", ns)
            if r.returncode:
                return f"cannot make a network namespace: {r.stderr.strip()}"
            self.made.append(ns)
        steps = [
            ("ip", "link", "add", self.if_p, "type", "veth", "peer", "name", self.if_d),
            ("ip", "link", "set", self.if_p, "netns", self.ns_p),
            ("ip", "link", "set", self.if_d, "netns", self.ns_d),
        ]
        for ns, ifc, ip in ((self.ns_p, self.if_p, self.ip_p), (self.ns_d, self.if_d, self.ip_d)):
            steps += [
                ("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"),
                ("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", ifc),
                ("ip", "netns", "exec", ns, "ip", "link", "set", ifc, "up"),
            ]
        for cmd in steps:
            r = _sh(*cmd)
            if r.returncode:
                return f"cannot set up the link ({' '.join(cmd)}): {r.stderr.strip()}"
        return None

    def cap(self, rate: str) -> None:
        for ns, ifc in ((self.ns_p, self.if_p), (self.ns_d, self.if_d)):
            r = _sh(
                *f"ip netns exec {ns} tc qdisc add dev {ifc} root handle 1: tbf rate {rate} burst 256kb latency 100ms".split()
            )
            assert r.returncode == 0, r.stderr

    def delay_loss(self) -> str:
        """Add netem delay and loss under the cap where the kernel has it; what was done, or why not."""
        netem = "netem delay 5ms 1ms loss 0.1%"
        r = _sh(*f"ip netns exec {self.ns_p} tc qdisc add dev {self.if_p} parent 1:1 handle 10: {netem}".split())
        if r.returncode:
            return (
                f"skipped: tc netem is unavailable ({r.stderr.strip()[:160]}); no relay: no act_gact or netfilter"
                " to steer the flows, and Mooncake's handshake advertises each engine's own address"
            )
        return "netem delay 5ms +-1ms, loss 0.1% on the prefill's egress"

    def qdiscs(self) -> dict:
        ends = ((self.ns_p, self.if_p), (self.ns_d, self.if_d))
        return {ifc: _sh(*f"ip netns exec {ns} tc -s qdisc show dev {ifc}".split()).stdout.strip() for ns, ifc in ends}

    def close(self) -> None:
        for ns in self.made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            _sh("ip", "netns", "del", ns)
        self.made = []


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


# -- what explains a request that was not served ------------------------------------------------------
# SGLang's probe of a blacklisted decode session (SGLANG_FAILED_SESSION_PROBE_*, set below): a pass every
# PROBE_INTERVAL_S, a failing session probed again after a doubling interval of at most PROBE_MAX_S. Once
# the session answers, the probe takes it back within one backed-off interval plus one pass, plus the
# probe itself (a TCP handshake; 3 s of margin on 2 shared cores).
PROBE_INTERVAL_S, PROBE_MAX_S = 2, 10
PROBE_WINDOW_S = PROBE_MAX_S + PROBE_INTERVAL_S + 3
EPS = 0.05  # the rows' times are rounded to ms and sampled by the router's loop (2 ms)

# Each cause: SGLang's exact message, anchored (``re.fullmatch``), naming this request's room or, for
# the blacklist, this request's decode session. {room}, {session}, {decode_ip} are filled per request.
# - transfer_error (prefill): mooncake/conn.py's transfer worker, a Mooncake batch or the aux write failed;
# - session_not_alive (prefill): the same worker, for a chunk to a decode session blacklisted after a
#   failed transfer (until SGLang's probe takes it back);
# - waiting_timeout (decode): common/conn.py's CommonKVReceiver._check_waiting_timeout, where the
#   prefill's status was lost (the cut link).
# Mooncake's status message carries no reason (``kv_status_msg_carries_reason`` is False), so a decode
# failed by its prefill reads SGLang's ``DEFAULT_PREFILL_FAILURE_REASON``; the cause is then the
# prefill ranks' reasons for the room: at least one, each naming a cause, or saying the room was failed
# from the other side.
CAUSES = {
    "transfer_error": (
        r"Failed to send kv chunk of {room} to {decode_ip}:\d+",
        r"Failed to send aux data of {room}",
    ),
    "session_not_alive": (r"Decode instance could be dead, remote mooncake session {session} is not alive",),
    "waiting_timeout": (r"Request {room} timed out after (?P<elapsed>\d+\.\d)s in KVPoll\.WaitingForInput",),
}
# What a prefill rank reports for a room the decode failed (the decode's ABORT, sent to every prefill
# rank when it fails a request, marks the room Failed with no reason on a rank that had none):
# common/conn.py's CommonKVSender.failure_exception and conclude_transfer.
AFTER_DECODE_GAVE_UP = (
    "Failed due to an unknown reason from another rank",
    "Room marked Failed before the transfer ended",
)
FAILED_BY_PREFILL = "Failed to get kvcache from prefill instance, it might be dead"  # common/conn.py
PREFILL_CAUSES = ("transfer_error", "session_not_alive")


def cause_of(reason: str, room: int, session: str | None, decode_ip: str) -> tuple[str, re.Match] | None:
    """The cause whose exact message ``reason`` is, for this request (room, decode session), or None."""
    fill = {"room": room, "session": re.escape(session or "-"), "decode_ip": re.escape(decode_ip)}
    for name, patterns in CAUSES.items():
        for p in patterns:
            m = re.fullmatch(p.format(**fill), reason)
            if m:
                return name, m
    return None


def _overlaps(a0: float, a1: float, w0: float, w1: float | None) -> bool:
    return a0 <= (math.inf if w1 is None else w1) + EPS and w0 <= a1 + EPS


def fault_windows(r: dict) -> dict:
    """The injected faults' windows (seconds since the run's start, the worker's monotonic clock)."""
    f = r["faults"]
    out = {name: (f[name]["begin_s"], f[name]["end_s"]) for name in ("killed", "stopped", "partition") if f.get(name)}
    return out


def explained_blacklists(r: dict) -> tuple[list[dict], list[dict]]:
    """SGLang's blacklist of a decode session, window by window: (explained, unexplained).

    A window is explained when it is the killed decode's session (a chunk sent to the dead decode; it
    may stay blacklisted to the end), or when it began while a request to that session exposed to the
    cut link or the stopped decode was at the prefill, no earlier than the fault, and the probe took
    the session back within ``PROBE_WINDOW_S`` of the later of its start and the fault's end (the
    probe cannot succeed while the link is down).
    """
    w, rows = fault_windows(r), r["rows"]
    killed = r["faults"]["killed"]["session"] if r["faults"].get("killed") else None
    ok, bad = [], []
    for b in r["faults"]["blacklisted"]:
        fine = b["session"] == killed and b["begin_s"] >= w["killed"][0] - EPS
        for name in ("partition", "stopped"):
            if fine or name not in w:
                continue
            w0, w1 = w[name]
            exposed = [
                x for x in rows if x["session"] == b["session"] and _overlaps(x["start_s"], x["prefill_end_s"], w0, w1)
            ]
            began_in = exposed and w0 - EPS <= b["begin_s"] <= max(x["prefill_end_s"] for x in exposed) + EPS
            fine = bool(began_in) and b["end_s"] is not None and b["end_s"] <= max(b["begin_s"], w1) + PROBE_WINDOW_S
        (ok if fine else bad).append(b)
    return ok, bad


def _failure(x: dict, exposed_to: list[str], in_flight_cut: bool, decode_ip: str) -> tuple[str, bool]:
    """A failed request's cause and whether the fault it belongs to reached the request."""

    def reached(cause: str, m: re.Match) -> bool:
        if cause == "transfer_error":
            return bool({"partition", "stopped"} & set(exposed_to))
        if cause == "session_not_alive":
            return "blacklisted" in exposed_to
        return in_flight_cut and float(m["elapsed"]) >= WAITING_S - 0.5

    room, session = x["room"], x["session"]
    named = [(why, cause_of(why, room, session, decode_ip)) for why in x["prefill_reasons"]]
    bad = [why for why, c in named if why not in AFTER_DECODE_GAVE_UP and (c is None or c[0] not in PREFILL_CAUSES)]
    causes = {c[0]: c for _, c in named if c is not None}
    if x["decode_reason"] == FAILED_BY_PREFILL:  # the prefill's Failed status: the prefill ranks say why
        if x["prefill"] != "failed" or bad or not causes:
            return "unknown: prefill " + " | ".join(x["prefill_reasons"] or ["(none)"]), False
        return "+".join(sorted(causes)), all(reached(*c) for c in causes.values())
    got = cause_of(x["decode_reason"], room, session, decode_ip)
    if got is None or got[0] != "waiting_timeout":
        return "unknown: " + x["decode_reason"], False
    if bad:
        return "waiting_timeout (prefill: " + " | ".join(bad) + ")", False
    return "waiting_timeout", reached(*got) and all(reached(*c) for c in causes.values())


def judge(r: dict, decode_ip: str) -> dict:
    """Every request's verdict: aborted, served, exposed (to which faults), and for a failure its cause
    and whether the fault that cause belongs to reached this request.

    Exposure: the killed decode's requests (``lost``); a request at the prefill during the cut link or
    the stopped decode (transfer_error, session_not_alive); a request at the prefill while its decode
    session was blacklisted in an explained window (session_not_alive); a request in flight while the
    link was cut, for the decode's waiting timeout (its prefill's status lost on the link), at least
    ``WAITING_S`` after it started.
    """
    w = fault_windows(r)
    blacklisted, _ = explained_blacklists(r)
    out = []
    for x in r["rows"]:
        v = {"room": x["room"], "aborted": bool(x["abort"]), "exposed_to": [], "cause": None, "explained": None}
        at_prefill = (x["start_s"], x["prefill_end_s"])
        if x["decode"] == "lost":
            v["exposed_to"].append("killed")
        for name in ("partition", "stopped"):
            if name in w and _overlaps(*at_prefill, *w[name]):
                v["exposed_to"].append(name)
        if any(b["session"] == x["session"] and _overlaps(*at_prefill, b["begin_s"], b["end_s"]) for b in blacklisted):
            v["exposed_to"].append("blacklisted")
        in_flight_cut = "partition" in w and _overlaps(x["start_s"], x["end_s"], *w["partition"])
        v["served"] = x["decode"] == "success" and bool(x["exact"])
        if x["decode"] == "failed" and not x["abort"]:
            v["cause"], v["explained"] = _failure(x, v["exposed_to"], in_flight_cut, decode_ip)
        out.append(v)
    return {v["room"]: v for v in out}


def served_floor(verdicts: dict) -> int:
    """How many must be served byte-exact: every request neither aborted nor exposed to a fault."""
    return sum(1 for v in verdicts.values() if not v["aborted"] and not v["exposed_to"])


def fault_summary(r: dict, hosts: TwoHosts, rate: str, delay_loss: str, wall_s: float) -> dict:
    """``pd_faults.json``'s figures from one run."""
    rows, p = r["rows"], r["faults"]["partition"]
    down, up = p["down_at_s"], p["up_at_s"]
    verdicts = judge(r, hosts.ip_d)
    outcome = Counter()
    for x in rows:
        if x["decode"] == "success":
            outcome["served_exact" if x["exact"] else "served_corrupt"] += 1
        elif x["decode"] == "lost":
            outcome["failed_decode_killed"] += 1
        elif x["abort"]:
            outcome["failed_client_abort"] += 1
        else:
            cause = verdicts[x["room"]]["cause"]
            outcome["failed_" + (cause if cause.split("+")[0] in CAUSES else "unknown")] += 1
    not_aborted = [v for v in verdicts.values() if not v["aborted"]]
    exposed = Counter(f for v in not_aborted for f in v["exposed_to"])
    spanning = [x for x in rows if x["start_s"] < down < x["prefill_end_s"]]
    # Requests the partition failed: not aborted, not the killed decode's, started before the link came
    # back and failed at the prefill after the cut.
    failed_in_partition = [
        x
        for x in rows
        if x["prefill"] == "failed"
        and not x["abort"]
        and x["decode"] != "lost"
        and x["start_s"] < up
        and down <= x["prefill_end_s"]
    ]
    detect = min((x["prefill_end_s"] - down for x in failed_in_partition), default=None)
    ok = [x["prefill_end_s"] - x["start_s"] for x in rows if x["decode"] == "success"]
    t = r["summary"]
    leaked = 0
    leaked += sum(abs(a - b) for a, b in zip(r["prefill_free_pages"]["start"], r["prefill_free_pages"]["end"]))
    leaked += abs(t["decode_free_pages"]["start"] - t["decode_free_pages"]["end"])
    for e in [*r["prefill_engines"], r["decode_ledger"]["engine"]]:
        leaked += abs(e["regions_at_start"] - e["regions_held_at_end"])
    leaked += sum(sum(v.values()) for v in t["tables_left"]["prefill"]) + sum(t["tables_left"]["decode"].values())
    leaked += len(r["decode_ledger"]["left_active"]) + len(r["decode_ledger"]["left_held"])
    return {
        "summary": {
            "requests_total": len(rows),
            "hung": len(r["stuck"]),
            "leaked": leaked,
            "partition_s": p["seconds"],
            "served_exact": outcome["served_exact"],
            "served_corrupt": outcome["served_corrupt"],
            "failed_by_cause": {k: v for k, v in sorted(outcome.items()) if k.startswith("failed")},
            "failed_unexplained": sum(1 for v in verdicts.values() if v["explained"] is False),
            "not_aborted_exposed_by_fault": dict(sorted(exposed.items())),
            "served_floor": served_floor(verdicts),
            "partition_detected_after_s": None if detect is None else round(detect, 3),
            "transfer_s_p50": _percentile(ok, 0.5),
            "transfer_s_p99": _percentile(ok, 0.99),
            "transfer_s_max_spanning_partition": max(
                (round(x["prefill_end_s"] - x["start_s"], 3) for x in spanning), default=None
            ),
            "max_request_s": max(x["seconds"] for x in rows),
            "wall_s": round(wall_s, 1),
        },
        "link": {"rate_each_way": rate, "delay_loss": delay_loss, "qdiscs": hosts.qdiscs()},
        "partition": {
            **p,
            "requests_spanning_it": len(spanning),
            "blacklisted": r["faults"]["blacklisted"],
            "failed_after_it_went_down": len(failed_in_partition),
        },
        "soak_summary": t,
    }


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> dict:
    """The run across two namespaces; where they cannot be made, the same soak on loopback (reason printed)."""
    hosts = TwoHosts()
    root = tmp_path_factory.mktemp("faults")
    write_model_dirs(root, ["mla", "dsa"])
    cfg = _config(N, root, root / "decode.log")
    # A request the partition fails at the prefill may fail at the decode only by its waiting timeout (the
    # prefill's Failed status can be lost on the cut link): 45 s here. SGLang's probe takes a decode session
    # that failed a transfer back once it answers: every 2 s (at most 10 s) here, 30 s by default.
    cfg.update(requests=REQUESTS, run_timeout_s=120 + 4 * REQUESTS, waiting_timeout_s=WAITING_S)
    cfg["sglang_env"] = {
        "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S": str(PROBE_INTERVAL_S),
        "SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S": str(PROBE_MAX_S),
    }
    try:
        no_netns = hosts.open()
        prefix: tuple[str, ...] = ()
        if no_netns:
            print(f"\n[pd faults] on loopback, without the link faults: {no_netns}")
        else:
            hosts.cap(RATE)
            delay_loss = hosts.delay_loss()
            print(f"\n[pd faults] delay/loss: {delay_loss}")
            cfg.update(
                prefill_ip=hosts.ip_p,
                decode_ip=hosts.ip_d,
                decode_netns=hosts.ns_d,
                partition_link=hosts.if_p,
                partition_at=0.55,
                partition_s=PARTITION_S,
            )
            prefix = ("ip", "netns", "exec", hosts.ns_p)
        t0 = time.monotonic()
        result, _ = run_soak(cfg, root, prefix, name="pd_faults")
        wall_s = time.monotonic() - t0
        result["no_netns"] = no_netns
        result["decode_ip"] = cfg["decode_ip"]
        result["fault_indices"] = {
            k: int(REQUESTS * cfg[k]) for k in ("kill_at", "stop_at", "partition_at") if k in cfg
        }
        if not no_netns:
            result["report"] = fault_summary(result, hosts, RATE, delay_loss, wall_s)
            result["qdiscs"] = hosts.qdiscs()
    finally:
        hosts.close()
    result["namespaces_left"] = [ns for ns in (hosts.ns_p, hosts.ns_d) if ns in _sh("ip", "netns", "list").stdout]
    report = os.environ.get("CP_SHARED_KV_FAULTS_REPORT")
    if report and not no_netns:
        head = {
            "command": os.environ.get("CP_SHARED_KV_FAULTS_COMMAND", ""),
            "commit": _git("rev-parse", "HEAD"),
            # the plugin and these tests as committed, or not (paths changed in the tree that ran)
            "changed_from_commit": _git("status", "--porcelain", "--", "python", "test/srt").splitlines(),
            "date_utc": time.strftime("%Y-%m-%d"),
        }
        Path(report).write_text(json.dumps({**head, **result["report"]}, indent=2) + "\n")
    return result


def _git(*args: str) -> str:
    r = subprocess.run(["git", *args], capture_output=True, text=True, timeout=20, cwd=Path(__file__).parent)
    return r.stdout.strip()


def _namespaced(faults: dict) -> None:
    if faults["no_netns"]:
        pytest.skip(f"no network namespaces here: {faults['no_netns']}")


def test_the_link_was_capped_and_cut_with_requests_in_flight(faults):
    _namespaced(faults)
    q = faults["qdiscs"]
    assert all("tbf" in v for v in q.values()), q
    # The prefill's end carried the KV pages through the cap, which held packets back ("overlimits").
    sent = {k: int(re.search(r"Sent (\d+) bytes", v).group(1)) for k, v in q.items()}
    over = {k: int(re.search(r"overlimits (\d+)", v).group(1)) for k, v in q.items()}
    p_end = next(k for k in q if k.startswith("cpkvp"))
    pages = faults["summary"]["pages"]["total_exact"]
    assert sent[p_end] >= pages * 64 * 576 * 2, (sent, pages)  # at least the latent rows of the served pages
    assert over[p_end] > 0, q
    p = faults["faults"]["partition"]
    assert p["in_flight"] >= 1 and p["up_at_s"] - p["down_at_s"] >= PARTITION_S, p
    assert faults["report"]["partition"]["requests_spanning_it"] >= 1


def test_every_request_concludes_in_bounded_time(faults):
    assert faults["stuck"] == []
    assert faults["requests_finished"] == faults["requests_planned"] == REQUESTS
    # A request waits at most for the partition, the decode's restart and SGLang's waiting timeout (+ 30 s
    # for the router's loop on 2 shared cores).
    bound = PARTITION_S + faults["summary"]["faults"]["killed"]["restart_s"] + WAITING_S + 30
    assert max(x["seconds"] for x in faults["rows"]) <= bound


def test_the_faults_hit_at_their_request_indices_and_windows_were_recorded(faults):
    """Each fault fires at the first step of the router once its request index is reached and its
    condition holds (requests in flight; for the kill, one still sending), never on the wall clock;
    the worker records each window: SIGKILL to the new decode ready, SIGSTOP to SIGCONT, link down to up."""
    f, idx = faults["faults"], faults["fault_indices"]
    for name, key in (("killed", "kill_at"), ("stopped", "stop_at"), ("partition", "partition_at")):
        if key not in idx:
            assert f[name] is None
            continue
        assert f[name] is not None, name
        assert idx[key] <= f[name]["at_request"] < REQUESTS, (name, idx[key], f[name])
        assert f[name]["in_flight"] >= 1 and f[name]["begin_s"] < f[name]["end_s"], (name, f[name])
    # Both ends are recorded to the millisecond: their difference may read up to 1 ms short.
    assert f["stopped"]["end_s"] - f["stopped"]["begin_s"] >= f["stopped"]["seconds"] - 1e-3
    windows = sorted(fault_windows(faults).values())
    assert all(a[1] <= b[0] for a, b in zip(windows, windows[1:])), windows  # they do not overlap


def test_every_success_is_byte_exact(faults):
    ok = [x for x in faults["rows"] if x["decode"] == "success"]
    assert ok and [x["room"] for x in ok if not x["exact"]] == []


def test_every_blacklisted_decode_session_is_explained_by_a_fault(faults):
    """SGLang blacklists a decode session after one failed transfer; only a fault may cause that, and
    the probe takes a live session back within its window once the fault ended."""
    _, bad = explained_blacklists(faults)
    assert bad == [], (bad, fault_windows(faults))


def test_every_failure_is_explained_by_a_fault_that_reached_it(faults):
    """A request not aborted by its client fails only by an exact cause of a fault it was exposed to."""
    verdicts = judge(faults, faults["decode_ip"])
    rows = {x["room"]: x for x in faults["rows"]}
    bad = [
        (v["cause"], v["exposed_to"], rows[r]["start_s"], rows[r]["end_s"], rows[r]["prefill_reasons"])
        for r, v in verdicts.items()
        if v["explained"] is False
    ]
    assert bad == [], (bad, fault_windows(faults), faults["faults"]["blacklisted"])
    failed = [x for x in faults["rows"] if x["decode"] == "failed"]
    assert all(x["decode_reason"] for x in failed), [x for x in failed if not x["decode_reason"]]


def test_every_unexposed_request_is_served_and_at_least_half_are(faults):
    """The served floor is every request neither aborted nor exposed to a fault: each of them served
    byte-exact. The faults reach few requests by construction (at most 4 in flight, 2 s, 10 s), so the
    floor must stay at half the requests or more: a fault that reached more is itself a failure."""
    verdicts = judge(faults, faults["decode_ip"])
    unserved = [
        (r, x["decode"], x["decode_reason"], x["prefill_reasons"], x["start_s"], x["end_s"])
        for x in faults["rows"]
        for r, v in [(x["room"], verdicts[x["room"]])]
        if not v["aborted"] and not v["exposed_to"] and not v["served"]
    ]
    assert unserved == [], (unserved, fault_windows(faults), faults["faults"]["blacklisted"])
    floor = served_floor(verdicts)
    served = sum(1 for v in verdicts.values() if v["served"])
    exposed = Counter(f for v in verdicts.values() if not v["aborted"] for f in v["exposed_to"])
    assert served >= floor >= REQUESTS // 2, (served, floor, exposed)


def test_nothing_leaked(faults):
    if not faults["no_netns"]:
        s = faults["report"]["summary"]
        assert s["hung"] == 0 and s["leaked"] == 0, faults["report"]
    assert faults["stuck"] == []
    assert faults["prefill_free_pages"]["end"] == faults["prefill_free_pages"]["start"]
    ledger = faults["decode_ledger"]
    assert ledger["free_pages_end"] == ledger["free_pages_start"] and ledger["left_active"] == ledger["left_held"] == []
    for rank, t in enumerate(faults["prefill_tables"]):
        assert {k: t[k] for k in PREFILL_TABLES if t[k]} == {}, (rank, t)
    assert {k: v for k, v in ledger["tables"].items() if v} == {}
    for t in faults["prefill_tables"]:
        assert t["poisoned_ack_rooms"] == 0 and t["bounds"]["live"] == t["bounds"]["unclaimed"] == 0, t
        assert t["max_excess_over_in_flight"] <= 0, t
        assert t["decode_registrations"] == sorted(i["session"] for i in faults["incarnations"])
    for e in [*faults["prefill_engines"], faults["decode_ledger"]["engine"]]:
        assert set(e["registration_calls_during_run"].values()) == {0}, e
    assert faults["namespaces_left"] == []
