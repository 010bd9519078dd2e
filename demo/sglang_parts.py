"""SGLang 0.5.23's own pool, allocator and Mooncake connector classes, set up on CPU without a server.

A server builds these inside its scheduler and model runner (distributed groups, a bootstrap
HTTP server, a model). The demo and the tests that drive SGLang's classes build the same objects
straight from a resolved server-args record: the KV cache configurator's pool and allocator
builders (which the plugin's hooks replace when ``--enable-cp-shared-kv`` is on), and SGLang's
``MooncakeKVManager`` with the attributes its connector methods read, on 127.0.0.1.

The tiny models keep DeepSeek's byte formats where they are fixed (MLA latent ``kv_lora_rank``
512 + ``qk_rope_head_dim`` 64, DSA indexer head 128), so pools and transfers see the real row
and page layouts; everything else is small.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

_MLA = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "routed_scaling_factor": 1.0,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    # The context SGLang derives for the MLA/DSA models: room for the demo's long prompts (16K tokens and a
    # chunk). A CP-shared pool's view arena is sized from it (allocated; its pages touched only when read).
    "max_position_embeddings": 32768,
    "rope_theta": 10000,
    "rms_norm_eps": 1e-6,
    "vocab_size": 1024,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}
_DSA = {
    **_MLA,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_head_dim": 128,
    "index_n_heads": 4,
    "index_topk": 64,
}
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "vocab_size": 1024,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}
MODELS = {
    # DeepSeek-V3 (plain MLA): resolves on CPU, builds SGLang's MLA pool.
    "mla": {**_MLA, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"},
    # DeepSeek-V3.2-shaped (MLA + lightning indexer).
    "dsa": _DSA,
    # The same with a pooled indexer key (``index_kpool``).
    "dsa_kpool": {**_DSA, "index_kpool": 4},
    # A GQA Llama: no MLA latent at all.
    "gqa": LLAMA,
}


def write_model_dirs(root: Path, names: list[str] | None = None) -> dict[str, Path]:
    """Writes ``root/<name>/config.json`` for each named model (all of ``MODELS`` by default); returns the dirs."""
    names = list(MODELS) if names is None else list(names)
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        raise ValueError(f"names: unknown models {unknown}; known: {sorted(MODELS)}")
    dirs = {}
    for name in names:
        model_dir = Path(root) / name
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(MODELS[name]))
        dirs[name] = model_dir
    return dirs


def prefill_cp_argv(model_dir: str, page_size: int, cp_size: int = 2) -> list[str]:
    """Server argv of the tiny ``mla`` model as a Mooncake prefill server with ``cp_size`` prefill CP ranks, on CPU.

    It resolves on CPU (``--enable-cp-shared-kv`` would not: callers set it on the resolved record).
    """
    argv = ["--model-path", str(Path(model_dir) / "mla"), "--device", "cpu", "--skip-tokenizer-init"]
    argv += ["--enable-prefill-cp", "--cp-strategy", "interleave", "--tp-size", str(cp_size)]
    argv += ["--attn-cp-size", str(cp_size), "--page-size", str(page_size), "--disaggregation-mode", "prefill"]
    return argv + ["--disaggregation-transfer-backend", "mooncake"]


def decode_argv(model_dir: str, page_size: int) -> list[str]:
    """Server argv of the tiny ``mla`` model as a non-CP Mooncake decode server on CPU."""
    argv = ["--model-path", str(Path(model_dir) / "mla"), "--device", "cpu", "--skip-tokenizer-init"]
    argv += ["--page-size", str(page_size), "--disaggregation-mode", "decode"]
    return argv + ["--disaggregation-transfer-backend", "mooncake"]


def no_dcp():
    """SGLang's parallel context without decode context parallelism (the pools' write paths read it)."""
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False)


def stock_dsa_pools(token_counts: list[int], page_size: int) -> list:
    """SGLang's stock (non-CP) bf16 ``DSATokenToKVPool`` of the tiny ``dsa`` model on CPU, one per count.

    Built outside decode context parallelism (``dcp_replicated``): the unsharded layout the CP-shared
    pools are compared with, and the pool a non-CP decode server holds.
    """
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    pools = []
    with no_dcp():
        for tokens in token_counts:
            pool = DSATokenToKVPool(tokens, **_dsa_pool_kwargs(page_size))
            pool.dcp_replicated = True
            pools.append(pool)
    return pools


def sharded_dsa_pools(tokens: int, page_size: int, cp_size: int) -> list:
    """The tiny ``dsa`` model's ``CPSharedDSATokenToKVPool`` of each of ``cp_size`` ranks (``tokens`` rows each),
    built directly, with no CP group: what a decode sharded by page ownership holds (Mooncake writes it)."""
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedDSATokenToKVPool

    kw = _dsa_pool_kwargs(page_size)
    with no_dcp():
        return [
            CPSharedDSATokenToKVPool(tokens, cp_rank=r, cp_size=cp_size, cp_group=lambda: None, **kw)
            for r in range(cp_size)
        ]


def _dsa_pool_kwargs(page_size: int) -> dict:
    """SGLang's DSA pool arguments of the tiny ``dsa`` model on CPU (bf16 latent rows)."""
    import torch

    dsa = MODELS["dsa"]
    return dict(
        page_size=page_size,
        kv_lora_rank=dsa["kv_lora_rank"],
        dtype=torch.bfloat16,
        qk_rope_head_dim=dsa["qk_rope_head_dim"],
        layer_num=dsa["num_hidden_layers"],
        device="cpu",
        index_head_dim=dsa["index_head_dim"],
        enable_memory_saver=False,
        kv_cache_dim=dsa["kv_lora_rank"] + dsa["qk_rope_head_dim"],
    )


def configurator(model_config, page_size: int):
    """SGLang's ``KVCacheConfigurator`` with the attributes its pool and allocator builders read (no model runner)."""
    import types

    import torch
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    c = object.__new__(KVCacheConfigurator)
    c.model_config, c.kv_cache_dtype, c.device = model_config, torch.bfloat16, "cpu"
    c.is_draft_worker, c.is_hybrid_swa, c.hybrid_gdn_config = False, False, None
    c.kv_shard_rank, c.kv_shard_size, c.kv_shard_spec = None, 1, None
    c.layer_info = types.SimpleNamespace(num_effective_layers=2, start_layer=0, end_layer=2)
    c.page_size, c.use_mla_backend = page_size, True
    c.kv_cache_dtype_str, c.mambaish_config = "bfloat16", None
    return c


def build_pool_and_allocator(
    model_config, tokens: int, max_running: int, page_size: int, cp: tuple[int, int] | None = None
) -> tuple:
    """SGLang's configurator builds (through the plugin's hooks, when the flag is on) the DSA pool of ``tokens``
    and its allocator; ``cp``: as CP rank ``cp[0]`` of ``cp[1]`` (else in the caller's parallel context)."""
    import contextlib
    import types

    import torch
    from sglang.srt.runtime_context import get_parallel

    ctx = contextlib.nullcontext()
    if cp is not None:
        ctx = get_parallel().override(
            attn_cp_rank=cp[0], attn_cp_size=cp[1], attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False
        )
    with ctx:
        conf = configurator(model_config, page_size)
        req_pool = types.SimpleNamespace(req_to_token=torch.zeros((max_running, 1), dtype=torch.int32))
        sizes = types.SimpleNamespace(max_total_num_tokens=tokens)
        pool = conf._build_token_to_kv_pool(  # SGLang's pool dispatch, where it picks the DSA pool's class
            sizes=sizes, is_dsa_model=True, is_dsv4_model=False, req_to_token_pool=req_pool
        )
        alloc = conf._build_token_to_kv_pool_allocator(
            sizes=sizes,
            token_to_kv_pool=pool,
            is_dsv4_model=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=None,
        )
    return pool, alloc


def kv_args(pool, aux, engine_rank: int, page_size: int):
    """SGLang's ``KVArgs`` of a DSA pool (latent buffers, indexer pages as DSA state) and an aux buffer."""
    from sglang.srt.disaggregation.base.conn import KVArgs, StateType

    a = KVArgs()
    a.engine_rank, a.pp_rank, a.system_dp_rank, a.page_size = engine_rank, 0, 0, page_size
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = (list(x) for x in pool.get_contiguous_buf_infos())
    a.kv_layer_ids, a.kv_cache_dtype_str, a.kv_layout = [], "bfloat16", None
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [aux.data_ptr()], [aux.nbytes], [aux[0].nbytes]
    ptrs, lens, item_lens = pool.get_state_buf_infos()
    a.state_types = [StateType.DSA]
    a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [list(ptrs)], [list(lens)], [list(item_lens)]
    a.state_layer_ids, a.state_dim_per_tensor, a.state_slice_outer_counts = [[]], [[]], [[]]
    a.state_conv_shard_groups, a.is_hybrid_mla_backend, a.mla_compression_ratios = [[]], False, None
    a.num_draft_entries, a.prefill_start_layer, a.prefill_end_layer = 0, 0, None
    return a


def mooncake_manager(mode, engine, kv_args, rank: int, cp_size: int, host: str = "127.0.0.1") -> Any:
    """SGLang's ``MooncakeKVManager`` with the attributes its connector methods read, its socket on ``host``.

    Its ``__init__`` needs SGLang's distributed groups, a bootstrap HTTP server and a model runner;
    this sets what that would derive (``kv_shard_rank`` / ``kv_shard_size`` from the CP group).
    """
    import threading
    import types
    from collections import defaultdict

    import requests
    import zmq
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.utils.network import get_zmq_socket_on_host

    m = object.__new__(MooncakeKVManager)
    m.kv_args, m.engine, m.disaggregation_mode = kv_args, engine, mode
    m.server_args = types.SimpleNamespace(enable_pd_role_switch=False)
    m.is_mla_backend, m.is_hybrid_mla_backend = True, False
    m.kv_cache_dtype_str, m.kv_layout, m.dsv41_spec_layout = "bfloat16", None, None
    m.kv_item_lens_sum = sum(kv_args.kv_item_lens)
    m.state_item_lens_sum = sum(x for comp in kv_args.state_item_lens for x in comp)
    m._kv_replica_factor = None
    m.attn_tp_size, m.attn_tp_rank, m.pp_size, m.pp_rank, m.dcp_size, m.dcp_rank = 1, 0, 1, 0, 1, 0
    m.attn_cp_size, m.attn_cp_rank = cp_size, rank
    m.attn_dp_size, m.attn_dp_rank, m.system_dp_size, m.system_dp_rank = 1, 0, 1, 0
    m.kv_shard_rank, m.kv_shard_size = rank, cp_size  # what __init__ derives from the CP group
    m.enable_all_cp_ranks_for_transfer, m.is_dummy_cp_rank = cp_size > 1, False
    m.local_ip = host
    m._zmq_ctx = zmq.Context()
    m.rank_port, m.server_socket = get_zmq_socket_on_host(m._zmq_ctx, zmq.PULL, host=host)
    m.request_status, m.failure_records, m.failure_lock = {}, {}, threading.Lock()
    m._socket_cache, m._monitor_cache, m._socket_send_locks, m._socket_lock = {}, {}, {}, threading.Lock()
    m._staging_outstanding, m._deferred_ack_targets, m._deferred_ack_poisoned_rooms = defaultdict(int), {}, set()
    m.defer_decode_allocation, m.deferred_bootstrap, m.enable_deferred_decode_kv_release = False, None, False
    m.enable_staging, m._staging_handler, m.enable_trace = False, None, False
    m._stopped, m._worker_threads, m._dcp_pack_buffers, m._dcp_pack_max_tokens = False, [], None, None
    m.enable_custom_mem_pool, m.custom_mem_pool_type, m.max_transfer_batch_indices = False, None, 0
    m.session_lock, m.state_strides_validated, m.state_layout_rejections = threading.Lock(), set(), {}
    m.failed_sessions, m.session_failures, m.failed_session_probes = set(), defaultdict(int), {}
    if mode == DisaggregationMode.PREFILL:
        m.transfer_infos, m.req_to_decode_prefix_len, m.decode_kv_args_table = {}, {}, {}
        m.bootstrap_timeout, m.bootstrap_port = 300, 1
    else:
        m.connection_pool, m.connection_lock, m.prefill_info_table = {}, threading.Lock(), {}
        m.required_prefill_response_num_table, m.prefill_response_tracker = {}, {}
        m.heartbeat_failures, m.session_pool, m.session_pool_lock = {}, defaultdict(requests.Session), threading.Lock()
        m.addr_to_rooms_tracker, m._deferred_abort_ack_tracker, m._deferred_abort_generation = defaultdict(set), {}, 0
        m.heartbeat_interval, m.max_failures, m._heartbeat_shutdown = 3600.0, 3, threading.Event()
        m.waiting_timeout = 300
    return m


def prefill_info(cp_size: int, page_size: int, sharded: bool = True):
    """What a decode server learns of a prefill server with ``cp_size`` CP ranks (SGLang's record); ``sharded``:
    its KV cache sharded over them, else each rank holds it whole."""
    from sglang.srt.disaggregation.common.conn import PrefillServerInfo

    return PrefillServerInfo(
        attn_tp_size=1,
        attn_cp_size=cp_size,
        dp_size=1,
        pp_size=1,
        page_size=page_size,
        kv_cache_dtype="bfloat16",
        follow_bootstrap_room=False,
        enable_kv_cache_sharding=sharded,
    )


def radix_cache(allocator, max_requests: int, max_context: int, disable: bool = False) -> tuple:
    """SGLang's ``UnifiedRadixCache`` (the Python tree core the flag selects) over ``allocator`` and a
    ``ReqToTokenPool`` of ``max_requests`` rows of ``max_context`` tokens, as a scheduler builds them;
    ``disable``: as with ``--disable-radix-cache``. Returns ``(req_to_token_pool, tree)``."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    req_to_token = ReqToTokenPool(
        size=max_requests, max_context_len=max_context, device="cpu", enable_memory_saver=False
    )
    tree = UnifiedRadixCache(
        CacheInitParams(
            disable=disable,
            req_to_token_pool=req_to_token,
            token_to_kv_pool_allocator=allocator,
            page_size=allocator.page_size,
            tree_components=(ComponentType.FULL,),
        )
    )
    return req_to_token, tree


def new_request_locs(allocator, tokens: int):
    """int64 ``[tokens]``: the locs SGLang's allocator gives a new request of ``tokens`` tokens in one extend
    (no prefix; under the owner-rotating allocator a new chain, its rotation base drawn)."""
    import torch

    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    return allocator.alloc_extend(t(0), t(0), t(tokens), t(tokens), t(0), tokens, rotation_bases=[None]).long()


def extend_allocation(allocator, max_requests: int, max_context: int):
    """SGLang's extend-batch allocation (``alloc_paged_token_slots_extend``) as its scheduler runs it with
    ``--disable-radix-cache``: a disabled ``UnifiedRadixCache`` over ``allocator``, so a request's first
    chunk draws a new rotation base and every later chunk continues the base SGLang recorded on the request
    (``req.kv_rotation_base``): the request's k-th page is on owner ``(base + k) % cp_size``.

    Returns ``alloc(reqs, prefix_lens, seq_lens, last_locs) -> locs`` for one batch; ``reqs`` are objects
    with ``last_node`` and ``kv_rotation_base`` (SGLang's ``Req`` fields this path reads and writes).
    """
    import torch
    from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend

    _, tree = radix_cache(allocator, max_requests, max_context, disable=True)

    def alloc(reqs: list, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> torch.Tensor:
        prefix, seq = torch.tensor(prefix_lens), torch.tensor(seq_lens)
        return alloc_paged_token_slots_extend(
            tree,
            prefix,
            prefix,
            seq,
            seq,
            torch.tensor(last_locs),
            int((seq - prefix).sum()),
            batch=SimpleNamespace(reqs=reqs),
        )

    return alloc
