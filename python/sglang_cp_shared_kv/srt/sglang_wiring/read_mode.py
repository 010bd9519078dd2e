"""In line or a layer ahead: how a CP-shared pool builds each layer's view, chosen once at startup.

Building layer ``l + 1``'s view while layer ``l`` computes (the prefetch) hides the pull behind the layer
at a fixed cost per layer; building it in line costs the pull itself. The rank model
(``docs/benchmarks/rank_model.json``, CP 2-8 on one H200) found the cheaper one follows the pull's share
of the layer::

    pull_us  = (cp_size - 1) / cp_size * ctx * token_bytes / LINK_BYTES_PER_US
    layer_us = max(LAYER_FLOOR_US,
                   tokens_per_rank * (US_PER_TOKEN + US_PER_TOKEN_CONTEXT * ctx))
    prefetch  iff  pull_us >= PULL_SHARE * layer_us

for a context of ``ctx`` tokens (``layer_us``: a fit of the model's layer, checked against the JSON by its
test). Over NCCL the prefetch never runs (``copy_engine.prefetch_on``); ``$SGLANG_CP_SHARED_KV_PREFETCH``
(1 or 0) overrides the choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_cp_shared_kv.srt.environ import envs

PREFETCH_ENV = envs.SGLANG_CP_SHARED_KV_PREFETCH.name
LINK_BYTES_PER_US = 370e3  # NVLink 4, one way per GPU (370 GB/s)
LAYER_FLOOR_US = 6000.0  # the layer's launch-bound floor at few tokens per rank
US_PER_TOKEN = 3.4
US_PER_TOKEN_CONTEXT = 1.7e-5
PULL_SHARE = 0.01


@dataclass(frozen=True)
class ReadMode:
    """The choice and the figures it came from, for the startup line."""

    prefetch: bool
    pull_us: float
    layer_us: float
    forced: bool  # set by $SGLANG_CP_SHARED_KV_PREFETCH, not by the model

    def describe(self) -> str:
        mode = "prefetch one layer ahead" if self.prefetch else "in line"
        if self.forced:
            return f"views {mode} ({PREFETCH_ENV}={int(self.prefetch)})"
        share = self.pull_us / self.layer_us
        return (
            f"views {mode}: a full context's pull is modeled at {self.pull_us:.0f} us per layer, "
            f"{100 * share:.1f}% of a {self.layer_us / 1000:.1f} ms layer "
            f"({'at least' if self.prefetch else 'under'} {100 * PULL_SHARE:.0f}%; {PREFETCH_ENV}=0/1 overrides)"
        )


def modeled_pull_us(cp_size: int, context_len: int, token_bytes: int) -> float:
    """One layer's pull from the peers for a view of ``context_len`` tokens of ``token_bytes`` each."""
    return (cp_size - 1) / cp_size * context_len * token_bytes / LINK_BYTES_PER_US


def modeled_layer_us(tokens_per_rank: int, context_len: int) -> float:
    """DeepSeek-V3.2's prefill layer on one rank for ``tokens_per_rank`` new tokens over ``context_len``."""
    return max(LAYER_FLOOR_US, tokens_per_rank * (US_PER_TOKEN + US_PER_TOKEN_CONTEXT * context_len))


def prefetch_setting() -> bool | None:
    """``$SGLANG_CP_SHARED_KV_PREFETCH``: 1 or 0 sets the mode; unset (None) leaves it to the model."""
    setting = envs.SGLANG_CP_SHARED_KV_PREFETCH
    return setting.get() if setting.is_set() else None


def choose_read_mode(cp_size: int, context_len: int, chunk_tokens: int, token_bytes: int) -> ReadMode:
    """The read mode of a server with these limits (``chunk_tokens``: the chunked-prefill budget, shared by the
    CP ranks; ``token_bytes``: one token's latent row and indexer record in one layer)."""
    pull = modeled_pull_us(cp_size, context_len, token_bytes)
    layer = modeled_layer_us(max(chunk_tokens // cp_size, 1), context_len)
    forced = prefetch_setting()
    if forced is not None:
        return ReadMode(forced, pull, layer, forced=True)
    return ReadMode(pull >= PULL_SHARE * layer, pull, layer, forced=False)
