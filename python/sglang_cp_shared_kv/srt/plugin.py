"""SGLang general-plugin entry point (group ``sglang.srt.plugins``, name ``cp_shared_kv``).

``load()`` runs once per SGLang process before ``HookRegistry.apply_hooks()`` and only registers hooks
(``sglang_wiring.hooks.register``), each a pass-through unless ``--enable-cp-shared-kv`` is on.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def load() -> None:
    from sglang_cp_shared_kv.srt.sglang_wiring.hooks import register

    register()
    logger.debug("sglang-cp-shared-kv plugin hooks registered")
