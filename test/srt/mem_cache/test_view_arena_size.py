"""The view arena's regions (``arena_regions``): hand-computed, and SGLang's ``PageShardSpec`` through
``view_arena.make_arena_spec`` holds the very same sizes."""

import pytest

from sglang_cp_shared_kv.srt.mem_cache.view_arena_size import arena_regions, ceil_align


def test_arena_regions_round_contexts_to_rotations_and_the_chunk_to_pages():
    assert ceil_align(0, 64) == 0 and ceil_align(1, 64) == 64 and ceil_align(128, 64) == 128
    # CP 4, page 16: a context of 405 tokens is 7 rotations of 64 tokens; the chunk is whole pages.
    assert arena_regions(4, 16, 405, 256, 2) == (2 * 448, 256)
    assert arena_regions(3, 16, 174, 120, 1) == (192, 128)
    assert arena_regions(1, 16, 160, 128, 2) == (320, 128)  # the standalone stack's CP 1 baseline
    for args, name in [((0, 16, 1, 1, 1), "cp_size"), ((2, 16, 1, 1, 0), "contexts"), ((2, 16, 1, 0, 1), "chunk")]:
        with pytest.raises(ValueError, match=f"{name}\\w* must be an int >= 1"):
            arena_regions(*args)


@pytest.mark.sglang
@pytest.mark.parametrize(
    "cp, ps, context, chunk, contexts", [(2, 64, 131172, 16384, 2), (4, 16, 405, 256, 2), (3, 16, 174, 100, 3)]
)
def test_arena_regions_are_the_spec_handed_to_sglang(cp, ps, context, chunk, contexts):
    from sglang_cp_shared_kv.srt.sglang_wiring.view_arena import make_arena_spec

    spec = make_arena_spec(0, cp, ps, context, chunk, contexts)
    prefix, chunk_tokens = arena_regions(cp, ps, context, chunk, contexts)
    assert (spec.max_prefix_tokens, spec.chunk_tokens) == (prefix, chunk_tokens)
    assert spec.scratch_rows == prefix + chunk_tokens + ps
