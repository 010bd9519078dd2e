"""CP ranks agree on each request's transfer state with one all-reduce MIN before freeing pages."""

import pytest

from sglang_cp_shared_kv.reference.mooncake.transfer_state import TransferState, agree_across_ranks
from sglang_cp_shared_kv.reference.spawn import spawn_ranks

pytestmark = pytest.mark.multirank

S = TransferState
LOCAL = [
    [S.SUCCESS, S.SUCCESS, S.WAITING_VERDICT, S.SUCCESS, S.SUCCESS],
    [S.SUCCESS, S.FAILED, S.SUCCESS, S.TRANSFERRING, S.WAITING],
]


def _agree(rank, world_size):
    return agree_across_ranks(LOCAL[rank])


def test_min_over_ranks_is_the_group_state():
    want = [S.SUCCESS, S.FAILED, S.WAITING_VERDICT, S.TRANSFERRING, S.WAITING]
    assert spawn_ranks(_agree, 2) == [want] * 2
    assert [s.finished for s in want] == [True, True, False, False, False]
