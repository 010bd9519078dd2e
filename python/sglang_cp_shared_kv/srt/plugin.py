"""SGLang general-plugin entry point (group ``sglang.srt.plugins``, name ``cp_shared_kv``).

``load()`` runs once per SGLang process (launcher, schedulers, detokenizer,
DP controller) before ``HookRegistry.apply_hooks()``. It only registers
hooks; every hook is a pass-through unless ``--enable-cp-shared-kv`` is on,
so with the flag off SGLang behaves exactly as stock. On a prefill server the
flag shards the KV; on a decode server it checks the prefill ranks' manifests.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def load() -> None:
    from sglang_cp_shared_kv.srt import server_args_hook, startup_checks
    from sglang_cp_shared_kv.srt.sglang_wiring import decode_manifest
    from sglang_cp_shared_kv.srt.sglang_wiring import register as register_wiring

    server_args_hook.register()
    startup_checks.register()
    register_wiring()  # prefill: pools, allocator, sharded sender + manifest
    decode_manifest.register()  # decode: the manifest check before a request is ready
    logger.debug("sglang-cp-shared-kv plugin hooks registered")
