"""Current-reuse: a batch that reads no prefix attends over the chunk it just computed.

After prefill CP's all-gather every rank holds the whole current chunk, so when no request has a prefix
nothing is gathered: the read state stages the chunk as it is written.
"""

from __future__ import annotations

from collections.abc import Sequence


def batch_kind(prefix_lens: Sequence[int]) -> str:
    """``current`` (no request has a prefix), ``history`` (all do) or ``mixed``; host ints only."""
    with_prefix = [int(p) > 0 for p in prefix_lens]
    if not any(with_prefix):
        return "current"
    return "history" if all(with_prefix) else "mixed"
