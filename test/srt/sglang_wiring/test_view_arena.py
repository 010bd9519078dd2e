"""The view arena's sizes: SGLang's own PageShardSpec with our regions, a fraction of SGLang's scratch."""

import pytest

pytestmark = pytest.mark.sglang


def test_arena_spec_regions_and_ratio_to_sglang_scratch():
    from sglang.srt.mem_cache.page_interleave import PageShardSpec

    from sglang_cp_shared_kv.srt.sglang_wiring.view_arena import arena_bytes, make_arena_spec, upstream_scratch_bytes

    # 128K context, CP 8, page 64, 16K chunks: prefix regions align to the 8 x 64 gather span.
    spec = make_arena_spec(3, 8, 64, 131072 + 100, 16384, 2)
    assert isinstance(spec, PageShardSpec) and (spec.shard_rank, spec.shard_size) == (3, 8)
    assert spec.max_prefix_tokens == 2 * (131072 + 512) and spec.chunk_tokens == 16384
    token_bytes = 656 + 132
    arena, theirs = arena_bytes(spec, token_bytes), upstream_scratch_bytes(spec, token_bytes, 131072 + 100)
    assert arena == (2 * (131072 + 512) + 16384 + 64) * token_bytes
    assert theirs == 2 * (8 * (131072 + 512) + 16384 + 64) * token_bytes
    assert 0.125 < arena / theirs < 0.14  # about contexts / 16, plus the chunk, which the arena holds once
    assert arena * 4 <= theirs  # the goal: at most a quarter of SGLang's scratch
    with pytest.raises(ValueError, match="contexts must be an int >= 1"):
        make_arena_spec(0, 2, 64, 4096, 1024, 0)


def test_prefetch_adds_a_second_chunk_and_keeps_admission():
    from sglang_cp_shared_kv.srt.sglang_wiring.view_arena import arena_bytes, make_arena_spec, upstream_scratch_bytes

    spec = make_arena_spec(3, 8, 64, 131072 + 100, 16384, 2)
    token_bytes = 656 + 132
    arena = arena_bytes(spec, token_bytes, prefetch=True)
    assert arena == (2 * (131072 + 512) + 2 * (16384 + 64)) * token_bytes
    assert arena * 4 <= upstream_scratch_bytes(spec, token_bytes, 131072 + 100)  # 0.14x


def test_prefetch_follows_the_read_mode_unless_set(monkeypatch):
    from sglang_cp_shared_kv.srt.distributed.copy_engine import TRANSPORT_ENV
    from sglang_cp_shared_kv.srt.sglang_wiring.read_mode import PREFETCH_ENV, prefetch_setting

    monkeypatch.delenv(PREFETCH_ENV, raising=False)
    for transport in (None, "copy_engine", "nccl"):  # left to the model, whatever the transport
        if transport is None:
            monkeypatch.delenv(TRANSPORT_ENV, raising=False)
        else:
            monkeypatch.setenv(TRANSPORT_ENV, transport)
        assert prefetch_setting() is None
    monkeypatch.setenv(PREFETCH_ENV, "1")
    assert prefetch_setting() is True  # asked for: the arena keeps room, over NCCL too (prefetch_on then turns it off)
    monkeypatch.setenv(PREFETCH_ENV, "0")
    assert prefetch_setting() is False
    monkeypatch.setenv(PREFETCH_ENV, "2")  # as SGLang reads its own settings: a warning, then the default
    with pytest.warns(UserWarning, match=f'Invalid value for {PREFETCH_ENV}: "2" is not a valid boolean value'):
        assert prefetch_setting() is False


def test_arena_contexts_from_the_environment(monkeypatch):
    from sglang_cp_shared_kv.srt.mem_cache.view_arena_size import ARENA_CONTEXTS, ARENA_CONTEXTS_ENV, arena_contexts

    monkeypatch.delenv(ARENA_CONTEXTS_ENV, raising=False)
    assert arena_contexts() == ARENA_CONTEXTS
    monkeypatch.setenv(ARENA_CONTEXTS_ENV, "4")
    assert arena_contexts() == 4
    for bad in ("0", "-1"):
        monkeypatch.setenv(ARENA_CONTEXTS_ENV, bad)
        with pytest.raises(ValueError, match=f"{ARENA_CONTEXTS_ENV} must be an int >= 1, got {bad}"):
            arena_contexts()
    monkeypatch.setenv(ARENA_CONTEXTS_ENV, "two")
    with pytest.warns(UserWarning, match=f'Invalid value for {ARENA_CONTEXTS_ENV}: "two" is not a valid integer'):
        assert arena_contexts() == ARENA_CONTEXTS
