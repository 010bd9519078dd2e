"""Where a request stands in the transfer, on either side.

Ordered so that the minimum over the CP ranks is the state of the whole group
(any rank FAILED -> the request failed; all SUCCESS -> done), which is how a
prefill scheduler agrees on a request across ranks before freeing its pages
(an all-reduce MIN, like SGLang's ``KVPoll``).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum


class TransferState(IntEnum):
    FAILED = 0
    WAITING = 1  # sender: submitted, no destination pages yet; decode: waiting for manifests
    TRANSFERRING = 2  # sender: writing pages
    WAITING_VERDICT = 3  # sender: pages written and manifest sent, waiting for the decode side's check
    SUCCESS = 4  # decode side checked every manifest: the request is ready to decode

    @property
    def finished(self) -> bool:
        return self in (TransferState.FAILED, TransferState.SUCCESS)


def agree_across_ranks(states: Sequence[TransferState], group=None) -> list[TransferState]:
    """The group-wide state of each request: the minimum over the CP ranks (one all-reduce).

    Every rank passes its senders' states for the same requests in the same order and
    gets the same answer, so all ranks free a request's prefill pages together.
    """
    import torch
    import torch.distributed as dist

    local = torch.tensor([int(s) for s in states], dtype=torch.int32)
    dist.all_reduce(local, op=dist.ReduceOp.MIN, group=group)
    return [TransferState(int(v)) for v in local.tolist()]
