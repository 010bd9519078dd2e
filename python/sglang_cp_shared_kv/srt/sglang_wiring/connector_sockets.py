"""A KV manager's status sockets that connect once the peer is reachable again.

SGLang 0.5.23's ``CommonKVManager._connect`` makes each peer's ZMQ PUSH socket with ``RECONNECT_IVL = -1``
and watches only ``EVENT_DISCONNECTED``: a socket made while the peer is unreachable (a partition) never
retries and swallows every later status message. ``reconnect_new_sockets`` connects each socket SGLang has
just made again with ZMQ's reconnect on before anything is sent on it, so it delivers once the link is back;
a disconnect still drops the socket as SGLang does. The manager remembers a socket set up, so no later
sender thread drops its connection (and a message queued on it).
"""

from __future__ import annotations

from sglang_cp_shared_kv.srt.sglang_wiring.flag import runtime_enabled
from sglang_cp_shared_kv.srt.sglang_wiring.plugin_state import state_of

RECONNECT_MS = 100


def reconnect_new_sockets(original, mgr, endpoint: str, is_ipv6: bool = False):
    """Wraps ``CommonKVManager._connect``: a socket SGLang made just now reconnects until it is connected."""
    if not runtime_enabled():
        return original(mgr, endpoint, is_ipv6=is_ipv6)
    import zmq

    sock = original(mgr, endpoint, is_ipv6=is_ipv6)
    with mgr._socket_send_locks[endpoint]:  # every send holds it: nothing is queued while it is set up
        ready = state_of(mgr).ready_sockets  # SGLang replaces a disconnected socket with a new object
        if ready.get(endpoint) is not sock:  # made by SGLang just now (connected once, without reconnect)
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
            try:
                sock.disconnect(endpoint)
            except zmq.ZMQError:  # the failed connect is already gone
                pass
            sock.connect(endpoint)
            ready[endpoint] = sock
    return sock
