"""The server's fail-stop when a CP peer is lost (``sharded_kv_pool.stop_server``, what the pools hand the
peer watchdog when SGLang gives them their ranks): SIGQUIT to the parent, as a crashed scheduler sends it,
then a grace before the watchdog may release this rank's waits."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

pytestmark = pytest.mark.sglang

CHILD = """
import time
from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import stop_server
start = time.monotonic()
stop_server("--enable-cp-shared-kv: CP peer lost: rank 1 did not reach this rank's fence 3 within 60 s")
print(f"returned after {time.monotonic() - start:.1f} s")
"""


def test_a_lost_peer_sends_sigquit_to_the_parent_and_holds_the_waits_for_a_grace():
    quit_received = threading.Event()
    previous = signal.signal(signal.SIGQUIT, lambda signum, frame: quit_received.set())
    try:
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    finally:
        signal.signal(signal.SIGQUIT, previous)
    assert out.returncode == 0, out.stderr[-2000:]
    assert quit_received.is_set()
    seconds = float(out.stdout.split("returned after ")[1].split(" s")[0])
    assert seconds >= 5.0, out.stdout


def test_pools_given_their_ranks_by_sglang_stop_the_server_and_pools_given_ranks_raise(monkeypatch):
    import torch
    from sglang.srt import runtime_context

    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedMLATokenToKVPool, stop_server

    real = runtime_context.get_parallel()

    class Parallel:
        """SGLang's parallel context as a rank of a CP 2 group sees it (no DCP); the rest as it is."""

        attn_cp_rank, attn_cp_size, attn_dcp_rank, attn_dcp_size, dcp_enabled = 1, 2, 0, 1, False

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(runtime_context, "get_parallel", Parallel)
    kwargs = dict(page_size=64, dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=1,
                  device="cpu", enable_memory_saver=False)  # fmt: skip
    with real.override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):  # SGLang's pool reads these
        served = CPSharedMLATokenToKVPool(4 * 64, **kwargs)
        handed = CPSharedMLATokenToKVPool(4 * 64, cp_rank=1, cp_size=2, **kwargs)
    assert served.read.on_peer_lost is stop_server and (served.spec.cp_rank, served.spec.cp_size) == (1, 2)
    assert handed.read.on_peer_lost is None
