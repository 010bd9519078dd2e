"""Wiring of the CP-shared KV cache into SGLang 0.5.23: everything ``plugin.load`` installs.

Every module here but ``hooks`` holds plain functions with explicit arguments, each called before, after
or instead of one of SGLang's steps (the same functions the upstream series calls from SGLang's code):
the flag's rules (``startup_checks``), the pools and allocator (``pool_hooks``, ``sharded_kv_pool``,
``view_arena``, ``read_mode``), PD (``transfer``, ``decode_manifest``, ``connector_bounds``,
``connector_sockets``) and ``metrics``. ``hooks`` installs the adapters, which pass through unless
``--enable-cp-shared-kv`` is on.
"""
