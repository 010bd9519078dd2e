"""The view arena's two regions, in tokens, from a server's limits (no torch or SGLang).

A batch reads ``[prefix view | current chunk | trash page]``: ``contexts`` full contexts
of prefix in whole rotations of ``N`` pages, and the chunked-prefill budget in pages.
"""

from __future__ import annotations

from sglang_cp_shared_kv.srt.environ import envs
from sglang_cp_shared_kv.srt.utils import check_int

ARENA_CONTEXTS = envs.SGLANG_CP_SHARED_KV_ARENA_CONTEXTS.default
ARENA_CONTEXTS_ENV = envs.SGLANG_CP_SHARED_KV_ARENA_CONTEXTS.name


def arena_contexts() -> int:
    """``$SGLANG_CP_SHARED_KV_ARENA_CONTEXTS`` (an int >= 1), else the default."""
    contexts = envs.SGLANG_CP_SHARED_KV_ARENA_CONTEXTS.get()
    check_int(ARENA_CONTEXTS_ENV, contexts, 1)
    return contexts


def ceil_align(x: int, granule: int) -> int:
    return -(-x // granule) * granule


def arena_regions(cp_size: int, page_size: int, context_len: int, chunk_tokens: int, contexts: int) -> tuple[int, int]:
    """``(prefix_tokens, chunk_tokens)`` of a rank's arena (which adds one page)."""
    for name, value in locals().items():  # every argument is an int >= 1
        check_int(name, value, 1)
    prefix = contexts * ceil_align(context_len, cp_size * page_size)
    return prefix, ceil_align(chunk_tokens, page_size)
