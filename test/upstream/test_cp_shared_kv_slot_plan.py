"""CP-shared KV cache: the per-batch slot plan, its Triton kernel against its
plain-torch reference.

Each page position of a batch gets a slot in an owner-major view of ``N`` blocks of
``S`` slots, ``S = sum_b ceil(pages_b / N)``. Pages that rotate owners fit their
owner's block; an owner with more pages than its block sends the trash page for the
excess (every slot stays inside the view) and the status word says so.
"""

import os
import unittest

import torch

from sglang.srt.layers.attention.dsa.cp_shared_kv.plan_kernels import (
    PLAN_META_ROWS,
    assign_slots_ref,
    plan_batch,
    plan_positions_ref,
)
from sglang.srt.layers.attention.dsa.cp_shared_kv.slot_plan import (
    plan_meta_rows,
    slots_per_rank,
)
from sglang.test.ci.ci_register import register_cuda_ci
from sglang.test.test_utils import CustomTestCase

register_cuda_ci(est_time=10, suite="base-a-test-1-gpu-small")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRASH = 777


def _reference(table: torch.Tensor, pages: list[int], n: int):
    cu = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], device=DEVICE)
    positions = plan_positions_ref(cu, table.shape[1], sum(pages))
    return assign_slots_ref(table, positions, n, slots_per_rank(pages, n), TRASH)


def _kernel(table: torch.Tensor, pages: list[int], n: int):
    meta = torch.tensor(plan_meta_rows(pages), dtype=torch.int64, device=DEVICE)
    meta = meta.view(len(PLAN_META_ROWS), -1)
    rows = torch.arange(table.shape[0], device=DEVICE)
    s = slots_per_rank(pages, n)
    args = (table, rows, 1, meta, table.shape[1], sum(pages), n, s, TRASH)
    plan = plan_batch(*args, None, 0, 0, 0, True)
    return plan.logical, plan.slots, plan.slot_table, plan.slot_phys, plan.status


class TestSlotPlan(CustomTestCase):
    def test_rotating_pages_fit_and_the_excess_reads_the_trash_page(self):
        n = 4
        # Request 0's pages rotate owners; request 1's six pages are all on owner 1.
        table = torch.tensor(
            [[8, 9, 10, 11, 12, 0], [5, 9, 13, 17, 21, 25]], device=DEVICE
        )
        pages = [5, 6]
        logical, slots, _, slot_phys, status = _reference(table, pages, n)
        s = slots_per_rank(pages, n)
        counts = torch.bincount(logical % n, minlength=n)
        self.assertEqual(status.tolist(), [1, *counts.tolist()])
        self.assertTrue(bool(((slots >= 0) & (slots < n * s)).all()))
        owner1 = [i for i, lp in enumerate(logical.tolist()) if lp % n == 1]
        kept = [int(slot_phys[slots[i]]) for i in owner1[:s]]
        self.assertEqual(kept, [int(logical[i]) // n for i in owner1[:s]])
        self.assertTrue(all(int(slot_phys[slots[i]]) == TRASH for i in owner1[s:]))
        fits = table[:1, :5]
        self.assertEqual(int(_reference(fits, [5], n)[4][0]), 0)

    @unittest.skipUnless(
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
        "the plan's Triton kernel needs CUDA",
    )
    def test_kernel_equals_reference(self):
        g = torch.Generator().manual_seed(0)
        for n in (2, 3, 8):
            for pages in ([5, 3, 7, 1, 4, 9], [1], [12, 0, 12], [1000, 25]):
                table = torch.randint(
                    0, 10_000, (len(pages), max(pages) + 1), generator=g
                )
                table = table.to(DEVICE)
                got, want = _kernel(table, pages, n), _reference(table, pages, n)
                for a, b in zip(got, want):
                    self.assertEqual(a.dtype, b.dtype)
                    self.assertTrue(torch.equal(a, b))


if __name__ == "__main__":
    unittest.main()
