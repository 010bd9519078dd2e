"""A status socket whose first connect fails delivers once its peer listens.

``CommonKVManager._connect`` makes one PUSH socket per peer endpoint and caches it.
Made while the peer cannot be reached (not listening yet, or a network partition),
its connect fails; with ``RECONNECT_IVL = -1`` ZMQ never retries it, no disconnect is
ever reported, and the cached socket drops every status message sent on it for good.
With a reconnect interval it connects once the peer is there and delivers what was
queued.
"""

import socket
import threading
import time
import types
import unittest

import zmq

from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")


def _free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _manager(ctx: zmq.Context) -> types.SimpleNamespace:
    """The state ``_connect`` and ``_send_multipart_locked`` use, without a transfer
    engine."""
    mgr = types.SimpleNamespace(
        _socket_lock=threading.Lock(),
        _socket_cache={},
        _monitor_cache={},
        _socket_send_locks={},
        _zmq_ctx=ctx,
        defer_decode_allocation=False,
    )
    mgr._connect = types.MethodType(CommonKVManager._connect, mgr)
    return mgr


class TestStatusSocketReconnect(CustomTestCase):
    def test_socket_made_before_its_peer_listens_delivers(self):
        ctx = zmq.Context()
        try:
            endpoint = _free_endpoint()
            mgr = _manager(ctx)
            # Nobody listens: the socket is made and cached now, and its connect fails.
            CommonKVManager._send_multipart_locked(mgr, endpoint, [b"early"])
            time.sleep(0.5)  # ZMQ's I/O thread tries the connect, and it fails
            pull = ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            pull.bind(endpoint)
            CommonKVManager._send_multipart_locked(mgr, endpoint, [b"late"])
            got = []
            while len(got) < 2 and pull.poll(5000):
                got.append(pull.recv_multipart())
            self.assertEqual(got, [[b"early"], [b"late"]])
        finally:
            ctx.destroy(linger=0)


if __name__ == "__main__":
    unittest.main()
