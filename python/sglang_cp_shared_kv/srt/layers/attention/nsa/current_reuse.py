"""Current-reuse: a batch that reads no prefix attends over the chunk it just computed.

After prefill CP's all-gather every rank holds the whole current chunk: the latent rows and the
indexer K records it is about to write to the pool. When no request in the batch has a prefix
(decided from host metadata alone), those tensors *are* every key the batch can see, so nothing
needs to be gathered or all-gathered. ``batch_kind`` is that decision; the read state
(``layers.attention.nsa.read_state``) then stages the chunk page-aligned as it is written. Batches
with any history use the materialized view, always.
"""

from __future__ import annotations

from collections.abc import Sequence

BATCH_KINDS = ("current", "history", "mixed")


def batch_kind(prefix_lens: Sequence[int]) -> str:
    """``current`` (no request has a prefix), ``history`` (all do) or ``mixed``; host ints only."""
    with_prefix = [int(p) > 0 for p in prefix_lens]
    if not any(with_prefix):
        return "current"
    return "history" if all(with_prefix) else "mixed"
