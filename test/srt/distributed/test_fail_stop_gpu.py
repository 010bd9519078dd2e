"""The fence and the peer watchdog where they live: batches through ``BatchReadState`` whose views are read
straight from the peers' pools (one GPU is enough: ranks as processes sharing it), pages freed and
reused batch after batch, one rank 20 ms late, four rounds in turn (``benchmark/cp_shared_kv/fail_stop.py``).

- With the fence every prefix read is exact; with it switched off the same run reads rewritten pages.
- A rank SIGKILLed mid-batch: every other rank fails with the peer-lost line within the deadline and
  its GPU still runs work.
On CPU the same batches over gloo read exact bytes (the harness itself), and a killed rank's peer fails
at its next collective."""

from __future__ import annotations

import os

import pytest
import torch
from benchmark.cp_shared_kv.fail_stop import ROUNDS, fence_rank, trial

from reference.spawn import spawn_ranks

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.multirank
def test_batches_that_reuse_pages_read_exact_bytes_on_gloo_ranks():
    for res in spawn_ranks(fence_rank, 2, True, 8, "cpu", timeout_s=200):
        assert res == {"mapped": False, "wrong_rounds": [], "fences": 0}, res


@pytest.mark.multirank
def test_a_rank_killed_mid_batch_on_gloo_fails_the_other_at_once():
    res = trial(2, 1, seed=3, deadline_s=3.0, device="cpu")
    survivor = res["survivors"]["0"]
    assert survivor["kind"] == "RuntimeError" and survivor["seconds"] < 3.0, res
    assert survivor["gpu_usable"] and survivor["batches"] >= 4, res


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("size", [2, 3])
def test_the_fence_keeps_every_read_exact_with_a_rank_running_late(size):
    for res in spawn_ranks(fence_rank, size, True, timeout_s=300):
        # One fence per batch that reads a prefix: every batch but the first.
        assert res["mapped"] and res["wrong_rounds"] == [] and res["fences"] == ROUNDS - 1, res


@pytest.mark.gpu
@needs_cuda
def test_without_the_fence_a_late_rank_reads_pages_already_rewritten():
    results = spawn_ranks(fence_rank, 2, False, timeout_s=300)
    assert all(res["mapped"] for res in results), results
    assert sum(len(res["wrong_rounds"]) for res in results) > 0, results


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_mid_batch_fails_the_other_with_one_line_within_the_deadline(victim, monkeypatch):
    monkeypatch.setenv("SGLANG_CP_SHARED_KV_PEER_TIMEOUT", "3")
    res = trial(2, victim, seed=victim, deadline_s=3.0)
    (survivor,) = res["survivors"].values()
    assert survivor.get("line", "").startswith(f"--enable-cp-shared-kv: CP peer lost: rank {victim} did not reach"), res
    assert survivor["line_seconds"] < 3.0 + 2.0, res
    # Its batch loop then ends with the same line, and its GPU still runs work.
    assert survivor["kind"] == "lost" and survivor["raised"] == survivor["line"] and survivor["gpu_usable"], res
    assert os.environ["SGLANG_CP_SHARED_KV_PEER_TIMEOUT"] == "3"
