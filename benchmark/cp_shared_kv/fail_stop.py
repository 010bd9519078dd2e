"""Fail-stop of the copy engines' cross-rank waits, on one GPU (ranks as processes sharing it).

Ranks run extend batches through ``BatchReadState`` with a view arena and no prefetch: each layer's view
is read straight from the owners' pools, one fence per batch orders the pools (``docs/design.md``,
"Transports"). Batch ``r`` reads as prefix the pages its owners wrote in batch ``r - 1`` and writes the
pages batch ``r - 2`` read (requests ended, their pages reused); each batch ends in a host sync, as
SGLang's output processing does.

- ``fence_rank``: rounds where one rank runs 20 ms late, four rounds in turn; every prefix read is compared with the
  bytes its owner wrote. With the fence, every read is exact; without it (the test switches it off), a
  late rank reads pages its peer already rewrote.
- ``trial``: once every rank has run its warm-up batches, one rank is SIGKILLed mid-batch; every other
  rank must fail with the peer-lost line (``peer_watchdog``) within ``$SGLANG_CP_SHARED_KV_PEER_TIMEOUT``,
  and its GPU must still run work.

``python -m benchmark.cp_shared_kv.fail_stop --trials 20`` writes ``fail_stop.json``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import random
import signal
import time
from datetime import timedelta

import torch

PS, ROW, LAYERS = 64, 656, 4
K = 8  # pages per rank in each half of the pool the batches use
PHYS = 2 * K + 2  # physical pages per rank (page 0 the trash page)
LATE_CYCLES = 40_000_000  # about 20 ms of GPU sleep: the late rank of a round
ROUNDS = 40  # batches of a fence run (the first two warm up, the others are compared)
LATE_ROUNDS = 4  # rounds a rank runs late in a row


def _content(round_: int, locs: torch.Tensor) -> torch.Tensor:
    """What a loc's owner writes in round ``round_`` (every rank can recompute it)."""
    base = (round_ * 7 + locs.long() * 13) % 251
    return ((base.unsqueeze(1) + torch.arange(ROW, device=locs.device)) % 256).to(torch.uint8)


class _Ranks:
    """One rank's pool, read state and batch loop."""

    def __init__(self, rank: int, size: int, device: str = "cuda", on_peer_lost=None):
        from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
        from sglang_cp_shared_kv.srt.layers.attention.nsa.read_state import BatchReadState, PageBuffers
        from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

        self.rank, self.size = rank, size
        self.device = torch.device("cpu")
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.ownership = PageOwnership(size, PS, logical_pages=size * PHYS)
        self.pools = [torch.zeros((PHYS, PS * ROW), dtype=torch.uint8, device=self.device) for _ in range(LAYERS)]
        self.state = BatchReadState(
            self.ownership, rank, size * PHYS, PageBuffers(self.ownership, rank, ROW, self.pools), None, CPGroup(),
            on_peer_lost,
        )  # fmt: skip
        self.state.attach_arena(size * K * PS, size * K * PS, prefetch=False)
        # Logical pages [N, N + NK) and [N + NK, N + 2NK): the two halves batches alternate between.
        self.halves = [torch.arange(size + h * size * K, size + (h + 1) * size * K) for h in range(2)]

    def batch(self, r: int, late: bool = False) -> list[torch.Tensor]:
        """Round ``r``: read half ``(r - 1) % 2`` as prefix, write half ``r % 2``; returns the prefix reads."""
        from sglang_cp_shared_kv.srt.layers.attention.nsa.read_state import BatchInputs

        prefix, chunk = (self.halves[(r - 1) % 2], self.halves[r % 2]) if r else (self.halves[1][:0], self.halves[0])
        locs = pages_to_locs(torch.cat([prefix, chunk]))
        table = locs.int().view(1, -1).to(self.device, non_blocking=True)
        rows = torch.zeros(1, dtype=torch.int64, device=self.device)
        n_prefix = len(prefix) * PS
        self.state.begin(BatchInputs(table, rows, (n_prefix,), (len(locs),)))
        prefix_locs = locs[:n_prefix].int().to(self.device, non_blocking=True)
        store, mine = self.ownership.store_rows(locs[n_prefix:], self.rank, 0)  # host tensors: no sync
        owned = _content(r, locs[n_prefix:][mine]).to(self.device, non_blocking=True)
        store = store[mine].to(self.device, non_blocking=True)
        reads = []
        for layer in range(LAYERS):
            self.state.stage(layer)  # the write path's first call: the batch's fence and plan go first
            if late and layer == 0 and self.device.type == "cuda":
                torch.cuda._sleep(LATE_CYCLES)
            if n_prefix:
                reads.append(self.state.latent_rows(layer)[self.state.translate(prefix_locs)].clone())
            self.pools[layer].view(-1, ROW)[store] = owned
        self.state.end()
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # sync-ok: the batch's outputs, as SGLang reads them
        return reads


def fence_rank(rank: int, size: int, fence_on: bool, rounds: int = ROUNDS, device: str = "cuda") -> dict:
    """``rounds`` batches, rank ``(r // LATE_ROUNDS) % size`` late in round ``r``; the rounds whose prefix
    reads were wrong. ``mapped``: whether the views were read from the peers' pools (else all-gathered by the
    CP group)."""
    ranks = _Ranks(rank, size, device)
    ranks.batch(0)
    ranks.batch(1)  # the copy engines' group and the pools' mapping are made here
    group = ranks.state.views.group
    if not fence_on:  # the test's switch: the fence's companion launch alone
        group.fence = lambda stream=None, then=None: then() if then is not None else None
    # Each rank late for four rounds in turn: without the fence the others run a batch ahead at once.
    reads = [(r, ranks.batch(r, late=(r // LATE_ROUNDS) % size == rank)) for r in range(2, rounds)]
    wrong = []
    for r, layers in reads:
        prefix = ranks.halves[(r - 1) % 2]
        locs = pages_to_locs(prefix).to(ranks.device)
        if not all(torch.equal(got, _content(r - 1, locs)) for got in layers):
            wrong.append(r)
    mapped = getattr(group, "source_table", None) is not None
    return {"mapped": mapped, "wrong_rounds": wrong, "fences": getattr(group, "fences", 0)}


def pages_to_locs(pages: torch.Tensor) -> torch.Tensor:
    """Every token loc of ``pages`` (int64, on the host)."""
    return pages.repeat_interleave(PS) * PS + torch.arange(PS).repeat(len(pages))


FENCE_STEPS = {1: "signalling the peers", 2: "at its waits", 4: "past its fence"}  # what a fence writes when


def _mark_fence_progress(progress: torch.Tensor) -> None:
    """Make every fence write its step into ``progress[0]`` (pinned host memory the device writes by address):
    where a hung stream stands, read without a CUDA call."""
    from sglang_cp_shared_kv.srt.distributed import copy_engine

    fence_calls = copy_engine.CopyEngineGroup._fence_calls

    def marked(self, stream: int, q: int) -> None:
        d, at = self._driver, progress.data_ptr()
        d.write64(stream, at, 10 * q + 1)
        original_wait, seen = d.wait64, []

        def wait64(*a):  # the first wait: every signal to the peers is queued before it
            if not seen:
                seen.append(1)
                d.write64(stream, at, 10 * q + 2)
            return original_wait(*a)

        d.wait64 = wait64
        try:
            fence_calls(self, stream, q)
        finally:
            d.wait64 = original_wait
        d.write64(stream, at, 10 * q + 4)

    copy_engine.CopyEngineGroup._fence_calls = marked


def _report_stuck(rank: int, ranks: _Ranks, progress, lost: dict, after_s: float) -> None:
    """``after_s`` seconds after the peer-lost line, print where this rank's stream and threads stand."""
    import faulthandler
    import sys

    while "at" not in lost:
        time.sleep(0.05)
    time.sleep(after_s)
    group = ranks.state.views.group
    step = int(progress[0])
    waits = [(what, done()) for _, done, what in list(group.watchdog._waits)]
    print(
        f"rank {rank}, {after_s:g} s after the line: fence {group.fences} at step {step % 10} "
        f"({FENCE_STEPS.get(step % 10, 'none')}, parity {step // 10}); watched waits {waits}",
        file=sys.stderr,
        flush=True,
    )
    faulthandler.dump_traceback(file=sys.stderr)


def _trial_rank(rank: int, size: int, port: int, reports: mp.Queue, deadline_s: float, device: str) -> None:
    """A rank of a kill trial: warm up, say so, then run batches until a peer is lost. Reported: the peer-lost
    line when the watchdog gives it (the server stops there, ``stop_server``), then how the batch loop ended
    and whether the GPU still runs work. Where the loop has not ended 2 s after the line, the rank prints
    where its stream and threads stand (stderr)."""
    import threading

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    from sglang_cp_shared_kv.srt.distributed.peer_watchdog import PeerLost

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))  # fmt: skip
    lost: dict = {}

    def on_peer_lost(line: str) -> None:
        lost["at"] = time.time()
        reports.put(("line", rank, lost["at"], line))

    progress = None
    if device == "cuda":
        progress = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        _mark_fence_progress(progress)
    ranks = _Ranks(rank, size, device, on_peer_lost)
    r = 0
    for r in range(4):
        ranks.batch(r)
    reports.put(("ready", rank, time.time(), None))
    if progress is not None:
        for after in (2.0, 10.0):
            threading.Thread(target=_report_stuck, args=(rank, ranks, progress, lost, after), daemon=True).start()
    end = time.monotonic() + deadline_s + 60
    kind, line = "no failure", None
    try:
        while time.monotonic() < end:
            r += 1
            ranks.batch(r)
    except PeerLost as e:
        kind, line = "lost", str(e)
    except Exception as e:  # any other way out is reported as it is
        kind, line = type(e).__name__, str(e)
    at = time.time()
    try:  # the GPU still runs work once the waits are released
        usable = torch.ones(4, device=ranks.device).sum().item() == 4
    except Exception:
        usable = False
    reports.put((kind, rank, at, (line, usable, r)))
    reports.close()
    reports.join_thread()
    os._exit(0)  # the gloo group's teardown would wait for the dead peer


def trial(size: int, victim: int, seed: int, deadline_s: float, device: str = "cuda", how=signal.SIGKILL) -> dict:
    """Spawn ``size`` ranks, stop ``victim`` mid-batch (``how``: SIGKILL; SIGSTOP keeps its GPU context), and
    collect the survivors' reports (on CPU the views go over gloo, whose collectives fail at once when a peer's
    connection drops)."""
    from reference.spawn import free_port

    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_trial_rank, args=(r, size, port, reports, deadline_s, device), daemon=True)
        for r in range(size)
    ]
    for p in procs:
        p.start()
    ready, got = set(), {}
    limit = time.monotonic() + 180
    try:
        while len(ready) < size and time.monotonic() < limit:
            try:
                kind, rank, _, detail = reports.get(timeout=1)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            if kind == "ready":
                ready.add(rank)
            else:
                got[rank] = (kind, detail)
        if len(ready) < size:
            return {"seed": seed, "error": f"ranks ready: {sorted(ready)}, reports: {got}"}
        time.sleep(random.Random(seed).uniform(0.0, 0.2))  # somewhere inside a batch
        os.kill(procs[victim].pid, how)
        killed_at = time.time()
        survivors = [r for r in range(size) if r != victim]
        wait_until = time.monotonic() + deadline_s + 30
        seen: dict[int, dict] = {r: {"kind": "hang"} for r in survivors}
        while any("gpu_usable" not in seen[r] for r in survivors) and time.monotonic() < wait_until:
            try:
                kind, rank, at, detail = reports.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "line":
                seen[rank].update(line=detail, line_seconds=round(at - killed_at, 3))
            elif kind != "ready":
                seen[rank].update(kind=kind, seconds=round(at - killed_at, 3), raised=detail[0],
                                  gpu_usable=detail[1], batches=detail[2])  # fmt: skip
        return {"seed": seed, "victim": victim, "survivors": {str(r): seen[r] for r in survivors}}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    from benchmark.cp_shared_kv.bench_common import write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--cp-size", type=int, default=2)
    ap.add_argument("--kills-only", action="store_true", help="the kill trials without the fence runs")
    ap.add_argument("--sigstop", action="store_true", help="stop the victim with SIGSTOP instead of SIGKILL")
    args = ap.parse_args(argv)
    os.environ.setdefault("SGLANG_CP_SHARED_KV_PEER_TIMEOUT", "5")
    deadline = float(os.environ["SGLANG_CP_SHARED_KV_PEER_TIMEOUT"])
    from reference.spawn import spawn_ranks

    # The fence on and switched off, the same batches: the rounds whose prefix reads were wrong, per rank.
    fence = {}
    if not args.kills_only:
        fence = {
            "on" if on else "off": spawn_ranks(fence_rank, args.cp_size, on, timeout_s=300) for on in (True, False)
        }
        print(fence, flush=True)
    rows, how = [], signal.SIGSTOP if args.sigstop else signal.SIGKILL
    for t in range(args.trials):
        row = trial(args.cp_size, victim=t % args.cp_size, seed=t, deadline_s=deadline, how=how)
        print(row, flush=True)
        rows.append(row)
    outcomes = [s for row in rows for s in row.get("survivors", {}).values()]
    summary = {
        "kill_trials": len(rows),
        # A survivor that neither gave the peer-lost line nor left its batch loop (or a trial that never started).
        "kill_hangs": sum("line" not in s and s["kind"] == "hang" for s in outcomes) + sum("error" in r for r in rows),
        "kill_max_seconds": max((s.get("line_seconds", s.get("seconds", 0)) for s in outcomes), default=None),
        "deadline_s": deadline,
        # Survivors whose batch loop ended with PeerLost (their stream released), and whose GPU then ran work.
        "kill_loops_ended": sum(s["kind"] == "lost" for s in outcomes),
        "kill_other_errors": sum(s["kind"] not in ("lost", "hang") for s in outcomes),
        "gpu_usable_after": bool(outcomes) and all(s.get("gpu_usable") for s in outcomes),
        "cp_size": args.cp_size,
    }
    if fence:
        summary.update(
            fence_on_wrong_rounds=sum(len(r["wrong_rounds"]) for r in fence["on"]),
            fence_off_wrong_rounds=sum(len(r["wrong_rounds"]) for r in fence["off"]),
            fence_rounds_per_rank=ROUNDS - 2,
        )
    write_result("fail_stop", rows, summary, {"fence": fence})
    print(summary)
    ok = summary["kill_hangs"] == 0 and summary["kill_other_errors"] == 0 and not summary.get("fence_on_wrong_rounds")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
