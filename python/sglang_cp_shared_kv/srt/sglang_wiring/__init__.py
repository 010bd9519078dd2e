"""Wiring of the CP-shared KV cache into SGLang 0.5.23: everything ``plugin.load`` installs.

- ``hooks``: the only module that knows about wrapping: the flag on SGLang's server args, and every hook
  that adapts an SGLang target to the plain functions of the modules below.
- ``startup_checks``: the flag's rules, run where SGLang resolves its arguments.
- ``pool_hooks``: SGLang's MLA/DSA pools replaced by ``sharded_kv_pool``'s subclasses and its allocator
  widened by N (SGLang's owner-rotating allocator); each extend batch's request ids and shared-prefix hint
  (from the scheduler's radix tree) handed to the pool's read state.
- ``view_arena``: the read buffer's size, charged to the KV budget, and SGLang's batch admission held to it.
- ``sharded_kv_pool`` (with ``layers.attention.nsa.read_state``): the masked write path and the kv-shard
  read contract (current-reuse / materialized view) that SGLang's DSA backend, indexer and FA3 call.
- ``transfer``: SGLang's Mooncake sender in sharded mode (owned pages at their positions), and each
  prefill rank's manifest on its Success status.
- ``decode_manifest``: on a decode server, the manifests checked before a request is ready.
- ``metrics``: each prefill CP rank's startup line, and the plugin's series in SGLang's ``/metrics``.
- ``connector_bounds``: on a prefill server, the connector's per-room tables bounded (rooms that SGLang
  0.5.23 would keep after their request ended are dropped).
- ``connector_sockets``: the connector's status sockets reconnect after a connect made while the peer
  was unreachable.

Every module but ``hooks`` holds plain functions with explicit arguments, each called before, after or
instead of one of SGLang's steps; ``hooks.register`` installs the adapters, which pass through unless
``--enable-cp-shared-kv`` is on.
"""
