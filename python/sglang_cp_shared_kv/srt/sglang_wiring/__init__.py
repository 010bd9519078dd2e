"""Wiring of the CP-shared KV cache into SGLang 0.5.23 (registered by ``plugin.load``).

- ``pool_hooks``: SGLang's MLA/DSA pools replaced by ``sharded_kv_pool``'s subclasses and its
  allocator widened by N (SGLang's owner-rotating allocator).
- ``sharded_kv_pool`` + ``read_state``: the masked write path and the kv-shard read contract
  (current-reuse / materialized view) that SGLang's DSA backend, indexer and FA3 call.
- ``transfer``: SGLang's Mooncake sender in sharded mode (owned pages at their positions);
  a debug check of each rank's share.

Every hook passes through unless ``--enable-cp-shared-kv`` is on.
"""


def register() -> None:
    from sglang_cp_shared_kv.srt.sglang_wiring import pool_hooks, transfer

    pool_hooks.register()
    transfer.register()
