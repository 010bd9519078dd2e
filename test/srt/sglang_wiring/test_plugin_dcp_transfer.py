"""PD from prefill CP ranks to a decode whose pool is sharded by page ownership over its own ranks, through
SGLang's Mooncake connector (real engine, TCP on 127.0.0.1) with the plugin loaded.

Two prefill CP ranks (CP-shared DSA pools built by the plugin's configurator hooks, SGLang's bootstrap
thread and transfer worker) serve two decodes: one of 2 ranks and one of 3, each rank a decode
``MooncakeKVManager`` registering SGLang's ``dst_dcp_size`` / ``dst_dcp_rank`` over a
``CPSharedDSATokenToKVPool`` of its rank, its destination pages drawn by SGLang's owner-rotating
allocator. Every request's latent and indexer pages must land whole on the decode rank that owns their
destination page, at its physical page, equal to the replicated pool's, and nothing else may be written;
every decode rank checks the prefill ranks' manifests and marks the request ready.

The managers are built as in ``test_plugin_decode_manifest.py`` (``demo.sglang_parts.mooncake_manager``).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from plugin_models import run_worker, write_model_dirs

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]

PS = 64
N = 2  # prefill CP ranks
DECODE_SIZES = (2, 3)
LENGTHS = [9 * PS - 5, 5 * PS, 3 * PS - 20, PS - 3]  # tokens per request


def _group(prefill_mgr, size: int) -> list:
    """The registrations a prefill manager holds from the decode ranks of a group of ``size``."""
    return [i for i in prefill_mgr.decode_kv_args_table.values() if i.dst_dcp_size == size]


def _worker(model_dir: str) -> None:
    import concurrent.futures
    import threading

    import numpy as np
    import torch

    os.environ["MC_FORCE_TCP"] = "1"
    os.environ["MOONCAKE_PROTOCOL"] = "tcp"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.disaggregation.mooncake.conn import FastQueue, MooncakeKVReceiver, MooncakeKVSender
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from test_plugin_decode_manifest import _build_pools, _deadline_wait, _fill

    from demo.sglang_parts import kv_args, mooncake_manager, prefill_info, sharded_dsa_pools

    _server_args, ranks, allocator, replicated, _ = _build_pools(model_dir)  # publishes a flagged prefill
    pages = _fill(ranks, replicated, allocator, LENGTHS)
    executor = concurrent.futures.ThreadPoolExecutor(2)
    p_mgrs = []
    for rank, pool in enumerate(ranks):
        engine = MooncakeTransferEngine("127.0.0.1")
        aux = torch.full((8, 64), 100 + rank, dtype=torch.uint8)
        for buf in [*pool.kv_buffer, *pool.index_k_with_scale_buffer, aux]:
            engine.register(buf.data_ptr(), buf.nbytes)
        m = mooncake_manager(DisaggregationMode.PREFILL, engine, kv_args(pool, aux, rank, PS), rank, N)
        m.transfer_queues = [FastQueue()]
        m.start_prefill_thread()
        threading.Thread(target=m.transfer_worker, args=(m.transfer_queues[0], executor), daemon=True).start()
        p_mgrs.append(m)
    addr = "127.0.0.1:1"
    out: dict = {}
    room = 1000
    for size in DECODE_SIZES:
        tokens = (sum(-(-n // PS) for n in LENGTHS) // size + 3) * PS
        pools = sharded_dsa_pools(tokens, PS, size)
        before = [[buf.clone() for buf in [*p.kv_buffer, *p.index_k_with_scale_buffer]] for p in pools]
        d_alloc = PageInterleavePoolAllocator(tokens, PS, size, torch.int64, "cpu", pools[0], False)
        d_mgrs = []
        for d, pool in enumerate(pools):
            engine = MooncakeTransferEngine("127.0.0.1")
            aux = torch.zeros(8, 64, dtype=torch.uint8)
            for buf in [*pool.kv_buffer, *pool.index_k_with_scale_buffer, aux]:
                engine.register(buf.data_ptr(), buf.nbytes)
            m = mooncake_manager(DisaggregationMode.DECODE, engine, kv_args(pool, aux, d, PS), d, 1)
            # A decode rank of a DCP group of ``size`` (SGLang's fields; its attention TP spans the group).
            m.dcp_size, m.dcp_rank, m.attn_tp_size, m.attn_tp_rank = size, d, size, d
            m.start_decode_thread()
            rank_info = prefill_info(N, PS)
            m._resolve_rank_mapping(rank_info)
            m.prefill_info_table[addr] = rank_info
            for cp in rank_info.target_cp_ranks:
                m.connection_pool[f"{addr}_0_{cp}_{rank_info.target_tp_rank}"] = [
                    {"rank_ip": "127.0.0.1", "rank_port": p_mgrs[cp].rank_port, "is_dummy": False}
                ]
            d_mgrs.append(m)
        run: dict = {"required_dst_info": [m.prefill_info_table[addr].required_dst_info_num for m in d_mgrs]}
        t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
        requests = []
        for idx, (n, lp) in enumerate(zip(LENGTHS, pages)):
            room += 1
            locs = d_alloc.alloc_extend(t(0), t(0), t(n), t(n), t(0), n, rotation_bases=[None]).long()
            dst = (locs[::PS] // PS).numpy().astype(np.int32)
            senders = [MooncakeKVSender(m, addr, room) for m in p_mgrs]
            for snd in senders:
                snd.init(len(lp), aux_index=idx % 8)
            receivers = []
            for m in d_mgrs:
                rcv = MooncakeKVReceiver(m, addr, room)
                rcv.init(0)
                if idx == 0:
                    assert rcv._register_kv_args()  # each decode rank registers once, as SGLang's does
                receivers.append(rcv)
            if idx == 0:
                _deadline_wait(lambda n=size: all(len(_group(p, n)) == n for p in p_mgrs), "registration")
            for rcv in receivers:
                rcv.send_metadata(dst, idx % 8, [dst.copy()], 0)
            _deadline_wait(lambda s=senders: all(x.poll() == KVPoll.WaitingForInput for x in s), "destinations")
            cut = len(lp) // 2
            for rank, snd in enumerate(senders):  # two chunks per rank, as chunked prefill sends them
                snd.send(lp[:cut])
                snd.send(lp[cut:], [lp.copy()])
                _deadline_wait(lambda s=snd: s.poll() == KVPoll.Success, f"room {room}: rank {rank} sent")
            polls, errors = [], []
            for rcv in receivers:
                _deadline_wait(lambda r=rcv: r.poll() in (KVPoll.Success, KVPoll.Failed), f"room {room}: verdict")
                polls.append(int(rcv.poll()))
                if rcv.poll() == KVPoll.Failed:
                    try:
                        rcv.failure_exception()
                    except KVTransferError as e:
                        errors.append(e.failure_reason)
            requests.append({"polls": polls, "errors": errors, "lp": lp.tolist(), "dst": dst.tolist()})
        # Every decode rank: its buffers as before, but for the pages it owns, each equal to the replicated page.
        exact, received = [], [0] * size
        for d, pool in enumerate(pools):
            want = [buf.clone() for buf in before[d]]
            layers = len(pool.kv_buffer)
            for req in requests:
                for lp, dl in zip(req["lp"], req["dst"]):
                    if dl % size != d:
                        continue
                    phys = dl // size
                    received[d] += 1
                    for layer in range(layers):
                        want[layer][phys * PS : (phys + 1) * PS] = replicated.kv_buffer[layer][lp * PS : (lp + 1) * PS]
                        want[layers + layer][phys] = replicated.index_k_with_scale_buffer[layer][lp]
            got = [*pool.kv_buffer, *pool.index_k_with_scale_buffer]
            exact.append(all(torch.equal(a, b) for a, b in zip(got, want)))
        run.update(
            exact=exact,
            received=received,
            pages=sum(len(p) for p in pages),
            polls=[r["polls"] for r in requests],
            errors=[e for r in requests for e in r["errors"]],
            relayout=[bool(i.requires_dcp_relayout) for p in p_mgrs for i in _group(p, size)],
            owners_per_request=[sorted({dl % size for dl in r["dst"]}) for r in requests],
        )
        out[str(size)] = run
    print("RESULT:" + json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # SGLang's connector threads block on their sockets forever


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    write_model_dirs(root, ["mla", "dsa"])
    env = {**os.environ, "SGLANG_PLUGINS": "cp_shared_kv", "TRITON_INTERPRET": "1", "MC_LOG_LEVEL": "WARNING"}
    return run_worker([__file__, str(root)], env, 300)


SUCCESS = 4


@pytest.mark.parametrize("size", DECODE_SIZES)
def test_each_page_lands_whole_on_its_decode_owner_and_nothing_else_is_written(results, size):
    run = results[str(size)]
    assert run["errors"] == [] and all(p == [SUCCESS] * size for p in run["polls"]), run
    assert all(run["exact"]), run
    assert sum(run["received"]) == run["pages"] and all(run["received"]), run
    assert any(len(owners) > 1 for owners in run["owners_per_request"]), "requests must span decode ranks"


@pytest.mark.parametrize("size", DECODE_SIZES)
def test_each_decode_rank_waits_for_its_group_and_takes_no_token_relayout(results, size):
    run = results[str(size)]
    assert run["required_dst_info"] == [size] * size
    assert run["relayout"] == [False] * (N * size)


if __name__ == "__main__":
    _worker(sys.argv[1])
