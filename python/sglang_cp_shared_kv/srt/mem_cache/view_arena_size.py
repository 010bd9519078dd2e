"""The view arena's two regions, in tokens, from a server's limits (no torch, no SGLang).

A prefill batch's read buffer is ``[prefix view | current chunk | trash page]``. The arena bounds it once:
``contexts`` full contexts of prefix, each rounded up to whole rotations of ``N`` pages (the view all-gathers
``N * sum_i ceil(prefix_pages_i / N)`` pages), and the chunked-prefill budget in whole pages.
"""

from __future__ import annotations

from sglang_cp_shared_kv.srt.environ import envs
from sglang_cp_shared_kv.srt.utils import check_int

ARENA_CONTEXTS = envs.SGLANG_CP_SHARED_KV_ARENA_CONTEXTS.default
ARENA_CONTEXTS_ENV = envs.SGLANG_CP_SHARED_KV_ARENA_CONTEXTS.name


def arena_contexts() -> int:
    """``$SGLANG_CP_SHARED_KV_ARENA_CONTEXTS`` (an int >= 1), else ``ARENA_CONTEXTS``."""
    contexts = envs.SGLANG_CP_SHARED_KV_ARENA_CONTEXTS.get()
    check_int(ARENA_CONTEXTS_ENV, contexts, 1)
    return contexts


def ceil_align(x: int, granule: int) -> int:
    return -(-x // granule) * granule


def arena_regions(cp_size: int, page_size: int, context_len: int, chunk_tokens: int, contexts: int) -> tuple[int, int]:
    """``(prefix_tokens, chunk_tokens)``: ``contexts * ceil_align(context_len, N * ps)`` and
    ``ceil_align(chunk_tokens, ps)``. The arena holds those plus one page, per rank."""
    check_int("cp_size", cp_size, 1)
    check_int("page_size", page_size, 1)
    check_int("context_len", context_len, 1)
    check_int("chunk_tokens", chunk_tokens, 1)
    check_int("contexts", contexts, 1)
    return contexts * ceil_align(context_len, cp_size * page_size), ceil_align(chunk_tokens, page_size)
