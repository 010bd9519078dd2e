"""A test-only SGLang platform: SGLang's own server on the CPU, plain torch where it has no CPU path.

Never shipped: it lives under ``test/`` and is registered only by the end-to-end test, which writes
a ``dist-info`` with two entry points into a temporary directory on ``PYTHONPATH``
(``test/e2e/launcher.py``):

- ``sglang.srt.platforms``: ``cp_shared_kv_cpu`` -> :class:`CpuTestPlatform`. An out-of-tree platform,
  so SGLang skips its device-keyed fallbacks (the rotary embedding's ``vllm._custom_ops``, the CPU
  engine's ``sgl_kernel``) and its fused ops dispatch to their ``forward_native`` (plain torch).
- ``sglang.srt.plugins``: ``cp_shared_kv_cpu_shims`` -> :func:`install`, run by SGLang in every process
  (launcher, tokenizer manager, each scheduler) before it parses the command line: it installs the
  entries of :data:`STAND_INS` below.

Every place where this platform changes what SGLang or the plugin would do is one row of
:data:`STAND_INS`; nothing else is patched.
"""

from __future__ import annotations

import os

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

# What SGLang's CUDA resolution reads as the device's compute capability. 9.x keeps SGLang's DSA
# defaults at a bf16 KV cache with prefill flashmla_sparse (SM 10 would pick fp8).
CAPABILITY = (9, 0)


class CpuTestPlatform(CpuDeviceMixin, SRTPlatform):
    """The CPU as an out-of-tree SGLang device: torch CPU tensors, gloo groups, no Triton, no graphs."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    # Conservative: no Triton launches, no CUDA graphs, no PyNccl (gloo carries every group).
    capabilities = PlatformCapabilities()

    def get_default_attention_backend(self) -> str:
        return "dsa"

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    def get_dispatch_key_name(self) -> str:
        return "native"

    def post_load_model(self, model) -> None:
        # Every SGLang module that registers a custom op is imported by now.
        from cp_shared_kv_cpu_platform.dsa_stand_ins import register_cpu_kernels

        register_cpu_kernels()


def _device_capability(*_args, **_kwargs) -> tuple[int, int]:
    return CAPABILITY


def _install_capability() -> None:
    import torch

    torch.cuda.get_device_capability = _device_capability


def _install_device_waiver() -> None:
    from sglang_cp_shared_kv.srt.sglang_wiring import startup_checks

    checks = startup_checks.resolved_rejections
    if getattr(checks, "_cpu_platform_waiver", False):
        return

    def resolved_rejections(server_args, *args):
        return [line for line in checks(server_args, *args) if "--device cpu:" not in line]

    resolved_rejections._cpu_platform_waiver = True
    startup_checks.resolved_rejections = resolved_rejections


def _set_env(name: str, value: str):
    def install() -> None:
        os.environ.setdefault(name, value)

    return install


def _no_stream(*_args, **_kwargs):
    return None  # torch.cuda.stream(None) is a no-op context


def _install_current_stream() -> None:
    import torch

    torch.cuda.current_stream = _no_stream


def _install_dsa_ops() -> None:
    from cp_shared_kv_cpu_platform.dsa_stand_ins import install_ops

    install_ops()


def _install_flash_mla() -> None:
    from cp_shared_kv_cpu_platform.dsa_stand_ins import install_flash_mla

    install_flash_mla()


# The dummy weights' range: the tiny model's next-token distribution then depends on its attention.
DUMMY_WEIGHT_RANGE = 0.5


def _install_dummy_weight_range() -> None:
    import functools

    from sglang.srt.model_loader import loader, weight_utils

    init = weight_utils.initialize_dummy_weights
    r = DUMMY_WEIGHT_RANGE
    loader.initialize_dummy_weights = functools.partial(init, low=-r, high=r)


def _install_dcp_platform() -> None:
    from sglang.srt.distributed import parallel_state

    parallel_state.is_cuda = lambda: True


def _install_sender_indices() -> None:
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    MooncakeKVSender.supports_host_tensor_indices = False


# name -> (what SGLang or the plugin does there on a GPU machine, what this platform puts in its place, installer).
STAND_INS: dict[str, tuple[str, str, object]] = {
    "platform": (
        "CUDA platform: CUDA tensors, NCCL groups, device-keyed kernels",
        "CpuTestPlatform (out-of-tree): CPU tensors, gloo, fused ops' forward_native",
        None,
    ),
    "torch.cuda.get_device_capability": (
        "SGLang's DSA resolution (handle_model_specific_adjustments, _dsa_kv_cache_dtype_default) reads the "
        "GPU's compute capability",
        f"returns {CAPABILITY}: a bf16 KV cache, prefill flashmla_sparse, decode fa3 (SGLang's SM90 defaults)",
        _install_capability,
    ),
    "--enable-cp-shared-kv: --device cpu refusal": (
        "the plugin's resolved_rejections refuses --device cpu (its read path and kernels are CUDA's)",
        "that one line is dropped; every other startup check runs unchanged",
        _install_device_waiver,
    ),
    "SGLANG_OPT_USE_TOPK_V2": (
        "the DSA backend's metadata plans its top-k with a CUDA JIT kernel (dsv4 topk_v2)",
        "0: SGLang's non-JIT top-k metadata (what SGLang itself sets on XPU)",
        _set_env("SGLANG_OPT_USE_TOPK_V2", "0"),
    ),
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS": (
        "a crashing server waits 60 s for CUDA core dumps before it exits",
        "0: there is no CUDA to dump",
        _set_env("SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS", "0"),
    ),
    "SGLANG_DSA_FUSE_TOPK": (
        "the indexer's top-k is fused with its page-table transform in a CUDA kernel",
        "0: SGLang's unfused top-k, with --dsa-topk-backend torch (torch.topk), as SGLang does on XPU",
        _set_env("SGLANG_DSA_FUSE_TOPK", "0"),
    ),
    "torch.cuda.current_stream": (
        "SGLang's interleaved CP (layers/cp/interleave.py) gathers the indexer keys on the current CUDA stream",
        "returns None: torch.cuda.stream(None) is a no-op, the gather runs in line",
        _install_current_stream,
    ),
    "custom ops on CPU tensors": (
        "out of tree, SGLang registers its custom ops (the CP all-gather, ...) for PrivateUse1 only",
        "CpuTestPlatform.post_load_model adds a CPU kernel of each op's own Python function (register_cpu_kernels)",
        None,
    ),
    "hadamard_transform / DeepseekScalingRotaryEmbedding / Indexer": (
        "the indexer's Hadamard rotation (a CUDA JIT kernel); SGLang's native DeepSeek rope (it returns "
        "[1, T, H, D] for a [T, H, D] neox-style query); Indexer.forward_cuda (DeepGEMM fp8 logits)",
        "dsa_stand_ins: a torch Hadamard; the same rope math per token; SGLang's q/k, K-cache store through "
        "the pool, head gate, keys through the pool's get_index_k_scale_buffer, torch fp8 MQA logits, then "
        "SGLang's own masking and torch top-k; decode batches: the keys through SGLang's page table and "
        "read buffer (reference.dsa_reference.read_index_k), the same logits (other batch kinds raise)",
        _install_dsa_ops,
    ),
    "--load-format dummy: the weights' range": (
        "SGLang draws every dummy weight from U(-1e-3, 1e-3): the tiny model's next-token distribution is "
        "uniform to about 1e-6, whatever its attention reads",
        f"U(-{DUMMY_WEIGHT_RANGE}, {DUMMY_WEIGHT_RANGE}), SGLang's own initializer and seed",
        _install_dummy_weight_range,
    ),
    "parallel_state.is_cuda": (
        "initialize_model_parallel refuses --dcp-size > 1 (decode context parallel) on a platform that is not "
        "CUDA, HIP, NPU or XPU; that check is the only reader of is_cuda in its module",
        "returns True there: the decode CP groups are built as on a GPU, over gloo",
        _install_dcp_platform,
    ),
    "MooncakeKVSender.supports_host_tensor_indices": (
        "a stock prefill (not one with the flag: its CP ranks all send) copies each chunk's page indices into "
        "pinned host memory behind a CUDA event for the Mooncake sender",
        "False: SGLang's synchronous page-index path (kv_to_page_indices), the same indices",
        _install_sender_indices,
    ),
    "flash_mla_sparse_fwd": (
        "FlashMLA's sparse attention (--dsa-prefill-backend flashmla_sparse, and the test's "
        "--dsa-decode-backend flashmla_sparse; the flash_mla package)",
        "reference.dsa_reference.flash_mla_sparse_fwd_ref (the project's oracle sparse_mla) over the rows "
        "SGLang's DSA backend selected (its LSE in base 2, as SGLang's wrapper returns the legacy kernel's)",
        _install_flash_mla,
    ),
}


def install() -> None:
    """Installs every stand-in of :data:`STAND_INS` in this process (idempotent)."""
    for _what, _instead, installer in STAND_INS.values():
        if installer is not None:
            installer()
