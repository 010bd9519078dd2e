"""A prefill's status socket made while the decode is unreachable: delivered once the link is back.

Two network namespaces joined by a veth pair (``test_pd_faults.TwoHosts``; skipped with the reason
where they cannot be made). In the prefill's namespace a worker loads the plugin and builds SGLang's
``MooncakeKVManager`` (prefill mode); with its end of the link down it sends a status message through
SGLang's ``_send_multipart_locked`` to each of two ZMQ PULL sockets in the decode's namespace (SGLang's
``_connect`` makes each PUSH socket then, and its connect fails): the first with the flag off (SGLang
as is), the second with it on (``connector_sockets``). The link comes back and one more message
follows on each cached socket, each with its flag as before. SGLang alone delivers neither; with the plugin both arrive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.sglang]

HERE = os.path.dirname(os.path.abspath(__file__))
PORT = 45_731


def _worker(mla_dir: str, link: str, host: str, endpoints: list[str]) -> None:
    """With the link down, one message to each endpoint (flag off, then on); the link up; one more each."""
    import types

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    sys.path.insert(0, HERE)
    from test_plugin_decode_manifest import _manager

    argv = ["--model-path", mla_dir, "--device", "cpu", "--skip-tokenizer-init", "--disaggregation-mode", "decode"]
    argv += ["--disaggregation-transfer-backend", "mooncake", "--enable-cp-shared-kv"]
    args = prepare_server_args(argv)
    args.resolve_once()
    kv_args = types.SimpleNamespace(kv_item_lens=[1], state_item_lens=[[1]])
    mgr = _manager(DisaggregationMode.PREFILL, None, kv_args, 0, 1, host)
    subprocess.run(["ip", "link", "set", "dev", link, "down"], check=True, timeout=10)
    time.sleep(0.3)
    for flag, endpoint in zip((False, True), endpoints):
        args.__dict__["enable_cp_shared_kv"] = flag
        publish(args, role="scheduler")
        mgr._send_multipart_locked(endpoint, [b"during"])  # SGLang makes the socket now; its connect fails
    time.sleep(1.0)
    subprocess.run(["ip", "link", "set", "dev", link, "up"], check=True, timeout=10)
    time.sleep(2.0)
    for flag, endpoint in zip((False, True), endpoints):
        args.__dict__["enable_cp_shared_kv"] = flag
        publish(args, role="scheduler")
        mgr._send_multipart_locked(endpoint, [b"after"])  # the same cached socket
    time.sleep(2.0)
    print("SENT", flush=True)
    os._exit(0)


def _race(mla_dir: str) -> None:
    """Two sender threads reach a new endpoint together: thread B enters ``_connect`` before thread A makes
    the socket, and SGLang hands B the socket A made and sent on. Prints what a PULL socket received."""
    import types

    import zmq
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    sys.path.insert(0, HERE)
    from test_plugin_decode_manifest import _manager

    from sglang_cp_shared_kv.srt.sglang_wiring.connector_sockets import reconnect_new_sockets

    argv = ["--model-path", mla_dir, "--device", "cpu", "--skip-tokenizer-init", "--disaggregation-mode", "decode"]
    args = prepare_server_args(argv + ["--disaggregation-transfer-backend", "mooncake", "--enable-cp-shared-kv"])
    args.resolve_once()
    publish(args, role="scheduler")
    mgr = _manager(
        DisaggregationMode.PREFILL, None, types.SimpleNamespace(kv_item_lens=[1], state_item_lens=[[1]]), 0, 1
    )
    pull = zmq.Context().socket(zmq.PULL)
    endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"

    def a_then_sglang(m, ep, is_ipv6=False):  # thread A's whole send lands between B's entry and SGLang's call
        m._send_multipart_locked(ep, [b"A"])
        return CommonKVManager._connect.__wrapped__(m, ep, is_ipv6=is_ipv6)

    sock = reconnect_new_sockets(a_then_sglang, mgr, endpoint)  # thread B
    with mgr._socket_send_locks[endpoint]:
        sock.send_multipart([b"B"])
    got = []
    while pull.poll(2000):
        got.append(pull.recv().decode())
    print("GOT" + json.dumps(got), flush=True)
    os._exit(0)


def _receiver(endpoints: list[str], timeout_s: float) -> None:
    import zmq

    ctx = zmq.Context()
    poller = zmq.Poller()
    socks = {}
    for endpoint in endpoints:
        pull = ctx.socket(zmq.PULL)
        pull.bind(endpoint)
        poller.register(pull, zmq.POLLIN)
        socks[pull] = endpoint
    print("READY", flush=True)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for sock, _ in poller.poll(200):
            print("GOT" + json.dumps([socks[sock], sock.recv().decode()]), flush=True)
    os._exit(0)


@pytest.fixture(scope="module")
def delivered(tmp_path_factory) -> dict:
    """What arrived on each endpoint: the first made with the flag off (SGLang as is), the second with it on."""
    from plugin_models import write_model_dirs
    from test_pd_faults import TwoHosts

    root = tmp_path_factory.mktemp("sockets")
    write_model_dirs(root, ["mla"])
    env = {**os.environ, "SGLANG_PLUGINS": "cp_shared_kv"}
    hosts = TwoHosts()
    try:
        why = hosts.open()
        if why:
            pytest.skip(why)
        endpoints = [f"tcp://{hosts.ip_d}:{PORT}", f"tcp://{hosts.ip_d}:{PORT + 1}"]
        recv = subprocess.Popen(
            ["ip", "netns", "exec", hosts.ns_d, sys.executable, __file__, "receiver", json.dumps(endpoints)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert recv.stdout.readline().strip() == "READY"
        argv = ["worker", str(root / "mla"), hosts.if_p, hosts.ip_p, json.dumps(endpoints)]
        worker = subprocess.run(
            ["ip", "netns", "exec", hosts.ns_p, sys.executable, __file__, *argv],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
        assert "SENT" in worker.stdout, worker.stderr[-3000:]
        recv.kill()  # it has had the worker's whole run to receive
        lines = recv.communicate(timeout=30)[0]
    finally:
        hosts.close()
    got = [json.loads(x[3:]) for x in (lines or "").splitlines() if x.startswith("GOT")]
    return {flag: [msg for ep, msg in got if ep == endpoint] for flag, endpoint in zip((False, True), endpoints)}


def test_sglang_alone_never_delivers_on_a_socket_made_during_a_partition(delivered):
    assert delivered[False] == []


def test_the_plugin_delivers_what_was_sent_during_and_after_it(delivered):
    assert delivered[True] == ["during", "after"]


def test_two_threads_reaching_a_new_endpoint_together_both_deliver(tmp_path):
    """The socket is set up once, by whichever thread takes its send lock first: the other thread's
    message, already queued on it, is not dropped by a second reconnect."""
    from plugin_models import write_model_dirs

    write_model_dirs(tmp_path, ["mla"])
    env = {**os.environ, "SGLANG_PLUGINS": "cp_shared_kv"}
    run = subprocess.run(
        [sys.executable, __file__, "race", str(tmp_path / "mla")], capture_output=True, text=True, timeout=240, env=env
    )
    got = [json.loads(x[3:]) for x in run.stdout.splitlines() if x.startswith("GOT")]
    assert got == [["A", "B"]], run.stderr[-3000:]


if __name__ == "__main__":
    if sys.argv[1] == "race":
        _race(sys.argv[2])
    elif sys.argv[1] == "worker":
        _worker(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5]))
    else:
        _receiver(json.loads(sys.argv[2]), 300)
