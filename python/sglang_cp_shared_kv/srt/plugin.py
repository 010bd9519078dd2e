"""SGLang general-plugin entry point (group ``sglang.srt.plugins``, name ``cp_shared_kv``).

``load()`` runs once per SGLang process (launcher, schedulers, detokenizer,
DP controller) before ``HookRegistry.apply_hooks()``. It only registers
hooks (``sglang_wiring.hooks.register``); every hook is a pass-through unless
``--enable-cp-shared-kv`` is on, so with the flag off SGLang behaves exactly as
stock. On a prefill server the flag shards the KV; on a decode server it checks
the prefill ranks' manifests.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def load() -> None:
    from sglang_cp_shared_kv.srt.sglang_wiring.hooks import register

    register()
    logger.debug("sglang-cp-shared-kv plugin hooks registered")
