"""CP-shared KV cache: the batch read state and the view arena charged to the KV
budget.

A translation runs once per input tensor (again after an in-place change); a batch
whose lengths cannot describe it is refused before anything changes. The view arena
is SGLang's ``PageShardSpec`` with the CP-shared regions, a fraction of the
page-interleave scratch.
"""

import unittest

import torch

from sglang.srt.layers.attention.dsa.cp_shared_kv.read_state import (
    BatchInputs,
    BatchReadState,
    PageBuffers,
    TensorMemo,
)
from sglang.srt.mem_cache.cp_shared_kv.placement import PageOwnership
from sglang.srt.mem_cache.cp_shared_kv.view_arena import (
    arena_bytes,
    make_arena_spec,
    upstream_scratch_bytes,
)
from sglang.srt.mem_cache.page_interleave import PageShardSpec
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")


class TestReadState(CustomTestCase):
    def test_memo_runs_once_per_unchanged_tensor(self):
        calls = []
        memo = TensorMemo(lambda t: calls.append(t) or t * 2, size=2)
        a, b = torch.arange(4), torch.arange(4)
        first = memo(a)
        self.assertIs(memo(a), first)
        self.assertTrue(torch.equal(memo(b), first))
        self.assertEqual(len(calls), 2)
        a.add_(1)  # changed in place: computed again
        self.assertTrue(torch.equal(memo(a), torch.arange(1, 5) * 2))
        self.assertEqual(len(calls), 3)

    def test_begin_refuses_lengths_that_cannot_describe_a_batch(self):
        ps, row = 16, 8
        own = PageOwnership(2, ps, logical_pages=16)
        latent = PageBuffers(
            own, 0, row, [torch.zeros((8, ps * row), dtype=torch.uint8)]
        )
        state = BatchReadState(own, 0, 16, latent, None, None)
        table = torch.arange(2 * 4 * ps, dtype=torch.int32).view(2, 4 * ps)
        rows = torch.arange(2)
        for prefix_lens, seq_lens, message in (
            ((32, 0), (16, 16), r"prefix_lens must lie in \[0, seq_len\]"),
            ((0, 0), (16, 5 * ps), r"seq_lens within .* 64 columns"),
            ((0, 8), (16, 16), r"prefix_lens must be page-aligned \(page size 16\)"),
        ):
            with self.assertRaisesRegex(ValueError, message):
                state.begin(BatchInputs(table, rows, prefix_lens, seq_lens))
            self.assertIsNone(state.mode)
        state.begin(BatchInputs(table, rows, (0, 0), (16, 4 * ps)))
        self.assertEqual(state.mode, "current")


class TestViewArena(CustomTestCase):
    def test_arena_is_a_fraction_of_the_page_interleave_scratch(self):
        # 128K context, CP 8, page 64, 16K chunks, two contexts of prefix.
        context = 131072 + 100
        spec = make_arena_spec(3, 8, 64, context, 16384, 2)
        self.assertIsInstance(spec, PageShardSpec)
        self.assertEqual((spec.shard_rank, spec.shard_size), (3, 8))
        self.assertEqual(spec.max_prefix_tokens, 2 * (131072 + 512))
        token_bytes = 656 + 132
        arena = arena_bytes(spec, token_bytes)
        theirs = upstream_scratch_bytes(spec, token_bytes, context)
        self.assertEqual(arena, (2 * (131072 + 512) + 16384 + 64) * token_bytes)
        self.assertEqual(theirs, 2 * (8 * (131072 + 512) + 16384 + 64) * token_bytes)
        with_prefetch = arena_bytes(spec, token_bytes, prefetch=True)
        self.assertEqual(with_prefetch - arena, (16384 + 64) * token_bytes)
        self.assertLessEqual(4 * with_prefetch, theirs)


if __name__ == "__main__":
    unittest.main()
