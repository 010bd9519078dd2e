"""In line or a layer ahead: how a CP-shared pool builds each layer's view (at startup).

Building layer ``l + 1``'s view while layer ``l`` computes hides the pull at a fixed
cost per layer; the rank model (``docs/benchmarks/rank_model.json``, CP 2-8 on an H200)
found that pays once the modeled pull is ``PULL_SHARE`` of the modeled layer. Over NCCL
the prefetch never runs; ``$SGLANG_CP_SHARED_KV_PREFETCH`` (1 or 0) sets the mode.
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
    forced: bool  # by $SGLANG_CP_SHARED_KV_PREFETCH, not the model

    def describe(self) -> str:
        mode = "prefetch one layer ahead" if self.prefetch else "in line"
        if self.forced:
            return f"views {mode} ({PREFETCH_ENV}={int(self.prefetch)})"
        share = 100 * self.pull_us / self.layer_us
        bound = "at least" if self.prefetch else "under"
        return (
            f"views {mode}: a full context's pull is modeled at {self.pull_us:.0f} us "
            f"per layer, {share:.1f}% of a {self.layer_us / 1000:.1f} ms layer "
            f"({bound} {100 * PULL_SHARE:.0f}%; {PREFETCH_ENV}=0/1 overrides)"
        )


def modeled_layer_us(tokens: int, context: int) -> float:
    """DeepSeek-V3.2's prefill layer on a rank, ``tokens`` new over ``context``."""
    return max(LAYER_FLOOR_US, tokens * (US_PER_TOKEN + US_PER_TOKEN_CONTEXT * context))


def prefetch_setting() -> bool | None:
    """``$SGLANG_CP_SHARED_KV_PREFETCH`` (1 or 0), or None where the model decides."""
    setting = envs.SGLANG_CP_SHARED_KV_PREFETCH
    return setting.get() if setting.is_set() else None


def choose_read_mode(cp: int, context: int, chunk: int, token_bytes: int) -> ReadMode:
    """The mode for ``chunk`` tokens a batch over ``cp`` ranks and a ``context``-token
    context, of ``token_bytes`` a token (latent row and indexer record) per layer."""
    pull = (cp - 1) / cp * context * token_bytes / LINK_BYTES_PER_US  # from the peers
    layer = modeled_layer_us(max(chunk // cp, 1), context)
    forced = prefetch_setting()
    prefetch = pull >= PULL_SHARE * layer if forced is None else forced
    return ReadMode(prefetch, pull, layer, forced=forced is not None)
