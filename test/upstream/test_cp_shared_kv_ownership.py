"""CP-shared KV cache: page ownership, the view arena's sizes, the peer watchdog.

Logical page ``lp`` lives on CP rank ``lp % N`` as physical page ``lp // N``: the
placement of SGLang's page-interleave allocator, so its allocator, sender and decode
find each page where the CP-shared pool stores it.
"""

import threading
import unittest
from dataclasses import FrozenInstanceError

import torch

from sglang.srt.distributed.cp_shared_kv.peer_watchdog import PeerLost, PeerWatchdog
from sglang.srt.environ import envs
from sglang.srt.mem_cache.cp_shared_kv.placement import (
    CPSharedSpec,
    PageOwnership,
    local_page,
    page_owner,
)
from sglang.srt.mem_cache.cp_shared_kv.view_arena_size import (
    arena_contexts,
    arena_regions,
)
from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")


class TestPageOwnership(CustomTestCase):
    def test_placement_is_the_page_interleave_allocators(self):
        g = torch.Generator().manual_seed(0)
        for n in (2, 3, 4, 8):
            for ps in (1, 16, 64):
                spec = PageShardSpec(
                    shard_rank=0,
                    shard_size=n,
                    page_size=ps,
                    max_prefix_tokens=0,
                    chunk_tokens=0,
                )
                theirs = PageInterleavePlacement(spec)
                locs = torch.randint(0, 1 << 20, (512,), generator=g)
                own = PageOwnership(n, ps)
                owner, row = own.loc_owner(locs), own.phys_row(locs)
                self.assertTrue(torch.equal(owner, theirs.owner_of(locs)))
                self.assertTrue(torch.equal(row, theirs.local_index(locs)))
                self.assertTrue(torch.equal(own.logical_loc(owner, row), locs))
                lp = locs // ps
                self.assertTrue(torch.equal(page_owner(lp, n), lp % n))
                self.assertTrue(torch.equal(local_page(lp, n), lp // n))

    def test_int32_stays_int32_near_its_limit(self):
        own = PageOwnership(8, 64)
        locs = torch.tensor([2**31 - 1, 2**31 - 64], dtype=torch.int32)
        row = own.phys_row(locs)
        self.assertEqual(row.dtype, torch.int32)
        self.assertTrue(torch.equal(own.logical_loc(own.loc_owner(locs), row), locs))

    def test_masked_store_sends_other_owners_rows_to_the_trash_page(self):
        own = PageOwnership(2, 16)
        # Pages 2, 3, 1 are owned by ranks 0, 1, 1; rank 1 stores its rows.
        locs = torch.tensor([2 * 16 + 1, 3 * 16 + 1, 16 + 1])
        rows, mine = own.store_rows(locs, 1, trash_page=0, phys_pages=2)
        self.assertEqual(rows.tolist(), [1, 16 + 1, 1])
        self.assertEqual(mine.tolist(), [False, True, True])

    def test_bad_arguments_are_named(self):
        for kwargs, name in (
            (dict(cp_size=0, page_size=16), "cp_size"),
            (dict(cp_size=2, page_size=24), "page_size"),
            (dict(cp_size=2, page_size=16, logical_pages=-1), "logical_pages"),
        ):
            with self.assertRaisesRegex(ValueError, name):
                PageOwnership(**kwargs)
        base = dict(cp_size=4, cp_rank=0, page_size=16, phys_pages=5, row_bytes=656)
        spec = CPSharedSpec(**base, with_indexer=True)
        self.assertEqual((spec.trash_page, spec.logical_pages), (0, 20))
        with self.assertRaises(FrozenInstanceError):
            spec.cp_rank = 1
        with self.assertRaisesRegex(ValueError, r"cp_rank must be in \[0, 4\), got 4"):
            CPSharedSpec(**{**base, "cp_rank": 4}, with_indexer=False)


class TestViewArenaSize(CustomTestCase):
    def test_regions_round_contexts_to_rotations_and_the_chunk_to_pages(self):
        # CP 4, page 16: a 405-token context is 7 rotations of 64 tokens.
        self.assertEqual(arena_regions(4, 16, 405, 256, 2), (2 * 448, 256))
        self.assertEqual(arena_regions(3, 16, 174, 120, 1), (192, 128))
        with self.assertRaisesRegex(ValueError, "contexts must be an int >= 1"):
            arena_regions(2, 16, 1, 1, 0)

    def test_contexts_from_the_environment(self):
        self.assertEqual(arena_contexts(), 2)
        with envs.SGLANG_CP_SHARED_KV_ARENA_CONTEXTS.override(4):
            self.assertEqual(arena_contexts(), 4)
        with envs.SGLANG_CP_SHARED_KV_ARENA_CONTEXTS.override(0):
            with self.assertRaisesRegex(ValueError, "must be an int >= 1, got 0"):
                arena_contexts()


class TestPeerWatchdog(CustomTestCase):
    def test_a_wait_past_its_deadline_stops_then_releases_and_raises(self):
        order = []
        released = threading.Event()

        def release():
            order.append("release")
            released.set()

        dog = PeerWatchdog(
            0.2,
            lambda what: [1],
            release,
            on_failure=lambda line: order.append("stop"),
            poll_s=0.01,
        )
        dog.watch(lambda: True, ("fence", 1))
        dog.watch(released.is_set, ("fence", 2))
        self.assertTrue(released.wait(timeout=5))
        self.assertEqual(order, ["stop", "release"])
        with self.assertRaisesRegex(
            PeerLost, "rank 1 did not reach this rank's fence 2 within 0.2 s"
        ):
            dog.check()
        dog.close()


if __name__ == "__main__":
    unittest.main()
