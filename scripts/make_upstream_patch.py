"""Write the CP-shared KV cache as a ``git format-patch`` series against SGLang 0.5.23, from the plugin.

    python scripts/make_upstream_patch.py            # -> dist/upstream/*.patch
    python scripts/make_upstream_patch.py --stat     # also print the series' diff stat

The plugin is the one source: this script reads its current ``srt/`` modules and tests, puts each
module where SGLang keeps its kind (``HOMES``), rewrites our imports to those homes, and turns every
hook the plugin registers (``sglang_wiring.hooks.HOOKS`` and ``RESOLUTION_HOOKS``) into a
direct edit at its place in SGLang's source (``SITES``). A hook added, renamed or moved in the plugin
without a site here, or a site whose SGLang text no longer matches, stops the script with one line.

The base tree is the SGLang the environment has installed (the 0.5.23 wheel's Python sources, laid
out as ``python/sglang/...`` as in SGLang's repository); only the files the series edits are copied
into the temporary base repository, which leaves the patches the same as against the whole tree.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_layout import WIDTH, LayoutError, layout, long_lines  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PKG = "sglang_cp_shared_kv"
SRC = ROOT / "python" / PKG
SGLANG_VERSION = "0.5.23"
DEFAULT_OUT = ROOT / "dist" / "upstream"

# Where each of our modules lives in SGLang: (our module or package prefix, SGLang's), first match
# wins. A package prefix ends with "." and maps every module under it.
HOMES: list[tuple[str, str]] = [
    ("srt.environ", "srt.environ"),  # its fields join SGLang's Envs (ENV_FIELDS_AFTER), not a file of its own
    ("srt.sglang_wiring.flag", "srt.arg_groups.cp_shared_kv_flag"),
    ("srt.sglang_wiring.startup_checks", "srt.arg_groups.cp_shared_kv_checks"),
    ("srt.sglang_wiring.sharded_kv_pool", "srt.mem_cache.cp_shared_kv.sharded_kv_pool"),
    ("srt.sglang_wiring.pool_hooks", "srt.mem_cache.cp_shared_kv.pool_selection"),
    ("srt.sglang_wiring.view_arena", "srt.mem_cache.cp_shared_kv.view_arena"),
    ("srt.sglang_wiring.read_mode", "srt.mem_cache.cp_shared_kv.read_mode"),
    ("srt.sglang_wiring.metrics", "srt.mem_cache.cp_shared_kv.metrics"),
    ("srt.sglang_wiring.connector_bounds", "srt.disaggregation.common.room_bounds"),
    ("srt.sglang_wiring.connector_sockets", "srt.disaggregation.mooncake.cp_shared_kv.connector_sockets"),
    ("srt.sglang_wiring.transfer", "srt.disaggregation.mooncake.cp_shared_kv.transfer"),
    ("srt.sglang_wiring.decode_manifest", "srt.disaggregation.mooncake.cp_shared_kv.decode_manifest"),
    ("srt.sglang_wiring.plugin_state", "srt.disaggregation.mooncake.cp_shared_kv.manager_state"),
    ("srt.utils", "srt.mem_cache.cp_shared_kv.utils"),
    ("srt.mem_cache.", "srt.mem_cache.cp_shared_kv."),
    ("srt.distributed.", "srt.distributed.cp_shared_kv."),
    ("srt.layers.attention.nsa.", "srt.layers.attention.dsa.cp_shared_kv."),
    ("srt.disaggregation.mooncake.", "srt.disaggregation.mooncake.cp_shared_kv."),
]
# The plugin's own machinery (entry point, hook registration, the flag's argparse hook) and empty
# namespace packages: not part of the series.
PLUGIN_ONLY = {
    "srt",
    "srt.plugin",
    "srt.sglang_wiring",
    "srt.sglang_wiring.hooks",
    "srt.sglang_wiring.connector_sockets",  # the series fixes SGLang's _connect itself
    "srt.layers",
    "srt.layers.attention",
    "srt.disaggregation",
}
# Built and tested here, not wired into SGLang yet: not part of the series until it is.
UNWIRED = {
    "srt.layers.attention.nsa.decode_cp",
    "srt.layers.attention.nsa.decode_cp_checks",
    "srt.sglang_wiring.decode_routes",
    "srt.sglang_wiring.decode_server",
}
# The plugin's hooks of the decode CP server (a decode pool sharded by page ownership over --dcp-size
# ranks): the plugin runs it, the series does not carry it yet (its startup rules refuse --dcp-size on a
# decode there).
_MOONCAKE = "sglang.srt.disaggregation.mooncake.conn"
_DSA = "sglang.srt.layers.attention.dsa"
_DSA_BACKEND = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"
UNWIRED_HOOKS = [
    ("sglang.srt.disaggregation.common.conn.CommonKVManager.requires_dcp_relayout", "keep_pages_whole"),
    (f"{_MOONCAKE}.MooncakeKVManager.send_kvcache", "send_to_owner"),
    (f"{_MOONCAKE}.MooncakeKVManager.maybe_send_extra", "send_state_to_owner"),
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue._transfer_page_indices", "transfer_pages"),
    ("sglang.srt.disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info", "prefill_info"),
    (f"{_DSA}.dsa_indexer_metadata.DSAIndexerMetadata.get_page_table_64", "indexer_page_table"),
    (f"{_DSA}.dsa_indexer_metadata.DSAIndexerMetadata.topk_transform", "indexer_topk"),
    (f"{_DSA_BACKEND}.__init__", "decode_heads"),
    (f"{_DSA_BACKEND}.forward_decode", "decode_attention"),
    ("sglang.srt.arg_groups.model_overrides.deepseek_v2._dsa_dcp_overrides", "dsa_dcp_overrides"),
]
FIXES = 2  # the series' first commits: fixes of SGLang's KV connector for every PD deployment, no flag
# Our other top-level packages (the benchmark harness's stacks, etc.) are not part of the series.
SHIPPED_ROOT = "srt"

# The docstring of each new SGLang package.
PACKAGE_DOCS = {
    "srt.mem_cache.cp_shared_kv": "CP-shared KV cache (``--enable-cp-shared-kv``): page ownership, the sharded MLA/DSA "
    "pools and their view arena.",
    "srt.distributed.cp_shared_kv": "CP-shared KV cache: the CP group's collectives for the view all-gather.",
    "srt.layers.attention.dsa.cp_shared_kv": "CP-shared KV cache: the per-batch slot plan, the materialized views "
    "and their Triton kernels, and the read state the DSA backend consumes.",
    "srt.disaggregation.mooncake.cp_shared_kv": "CP-shared KV cache over Mooncake PD: each prefill rank's page "
    "manifest, and the decode side's check of it.",
}

# Regex edits of shipped modules' prose that describes the plugin's hook machinery: (our module or "*",
# pattern, replacement, how many matches at least). A module-specific one that stops matching stops the
# generator, so the prose never silently goes stale.
PROSE: list[tuple[str, str, str, int]] = [
    # Pointers to the plugin's own documentation, which SGLang does not carry.
    ("*", r" ?\(``docs/sglang_plugin\.md``[^)]*\)", "", 0),
    ("*", r" ?\(the table in\s+``docs/sglang_plugin\.md``\)", "", 0),
]
# Words of the plugin's hook machinery that no shipped module may say once the edits above are made
# (its docstrings say what a function does at its SGLang call site, which holds in both forms).
PLUGIN_PROSE = re.compile(
    r"\bAROUND\b|\bAFTER hook|HookRegistry|register_resolution_hook|sglang_wiring|hook_rejections|plugin hook"
)


@dataclass
class Commit:
    key: str
    subject: str
    body: str
    homes: tuple[str, ...] = ()  # SGLang modules (packages: ending in ".") whose new files go in this commit
    # The project's tests (file names under test/, optionally ::test) that pass from this commit on: CI runs
    # them, with every module of the prefix imported, on the series applied up to each commit.
    tests: tuple[str, ...] = ()
    # SGLang-style tests this commit adds to SGLang's tree: (our file's name under test/, its path there).
    carries: tuple[tuple[str, str], ...] = ()


COMMITS = [
    Commit(
        "sockets",
        "[PD] Retry a KV status socket whose first connect failed",
        """\
CommonKVManager._connect makes one PUSH socket per peer and caches it, with RECONNECT_IVL = -1. A
socket made while its peer cannot be reached (not listening yet, or a network partition) fails its
connect, ZMQ never retries it and reports no disconnect, so the cached socket silently drops every
status message sent on it: the decode waits for a Success that never comes. A reconnect interval
makes it connect once the peer is there; a disconnect after a connection still replaces the socket
through the monitor as before. Independent of the rest of the series.""",
        tests=("test_status_socket_reconnect.py",),
        carries=(
            ("test_status_socket_reconnect.py", "test/registered/unit/disaggregation/test_status_socket_reconnect.py"),
        ),
    ),
    Commit(
        "rooms",
        "[PD] Bound the prefill rooms that late destinations reopen",
        """\
Two tables of a prefill KV manager outlive their request. Destinations that reach a prefill rank after
its sender was cleared (a retried or slow decode) make the bootstrap thread record the room again
(transfer_infos, req_to_decode_prefix_len, request_status) with no sender left to clear it, and
_deferred_ack_poisoned_rooms keeps a failed batch's room for ever; a long-running prefill grows both
without bound. A room is now live from its sender's Bootstrapping until its clear, then closed for the
waiting plus deferred-release timeouts: destinations reaching a closed room are dropped, destinations no
sender claims within the window are dropped, and a closed room's poison is released when its window
ends. Independent of the rest of the series.""",
        ("srt.disaggregation.common.room_bounds",),
        tests=("test_prefill_room_bounds.py",),
        carries=(("test_prefill_room_bounds.py", "test/registered/unit/disaggregation/test_prefill_room_bounds.py"),),
    ),
    Commit(
        "ownership",
        "[CP shared KV] page ownership, KV row sizes and the CP group's collectives",
        """\
Prefill context parallelism over N ranks stores every page of the persistent MLA latent and DSA
indexer KV on all N ranks. These modules hold what sharding it needs below the pools: page lp is
owned by rank lp % N (the arithmetic of the page-interleave allocator), the byte sizes of the fp8
and bf16 rows and the indexer's pages, the view arena's sizes, and the gloo/NCCL collectives that all-gather
a batch's views across the CP group. Nothing calls them yet.""",
        ("srt.mem_cache.cp_shared_kv.", "srt.distributed.cp_shared_kv."),
        (
            "test_cp_shared_kv_ownership.py",
            "test_placement.py",
        ),
        (("test_cp_shared_kv_ownership.py", "test/registered/unit/mem_cache/test_cp_shared_kv_ownership.py"),),
    ),
    Commit(
        "views",
        "[CP shared KV] per-batch slot plan, materialized views and their Triton kernels",
        """\
The stock DSA/MLA kernels read a dense page table. Per batch, a sync-free slot plan (static shapes,
host-known sizes from seq_lens_cpu) gives each of the batch's page positions a slot in an owner-major
view; per layer, each rank gathers its owned pages into its block and the CP group all-gathers the
blocks, so the kernels run unchanged on the view. A batch that reads only its current chunk reuses the
gathered current tensors and moves nothing. Every kernel has a plain-torch reference beside it. A
small model of the layer and the pull decides whether the views are gathered one layer ahead.""",
        ("srt.layers.attention.dsa.cp_shared_kv.", "srt.mem_cache.cp_shared_kv.read_mode"),
        ("test_cp_shared_kv_slot_plan.py", "test_slot_plan.py"),
        (
            (
                "test_cp_shared_kv_slot_plan.py",
                "test/registered/unit/layers/attention/test_cp_shared_kv_slot_plan.py",
            ),
        ),
    ),
    Commit(
        "flag",
        "[CP shared KV] --enable-cp-shared-kv and its startup checks",
        """\
The flag joins the parallel argument group next to --enable-kv-cache-sharding. Its checks run at two
resolution steps: flag-only checks with validate_prefill_cp_platform, model and resolved-value checks
with handle_kv_cache_sharding (twice, idempotent). Every rejection is one line naming the flag and
the fix; prefill CUDA graphs are declared off (the read plan runs eagerly). With the flag off both
steps run as before; with it on, until the next commit builds the pools, the checks are all it does.""",
        ("srt.arg_groups.cp_shared_kv_flag", "srt.arg_groups.cp_shared_kv_checks"),
        (
            "test_cp_shared_kv_flag.py",
            "patched_tree_checks.py::test_sglang_is_the_patched_copy_and_the_plugin_is_not_importable",
            "patched_tree_checks.py::test_the_flag_is_a_server_args_field",
        ),
        (("test_cp_shared_kv_flag.py", "test/registered/unit/arg_groups/test_cp_shared_kv_flag.py"),),
    ),
    Commit(
        "pools",
        "[CP shared KV] sharded MLA/DSA pools behind the kv-shard contract, read state in the backend",
        """\
The CP-shared pools subclass MLATokenToKVPool / DSATokenToKVPool with the same constructor arguments,
write only the rows their rank owns (a masked store), and serve the kv-shard contract the DSA backend,
its indexer and FA3 already call for --enable-kv-cache-sharding (translated page tables,
get_key_buffer, logical indexer pages) from the batch's read state: the current-reuse path or the
materialized view. The configurator builds them and SGLang's owner-rotating PageInterleavePoolAllocator
over them when the flag is on, charges the view arena to the KV budget in place of the sharding
scratch, and batch admission stays inside the arena. Each extend batch's shared-prefix hint comes
from the radix tree through ForwardBatch.init_new.""",
        (
            "srt.layers.attention.dsa.cp_shared_kv.read_state",
            "srt.mem_cache.cp_shared_kv.metrics",
            "srt.mem_cache.cp_shared_kv.sharded_kv_pool",
            "srt.mem_cache.cp_shared_kv.pool_selection",
            "srt.mem_cache.cp_shared_kv.view_arena",
        ),
        (
            "test_cp_shared_kv_read_state.py",
            "patched_tree_checks.py::test_the_sites_call_the_patched_modules",
            "patched_tree_checks.py::test_with_the_flag_off_sglang_builds_its_own_pool_and_allocator",
            "test_plugin_sharded_pool.py::test_sglang_pools_store_exactly_the_owned_rows",
            "test_read_state.py",
            "test_view_arena.py",
            "test_view_arena_size.py",
        ),
        (("test_cp_shared_kv_read_state.py", "test/registered/unit/mem_cache/test_cp_shared_kv_read_state.py"),),
    ),
    Commit(
        "pd",
        "[CP shared KV] PD over Mooncake: each prefill rank's page manifest, checked on the decode",
        """\
Each prefill CP rank sends only its owned pages through the sharded sender, each at its logical page
position, and its Success status carries a manifest of those positions. The non-CP decode server
collects every rank's manifest before a request is ready and fails it with the reason if they do not
cover its pages exactly once.""",
        ("srt.disaggregation.mooncake.cp_shared_kv.",),
        (
            "test_cp_shared_kv_manifest.py",
            "test_mooncake_manifest.py",
        ),
        (
            (
                "test_cp_shared_kv_manifest.py",
                "test/registered/unit/disaggregation/test_cp_shared_kv_manifest.py",
            ),
        ),
    ),
]


@dataclass
class Site:
    """One hook of the plugin as a direct edit of SGLang's source.

    ``covers``: the plugin's ``(target, hook name)`` pairs (or ``("resolution:<step>", check name)``)
    this edit stands for. ``old`` must occur ``count`` times in ``path``; ``{import:name}`` in ``new``
    becomes ``from <home of name's module> import name`` (so a hook that moves between our modules
    moves here with it).
    """

    commit: str
    path: str  # under python/sglang/
    old: str
    new: str
    covers: list[tuple[str, str]] = field(default_factory=list)
    count: int = 1


_CFG = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_COMMON = "sglang.srt.disaggregation.common.conn"

SITES: list[Site] = [
    # -- bounded prefill rooms (a fix for every prefill manager, before the feature)
    Site(
        "rooms",
        "srt/disaggregation/common/conn.py",
        "        self._deferred_ack_poisoned_rooms: Set[int] = set()\n",
        """\
        self._deferred_ack_poisoned_rooms: Set[int] = set()
        {import:RoomBounds}
        {import:window_s}

        # A prefill's rooms outlive their request only for a window (late
        # destinations, poison).
        self._room_bounds = (
            RoomBounds(window_s())
            if disaggregation_mode == DisaggregationMode.PREFILL
            else None
        )
""",
    ),
    Site(
        "rooms",
        "srt/disaggregation/common/conn.py",
        """\
    def update_status(self, bootstrap_room: int, status: KVPoll):
        current = self.request_status.get(bootstrap_room)
""",
        """\
    def update_status(self, bootstrap_room: int, status: KVPoll):
        {import:admit_status}

        bounds = self._room_bounds
        if bounds is not None and not admit_status(
            bounds, self, bootstrap_room, status
        ):
            return  # destinations of a cleared room: nobody will send
        current = self.request_status.get(bootstrap_room)
""",
        [(f"{_COMMON}.CommonKVManager.update_status", "guard_update_status")],
    ),
    Site(
        "rooms",
        "srt/disaggregation/common/conn.py",
        """\
    def clear(self) -> None:
        notification = None
""",
        """\
    def clear(self) -> None:
        # Only the room's owner closes it (a duplicate sender under a deferred
        # bootstrap clears nothing).
        owner = self.kv_mgr.deferred_bootstrap is None or self._owns_bootstrap_room
        self._clear_room()
        if owner and self.kv_mgr._room_bounds is not None:
            {import:room_cleared}

            room_cleared(self.kv_mgr._room_bounds, self.kv_mgr, self.bootstrap_room)

    def _clear_room(self) -> None:
        notification = None
""",
        [(f"{_COMMON}.CommonKVSender.clear", "close_room")],
    ),
    # -- the pools and the allocator, where the configurator builds them
    Site(
        "pools",
        "srt/mem_cache/kv_cache_configurator.py",
        """\
        dsa_pool_class: type,
    ) -> KVCache:
        from sglang.srt.layers.cp.utils import get_glm_dsa_cp_layer_shard_info
""",
        """\
        dsa_pool_class: type,
    ) -> KVCache:
        {import:builds_cp_shared_pool}
        {import:cp_shared_pool_class}

        if builds_cp_shared_pool(self):
            dsa_pool_class = cp_shared_pool_class("dsa")
        from sglang.srt.layers.cp.utils import get_glm_dsa_cp_layer_shard_info
""",
        [(f"{_CFG}._build_dsa_kv_pool", "build_dsa_kv_pool")],
    ),
    Site(
        "pools",
        "srt/mem_cache/kv_cache_configurator.py",
        """\
    def _build_mla_kv_pool(
        self, *, max_total_num_tokens: int, mla_pool_class: type
    ) -> KVCache:
""",
        """\
    def _build_mla_kv_pool(
        self, *, max_total_num_tokens: int, mla_pool_class: type
    ) -> KVCache:
        {import:builds_cp_shared_pool}
        {import:cp_shared_pool_class}

        if builds_cp_shared_pool(self):
            mla_pool_class = cp_shared_pool_class("mla")
""",
        [(f"{_CFG}._build_mla_kv_pool", "build_mla_kv_pool")],
    ),
    Site(
        "pools",
        "srt/mem_cache/kv_cache_configurator.py",
        """\
    ) -> BaseTokenToKVPoolAllocator:
        # Initialize token_to_kv_pool_allocator
""",
        """\
    ) -> BaseTokenToKVPoolAllocator:
        {import:build_allocator}
        {import:is_cp_shared_pool}

        if is_cp_shared_pool(token_to_kv_pool) and token_to_kv_pool_allocator is None:
            # The owner-rotating allocator, its admission held to the view arena.
            return build_allocator(self, token_to_kv_pool, sizes.max_total_num_tokens)
        # Initialize token_to_kv_pool_allocator
""",
        [(f"{_CFG}._build_token_to_kv_pool_allocator", "build_allocator")],
    ),
    Site(
        "pools",
        "srt/mem_cache/kv_cache_configurator.py",
        """\
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
        )
""",
        """\
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
        )
        {import:builds_cp_shared_pool}
        {import:check_built_pools}
        {import:report_pools}

        if builds_cp_shared_pool(self):
            # Refuse a pool or allocator that is not CP-shared, then the startup line.
            check_built_pools(pools.token_to_kv_pool, pools.token_to_kv_pool_allocator)
            report_pools(pools.token_to_kv_pool, pools.token_to_kv_pool_allocator)
""",
        [(f"{_CFG}._init_pools", "built_pools")],
    ),
    Site(
        "pools",
        "srt/model_executor/pool_configurator.py",
        """\
        self._fixed_overhead_bytes = compute_page_shard_scratch_bytes(
            kvc,
            include_mtp=not kvc.is_draft_worker and kvc.spec_algorithm.is_eagle(),
        )
""",
        """\
        {import:builds_cp_shared_pool}
        {import:charge_arena}

        if builds_cp_shared_pool(kvc):
            # --enable-cp-shared-kv charges its view arena instead.
            self._fixed_overhead_bytes = charge_arena(kvc)
        else:
            self._fixed_overhead_bytes = compute_page_shard_scratch_bytes(
                kvc,
                include_mtp=not kvc.is_draft_worker and kvc.spec_algorithm.is_eagle(),
            )
""",
        [("sglang.srt.model_executor.pool_configurator.compute_page_shard_scratch_bytes", "charge_arena")],
    ),
    Site(
        "pools",
        "srt/managers/schedule_policy.py",
        """\
                    "assembly scratch"
                )
            return False
""",
        """\
                    "assembly scratch"
                )
            {import:log_deferred}
            {import:count_deferral}

            # --enable-cp-shared-kv: say why the request waits, and count it.
            log_deferred(self, prefix_len, extend_len)
            count_deferral(self)
            return False
""",
        [("sglang.srt.managers.schedule_policy.PrefillAdder._kv_shard_reserve_scratch", "deferred")],
    ),
    Site(
        "pools",
        "srt/model_executor/forward_batch_info.py",
        """\
        return ret

    def _maybe_init_non_generation_fields""",
        """\
        {import:is_cp_shared_pool}
        {import:hint_shared_prefix}

        if is_cp_shared_pool(model_runner.token_to_kv_pool):
            # The shared-prefix hint of an extend batch, for the pool's read plan.
            hint_shared_prefix(ret, batch, model_runner.token_to_kv_pool)
        return ret

    def _maybe_init_non_generation_fields""",
        [("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", "hint_shared_prefix")],
    ),
    Site(
        "pools",
        "srt/layers/attention/kv_shard_hooks.py",
        """\
    \"\"\"Update the pool's gather plan and report whether this is an extend.\"\"\"
""",
        """\
    \"\"\"Update the pool's gather plan and report whether this is an extend.\"\"\"
    {import:is_cp_shared_pool}
    {import:prepare_forward}

    if is_cp_shared_pool(pool):
        return prepare_forward(pool, req_to_token, forward_batch)
""",
        [("sglang.srt.layers.attention.kv_shard_hooks.prepare_kv_shard_forward", "prepare_forward")],
    ),
    # -- the flag's checks, after their resolution steps (every invocation of each step)
    Site(
        "flag",
        "srt/arg_groups/pipeline.py",
        "    run_hook(validate_prefill_cp_platform, server_args)\n",
        """\
    run_hook(validate_prefill_cp_platform, server_args)
    if server_args.enable_cp_shared_kv:
        {import:early_check}

        early_check(server_args)
""",
        [("resolution:validate_prefill_cp_platform", "startup_early")],
    ),
    Site(
        "flag",
        "srt/arg_groups/parallel_hook.py",
        "    run_hook(validate_prefill_cp_platform, server_args)\n",
        """\
    run_hook(validate_prefill_cp_platform, server_args)
    if server_args.enable_cp_shared_kv:
        {import:early_check}

        early_check(server_args)
""",
        [("resolution:validate_prefill_cp_platform", "startup_early")],
    ),
    Site(
        "flag",
        "srt/arg_groups/pipeline.py",
        "    run_hook(handle_kv_cache_sharding, server_args)\n",
        """\
    run_hook(handle_kv_cache_sharding, server_args)
    if server_args.enable_cp_shared_kv:
        {import:resolved_check}

        resolved_check(server_args)
""",
        [("resolution:handle_kv_cache_sharding", "startup_resolved")],
        count=2,
    ),
    # -- PD: the prefill ranks' manifests, and the decode's check
    Site(
        "pd",
        "srt/disaggregation/common/conn.py",
        """\
        kv_indices, index_slice, is_last_chunk, should_skip = (
            self._prepare_send_indices(kv_indices, state_indices)
        )
""",
        """\
        pages = kv_indices
        kv_indices, index_slice, is_last_chunk, should_skip = (
            self._prepare_send_indices(kv_indices, state_indices)
        )
        {import:runtime_enabled}

        if runtime_enabled():
            {import:check_send_indices}
            {import:record_sent_share}

            # --enable-cp-shared-kv: the positions this rank sends, for its manifest.
            check_send_indices(self, pages, kv_indices, index_slice)
            record_sent_share(self, pages, index_slice)
""",
        [(f"{_COMMON}.CommonKVSender._prepare_send_indices", "sent_share")],
    ),
    Site(
        "pd",
        "srt/disaggregation/common/conn.py",
        """\
        parts = self._encode_kv_status_message(
            bootstrap_room=bootstrap_room,
            status=status,
            failure_reason=failure_reason,
        )
""",
        """\
        parts = self._encode_kv_status_message(
            bootstrap_room=bootstrap_room,
            status=status,
            failure_reason=failure_reason,
        )
        {import:manifest_frames}

        # A CP-shared prefill rank's Success carries its page manifest.
        frames = manifest_frames(self, bootstrap_room, status)
        if frames:
            parts = [*parts, *frames]
""",
        [(f"{_COMMON}.CommonKVManager._encode_kv_status_message", "attach_manifest")],
    ),
    Site(
        "pd",
        "srt/disaggregation/common/conn.py",
        "            room_cleared(self.kv_mgr._room_bounds, self.kv_mgr, self.bootstrap_room)\n",
        """\
            room_cleared(self.kv_mgr._room_bounds, self.kv_mgr, self.bootstrap_room)
        {import:drop_unsent_share}

        # --enable-cp-shared-kv: drop a share recorded for a request that never sent.
        drop_unsent_share(self)
""",
        [(f"{_COMMON}.CommonKVSender.clear", "drop_unsent_share")],
    ),
    Site(
        "pd",
        "srt/disaggregation/common/conn.py",
        """\
        device_kv_indices: Optional[npt.NDArray[np.int32]] = None,
    ):
        if self.bootstrap_infos is None:
""",
        """\
        device_kv_indices: Optional[npt.NDArray[np.int32]] = None,
    ):
        {import:arm_manifest_check}

        # --enable-cp-shared-kv (decode): expect each prefill rank's manifest.
        arm_manifest_check(self, len(kv_indices))
        if self.bootstrap_infos is None:
""",
        [(f"{_COMMON}.CommonKVReceiver.send_metadata", "arm_manifest_check")],
    ),
    Site(
        "pd",
        "srt/disaggregation/common/conn.py",
        """\
    def clear(self) -> None:
        with self._lifecycle_lock:
            self._clear()
""",
        """\
    def clear(self) -> None:
        with self._lifecycle_lock:
            self._clear()
        {import:forget_room}

        forget_room(self)
""",
        [(f"{_COMMON}.CommonKVReceiver.clear", "forget_room")],
    ),
    Site(
        "sockets",
        "srt/disaggregation/common/conn.py",
        "            sock.setsockopt(zmq.RECONNECT_IVL, -1)\n",
        """\
            # Retry a connect that fails (the peer not listening yet, or unreachable):
            # with -1 ZMQ never retries it, reports no disconnect, and this cached
            # socket drops every message sent on it. A disconnect after a connection
            # still replaces the socket (the monitor below).
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
""",
        [(f"{_COMMON}.CommonKVManager._connect", "reconnect_new_sockets")],
    ),
    Site(
        "pd",
        "srt/disaggregation/mooncake/conn.py",
        """\
    def start_decode_thread(self):
""",
        """\
    def start_decode_thread(self):
        {import:check_status_message}

""",
    ),
    Site(
        "pd",
        "srt/disaggregation/mooncake/conn.py",
        "                parsed = self.parse_kv_status_message(msg)\n",
        """\
                parsed = self.parse_kv_status_message(msg)
                # --enable-cp-shared-kv: a Success waits for every prefill manifest.
                parsed = check_status_message(self, msg, parsed)
""",
        [(f"{_COMMON}.CommonKVManager.parse_kv_status_message", "check_status_message")],
    ),
]

# The flag itself, in SGLang's parallel argument group (replaces the plugin's add_cli_args /
# from_cli_args hooks: a field of ServerArgs is parsed, copied and pickled like any other).
# Our environment variables, declared in SGLang's ``Envs`` beside ``--enable-kv-cache-sharding``'s own
# (the ``Envs`` body of our ``srt/environ.py``, which reads them the same way without SGLang).
ENV_MODULE = "srt.environ"
ENV_FIELDS_AFTER = "    SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER = EnvBool(True)\n"


def env_fields() -> str:
    """The body of our ``Envs`` class, as lines of SGLang's."""
    text = (SRC / "srt" / "environ.py").read_text()
    body = re.search(r"^class Envs:\n(.*?)\n\n", text, re.MULTILINE | re.DOTALL)
    if body is None:
        raise GenerationError(f"{PKG}.{ENV_MODULE}: no class Envs")
    return body[1] + "\n"


SITES.append(Site("ownership", "srt/environ.py", ENV_FIELDS_AFTER, ENV_FIELDS_AFTER + env_fields()))

FLAG_SITES_COVER = [
    ("sglang.srt.server_args.ServerArgs.add_cli_args", "add_flag"),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", "copy_flag"),
]


class GenerationError(RuntimeError):
    """The plugin and this script's tables disagree, or SGLang's source is not the one the sites expect."""


# ---------------------------------------------------------------------------------------------------
# Our modules and their homes


def our_modules() -> dict[str, Path]:
    """Every module of ``sglang_cp_shared_kv.srt`` now in the checkout: ``srt.a.b`` -> its file."""
    out = {}
    for path in sorted((SRC / SHIPPED_ROOT).rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def home(mod: str) -> str:
    """SGLang's module path (``srt.x.y``) of our module ``mod``."""
    for ours, theirs in HOMES:
        if ours.endswith("."):
            if mod + "." == ours:
                return theirs[:-1]
            if mod.startswith(ours):
                return theirs + mod[len(ours) :]
        elif mod == ours:
            return theirs
    raise GenerationError(f"{PKG}.{mod} has no home in SGLang: add it to HOMES in {Path(__file__).name}")


def shipped_modules() -> dict[str, Path]:
    mods = {m: p for m, p in our_modules().items() if m not in PLUGIN_ONLY and m not in UNWIRED}
    homes: dict[str, str] = {}
    for mod in mods:
        h = home(mod)
        if h in homes:
            raise GenerationError(f"{PKG}.{mod} and {PKG}.{homes[h]} both map to sglang.{h}")
        homes[h] = mod
    return mods


def prefix_modules(count: int) -> list[str]:
    """The SGLang modules the first ``count`` commits add or edit: each must import at that prefix."""
    keys = {c.key for c in COMMITS[:count]}
    mods = []
    for mod, path in shipped_modules().items():
        if mod != ENV_MODULE and _commit_of(home_file(home(mod), path.name == "__init__.py")) in keys:
            mods.append("sglang." + home(mod))
    edited = {s.path for s in SITES if s.commit in keys} | (set(FLAG_FILES) if "flag" in keys else set())
    mods += ["sglang." + p.removesuffix(".py").replace("/", ".") for p in edited]
    return sorted(mods)


def home_file(sglang_mod: str, is_package: bool) -> str:
    rel = sglang_mod.replace(".", "/")
    return f"python/sglang/{rel}/__init__.py" if is_package else f"python/sglang/{rel}.py"


_FROM_RE = re.compile(
    rf"^(?P<indent>[ \t]*)from {PKG}\.(?P<mod>[\w.]+) import (?P<names>\([^)]*\)|[^\n]+)$", re.MULTILINE
)


def rewrite_imports(text: str, modules: dict[str, Path], where: str) -> str:
    """``from sglang_cp_shared_kv.srt.X import a, b`` -> the same names from ``sglang.srt.<home of X>``.

    A name that is itself one of our modules is imported from its own home's package (as its old name).
    """

    def one(m: re.Match) -> str:
        indent, mod = m["indent"], m["mod"]
        names = [n.strip() for n in m["names"].strip("()").replace("\n", " ").split(",") if n.strip()]
        plain: list[str] = []
        lines: list[str] = []
        for item in names:
            name, _, alias = item.partition(" as ")
            sub = f"{mod}.{name.strip()}"
            if sub in modules and sub not in PLUGIN_ONLY:
                parent, _, base = home(sub).rpartition(".")
                local = alias.strip() or name.strip()
                lines.append(f"from sglang.{parent} import {base}" + (f" as {local}" if local != base else ""))
            else:
                if mod in PLUGIN_ONLY:
                    raise GenerationError(f"{where}: imports {name!r} from the plugin-only {PKG}.{mod}")
                plain.append(item)
        if plain:
            stmt = f"from sglang.{home(mod)} import {', '.join(plain)}"
            if len(indent) + len(stmt) > 120:
                stmt = (
                    f"from sglang.{home(mod)} import (\n" + "".join(f"{indent}    {n},\n" for n in plain) + f"{indent})"
                )
            lines.insert(0, stmt)
        return "\n".join(indent + line for line in lines)

    out = _FROM_RE.sub(one, text)
    if re.search(rf"\b{PKG}\.", out) or re.search(rf"^\s*import {PKG}\b", out, re.MULTILINE):
        raise GenerationError(f"{where}: a reference to {PKG} the import rewriter does not handle")
    return out


def module_text(mod: str, path: Path, modules: dict[str, Path]) -> str:
    text = path.read_text()
    for where, pattern, repl, least in PROSE:
        if where in (mod, "*"):
            text, n = re.subn(pattern, repl, text, flags=re.DOTALL)
            if n < least:
                raise GenerationError(f"{PKG}.{mod}: {pattern[:60]!r} no longer matches (update PROSE)")
    text = rename_in_prose(text, modules)
    if path.name == "__init__.py" and not text.strip():
        doc = PACKAGE_DOCS.get(home(mod))
        if doc is None:
            raise GenerationError(f"sglang.{home(mod)} is a new package without a docstring in PACKAGE_DOCS")
        text = '"""' + "\n".join(textwrap.wrap(doc, 100)) + '"""\n'
    text = rewrite_imports(text, modules, f"{PKG}.{mod}").rstrip("\n") + "\n"
    said = PLUGIN_PROSE.search(text)
    if said:
        line = text.count("\n", 0, said.start()) + 1
        raise GenerationError(f"{PKG}.{mod}:{line}: says {said.group()!r}, the plugin's hook machinery (reword it)")
    return text


def rename_in_prose(text: str, modules: dict[str, Path]) -> str:
    """``name`` or ``name.attr`` of one of our modules named otherwise in SGLang, as its SGLang name."""
    for mod in modules:
        ours, theirs = mod.rsplit(".", 1)[-1], home(mod).rsplit(".", 1)[-1]
        if ours != theirs:
            text = re.sub(rf"``(?:sglang_wiring\.)?{re.escape(ours)}(?=[.`])", f"``{theirs}", text)
    return text


# ---------------------------------------------------------------------------------------------------
# The hook sites


def plugin_hooks() -> dict[tuple[str, str], object]:
    """The plugin's current hooks: ``(target, hook name)`` -> hook (resolution checks as ``resolution:<step>``)."""
    sys.path.insert(0, str(ROOT / "python"))
    wiring = importlib.import_module(f"{PKG}.srt.sglang_wiring.hooks")
    hooks = {(t, h.__name__): h for t, h, _ in wiring.HOOKS}
    hooks.update({(f"resolution:{step}", c.__name__): c for step, c in wiring.RESOLUTION_HOOKS})
    return hooks


def our_module_of(fn: object) -> str:
    name = fn.__module__
    if not name.startswith(PKG + "."):
        raise GenerationError(f"hook {fn!r} is not one of ours")
    return name[len(PKG) + 1 :]


def check_coverage(hooks: dict[tuple[str, str], object]) -> None:
    covered = {c for s in SITES for c in s.covers} | set(FLAG_SITES_COVER) | set(UNWIRED_HOOKS)
    missing = sorted(set(hooks) - covered)
    stale = sorted(covered - set(hooks))
    if missing:
        raise GenerationError(f"plugin hooks without a site in SITES: {missing}")
    if stale:
        raise GenerationError(f"SITES for hooks the plugin no longer registers: {stale}")


def _module_of_name(name: str, modules: dict[str, Path]) -> str:
    """Our shipped module that a site's ``{import:name}`` imports from: the one defining ``name`` at top level."""
    found = [
        mod
        for mod, path in modules.items()
        if mod not in PLUGIN_ONLY
        for node in ast.parse(path.read_text()).body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name
    ]
    if len(found) != 1:
        raise GenerationError(f"{{import:{name}}}: defined in {len(found)} shipped modules, not one")
    return found[0]


def site_text(site: Site, hooks: dict[tuple[str, str], object], modules: dict[str, Path]) -> str:
    """The site's new text, each run of ``{import:name}`` lines as isort would write its imports: one
    ``from`` line per module, sorted, parenthesized where a line would pass ``WIDTH`` columns."""

    def imports(m: re.Match) -> str:
        indent = m[1]
        names: dict[str, list[str]] = {}
        for name in re.findall(r"\{import:(\w+)\}", m[0]):
            mod = _module_of_name(name, modules)
            if mod not in modules or mod in PLUGIN_ONLY:
                raise GenerationError(f"{name} lives in {PKG}.{mod}, which the series does not ship")
            names.setdefault(f"sglang.{home(mod)}", []).append(name)
        lines = []
        for mod, found in sorted(names.items()):
            line = f"{indent}from {mod} import {', '.join(sorted(found))}"
            if len(line) > WIDTH:
                inner = "".join(f"{indent}    {n},\n" for n in sorted(found))
                line = f"{indent}from {mod} import (\n{inner}{indent})"
            lines.append(line)
        return "\n".join(lines) + "\n"

    return re.sub(r"^([ \t]*)\{import:\w+\}\n(?:\1\{import:\w+\}\n)*", imports, site.new, flags=re.MULTILINE)


def apply_sites(tree: Path, commit: str, texts: list[str]) -> list[str]:
    """Apply this commit's sites to ``tree`` (``texts``: each site's ``site_text``, in ``SITES`` order); the
    SGLang files it changed."""
    changed = []
    for site, new in zip(SITES, texts):
        if site.commit != commit:
            continue
        path = tree / "python" / "sglang" / site.path
        text = path.read_text()
        n = text.count(site.old)
        if n != site.count:
            first = site.old.strip().splitlines()[0]
            raise GenerationError(f"sglang/{site.path}: {first!r} found {n} times, expected {site.count}")
        path.write_text(text.replace(site.old, new))
        changed.append(site.path)
    return changed


def flag_field(modules: dict[str, Path]) -> str:
    """The flag as a field of SGLang's parallel argument group, its help from the plugin's."""
    sys.path.insert(0, str(ROOT / "python"))
    flag = importlib.import_module(f"{PKG}.srt.sglang_wiring.flag")
    hook = importlib.import_module(f"{PKG}.srt.sglang_wiring.hooks")
    # argparse %-formats help strings: the plugin's ``%%`` stays as it is.
    help_text = re.sub(r"\s*\(sglang-cp-shared-kv plugin\)", "", hook._HELP)
    chunks = textwrap.wrap(help_text, WIDTH - 10, drop_whitespace=False, break_on_hyphens=False)
    lines = "".join(f"        {c!r}\n" for c in chunks)
    return f"    {flag.ATTR}: A[\n        bool,\n{lines}    ] = False\n"


def apply_flag(tree: Path, modules: dict[str, Path]) -> None:
    fields = tree / "python/sglang/srt/arg_groups/fields/parallel.py"
    text = fields.read_text()
    anchor = '        "disaggregation only.",\n    ] = False\n'
    if text.count(anchor) != 1:
        raise GenerationError("sglang/srt/arg_groups/fields/parallel.py: the enable_kv_cache_sharding field changed")
    fields.write_text(text.replace(anchor, anchor + flag_field(modules)))
    order = tree / "python/sglang/srt/arg_groups/field_order.py"
    text = order.read_text()
    end = '    "return_aux_hidden_state_layer_ids",\n)\n'
    if text.count(end) != 1:
        raise GenerationError("sglang/srt/arg_groups/field_order.py: the end of POSITIONAL_FIELD_ORDER changed")
    order.write_text(text.replace(end, end[:-2] + '    "enable_cp_shared_kv",\n)\n'))


FLAG_FILES = ("srt/arg_groups/fields/parallel.py", "srt/arg_groups/field_order.py")

# ---------------------------------------------------------------------------------------------------
# The series


def installed_sglang() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise GenerationError("sglang is not importable here: run with the environment that has SGLang 0.5.23")
    path = Path(list(spec.submodule_search_locations)[0])
    version = importlib.metadata.version("sglang")
    if version != SGLANG_VERSION:
        raise GenerationError(f"the series is against SGLang {SGLANG_VERSION}; {path} is SGLang {version}")
    return path


def _git(repo: Path, *args: str, **kw) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "sglang-cp-shared-kv",
        "GIT_AUTHOR_EMAIL": "cp-shared-kv@users.noreply.github.com",
        "GIT_COMMITTER_NAME": "sglang-cp-shared-kv",
        "GIT_COMMITTER_EMAIL": "cp-shared-kv@users.noreply.github.com",
        "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
        "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
    }
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env, **kw
    ).stdout


def find_test(name: str) -> Path:
    """Our test file called ``name``, wherever under ``test/`` it now is (exactly one)."""
    found = sorted((ROOT / "test").rglob(name))
    if len(found) != 1:
        raise GenerationError(
            f"{len(found)} test files named {name} under test/: update COMMITS in {Path(__file__).name}"
        )
    return found[0]


def base_files() -> list[str]:
    return sorted({s.path for s in SITES} | set(FLAG_FILES))


def build_series(out: Path) -> list[Path]:
    """Write the series into ``out`` (emptied first); the patch files in order."""
    sglang = installed_sglang()
    modules = shipped_modules()
    hooks = plugin_hooks()
    check_coverage(hooks)
    new_files: dict[str, str] = {}  # repo path -> text
    for mod, path in modules.items():
        if mod != ENV_MODULE:
            try:
                text = layout(module_text(mod, path, modules), f"{PKG}.{mod}")
            except LayoutError as e:
                raise GenerationError(str(e)) from None
            new_files[home_file(home(mod), path.name == "__init__.py")] = text

    texts = [site_text(site, hooks, modules) for site in SITES]
    check_bisect(new_files, [(site.commit, text) for site, text in zip(SITES, texts)])
    check_vocabulary(new_files, texts)
    check_plain_calls(modules, texts, sglang)
    check_line_length(new_files, texts, COMMITS)

    with tempfile.TemporaryDirectory(prefix="cp_shared_kv_upstream_") as tmp:
        repo = Path(tmp)
        for rel in base_files():
            dst = repo / "python" / "sglang" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(sglang / rel, dst)
        _git(repo, "init", "-q", "-b", "main")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"SGLang {SGLANG_VERSION} (the wheel's Python sources)")
        placed: set[str] = set()
        for commit in COMMITS:
            mine = [p for p in new_files if _commit_of(p) == commit.key]
            for rel in mine:
                dst = repo / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_text(new_files[rel])
                placed.add(rel)
            for ours, theirs in commit.carries:
                (repo / theirs).parent.mkdir(parents=True, exist_ok=True)
                (repo / theirs).write_text(find_test(ours).read_text())
            apply_sites(repo, commit.key, texts)
            if commit.key == "flag":
                apply_flag(repo, modules)
            _git(repo, "add", "-A")
            _git(repo, "commit", "-q", "-m", f"{commit.subject}\n\n{commit.body}\n")
        unplaced = sorted(set(new_files) - placed)
        if unplaced:
            raise GenerationError(f"files in no commit (update COMMITS' homes): {unplaced}")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        _git(repo, "format-patch", "-q", "--no-signature", "-o", str(out), "main~" + str(len(COMMITS)))
        (out / "stat.txt").write_text(_git(repo, "diff", "--stat=100", f"main~{len(COMMITS)}", "main"))
    return sorted(out.glob("*.patch"))


_SGLANG_IMPORT_RE = re.compile(
    r"^[ \t]*(?:from (sglang\.[\w.]+) import ([^\n]+)|import (sglang\.[\w.]+))", re.MULTILINE
)


def check_bisect(new_files: dict[str, str], site_texts: list[tuple[str, str]]) -> None:
    """Every prefix of the series imports: a commit's new files and call-site edits import only the new
    modules of that commit or an earlier one (imports inside functions included: a flag-off path may
    run them). ``site_texts``: ``(commit key, the text a site puts in SGLang)``."""
    order = [c.key for c in COMMITS]
    added = {
        path[len("python/") :].removesuffix(".py").removesuffix("/__init__").replace("/", "."): _commit_of(path)
        for path in new_files
        if path.startswith("python/")
    }
    uses = [(_commit_of(path), path, text) for path, text in new_files.items() if path.startswith("python/")]
    uses += [(key, f"a call site of commit '{key}'", text) for key, text in site_texts]
    late = []
    for key, where, text in uses:
        for m in _SGLANG_IMPORT_RE.finditer(text):
            names = [m[1]] if m[1] else [m[3]]
            if m[1]:  # ``from sglang.x import y`` may import the module ``sglang.x.y``
                names += [f"{m[1]}.{n.split(' as ')[0].strip(' ()')}" for n in m[2].split(",") if n.strip(" ()")]
            for name in names:
                needed = added.get(name)
                if needed is not None and order.index(needed) > order.index(key):
                    late.append(f"{where} imports {name} (commit '{needed}')")
    if late:
        raise GenerationError("a commit imports a module that a later commit adds: " + "; ".join(sorted(set(late))))


# Words of the plugin's own point of view, which an SGLang change does not use about itself.
PLUGIN_VOCABULARY = re.compile(r"\b(?:ours|stock)\b|plugin", re.IGNORECASE)


def check_vocabulary(new_files: dict[str, str], site_texts: list[str]) -> None:
    """No added line speaks as the plugin ("ours", "stock", "plugin")."""
    said = [
        f"{where}: {line.strip()[:80]}"
        for where, text in [*new_files.items(), *(("a call site", t) for t in site_texts)]
        for line in text.splitlines()
        if PLUGIN_VOCABULARY.search(line)
    ]
    if said:
        raise GenerationError(f"{len(said)} added lines speak as the plugin: " + "; ".join(said[:12]))


def check_line_length(new_files: dict[str, str], site_texts: list[str], commits: list) -> None:
    """No line the series adds is longer than SGLang's formatter allows (``WIDTH`` columns): the new
    modules (laid out by ``sglang_layout``), the call sites, the flag's field and the carried tests."""
    texts = [(path, text) for path, text in new_files.items()]
    texts += [(f"a call site of {site.path}", text) for site, text in zip(SITES, site_texts)]
    texts += [(theirs, find_test(ours).read_text()) for c in commits for ours, theirs in c.carries]
    for where, text in texts:
        lines = long_lines(text)
        if lines:
            raise GenerationError(f"{where}:{lines[0]}: longer than {WIDTH} columns (SGLang's formatter)")


_WRAPPER_PARAMS = {"original", "previous", "result", "_result"}


def check_plain_calls(modules: dict[str, Path], texts: list[str], sglang: Path) -> None:
    """Every call the sites add is an ordinary call: no argument is one of SGLang's functions or methods (a
    lambda, ``type(self).m``, ``self.m`` or ``m`` defined in that file, a function it imports), and no
    shipped function they call takes a wrapped step or its result first (``_WRAPPER_PARAMS``)."""
    edited: dict[str, str] = {}
    called: dict[str, set[str]] = {}
    for site, text in zip(SITES, texts):
        edited[site.path] = edited.get(site.path, (sglang / site.path).read_text()).replace(site.old, text)
        called.setdefault(site.path, set()).update(re.findall(r"\{import:(\w+)\}", site.new))
    for path, source in edited.items():
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in called[path]):
                continue
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                name = arg.attr if isinstance(arg, ast.Attribute) else getattr(arg, "id", None)
                bad = isinstance(arg, ast.Lambda) or (
                    isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Call)
                )
                bad |= name is not None and bool(re.search(rf"^\s*def {name}\(", source, re.MULTILINE))
                bad |= isinstance(arg, ast.Name) and bool(re.search(rf"\bimport\b[^\n]*\b{name}\b", source))
                if bad:
                    raise GenerationError(
                        f"sglang/{path}: {node.func.id}() is handed {ast.unparse(arg)!r}, one of SGLang's steps"
                    )
    for name in set().union(*called.values()):
        mod = _module_of_name(name, modules)
        for fn in ast.parse(modules[mod].read_text()).body:
            if isinstance(fn, ast.FunctionDef) and fn.name == name and fn.args.args:
                if fn.args.args[0].arg in _WRAPPER_PARAMS:
                    raise GenerationError(f"{PKG}.{mod}.{name} takes a wrapped step first ({fn.args.args[0].arg})")


def _commit_of(repo_path: str) -> str:
    mod = repo_path[len("python/sglang/") :].removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    best, key = "", None
    for commit in COMMITS:
        for prefix in commit.homes:
            hit = mod == prefix.rstrip(".") or (prefix.endswith(".") and mod.startswith(prefix))
            if hit and len(prefix) > len(best):
                best, key = prefix, commit.key
    if key is None:
        raise GenerationError(f"{repo_path} belongs to no commit: add its home to COMMITS")
    return key


# ---------------------------------------------------------------------------------------------------
# The series applied: a patched copy of the installed SGLang, and an environment without the plugin


def patch_paths(patch: Path) -> list[str]:
    """The files a patch changes that exist before it (its new files excluded)."""
    text = patch.read_text()
    return [m[1] for m in re.finditer(r"^--- a/(\S+)$", text, re.MULTILINE)]


def apply_series(patches: list[Path], tree: Path) -> None:
    """Lay out the installed SGLang as ``tree/python/sglang`` and apply ``patches`` there, each checked first.

    Unchanged files are symlinks to the installed ones (bytecode is never written: see ``patched_env``);
    every file a patch changes is a copy first, so nothing is written into the installed tree.
    """
    sglang = installed_sglang()
    dst_root = tree / "python" / "sglang"
    for dirpath, dirnames, filenames in os.walk(sglang):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = Path(dirpath).relative_to(sglang)
        (dst_root / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            os.symlink(Path(dirpath) / name, dst_root / rel / name)
    for patch in patches:
        for rel in patch_paths(patch):
            path = tree / rel
            if path.is_symlink():
                target = path.resolve()
                path.unlink()
                shutil.copyfile(target, path)
        for args in (["--check"], []):
            proc = subprocess.run(["git", "apply", *args, str(patch)], cwd=tree, capture_output=True, text=True)
            if proc.returncode:
                what = "does not apply" if args else "failed to apply"
                raise GenerationError(f"{patch.name} {what}: {proc.stderr.strip()}")


_SITECUSTOMIZE = """\
# Written by make_upstream_patch.py: this interpreter runs the patched SGLang without the plugin.
import importlib.abc
import importlib.util
import os
import sys
import types

_ROOT = "sglang_cp_shared_kv"
_HOMES = {homes!r}  # our srt module -> the patched SGLang module the series put it in

sys.path[:] = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", _ROOT))]


class _Alias(importlib.abc.Loader):
    def __init__(self, target):
        self.target = target

    def create_module(self, spec):
        if self.target is None:  # a package the series has no module for: empty, its children resolve here
            module = types.ModuleType(spec.name)
            module.__path__ = []
            return module
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass


class _PatchedSGLangFinder(importlib.abc.MetaPathFinder):
    \"\"\"Our module names resolve to the patched SGLang's modules; the plugin itself is not importable.\"\"\"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _ROOT and not fullname.startswith(_ROOT + "."):
            return None
        rest = fullname[len(_ROOT) + 1 :]
        if rest in _HOMES:
            is_pkg = _HOMES[rest][1]
            return importlib.util.spec_from_loader(fullname, _Alias("sglang." + _HOMES[rest][0]), is_package=is_pkg)
        if rest == "" or any(h.startswith(rest + ".") for h in _HOMES):
            return importlib.util.spec_from_loader(fullname, _Alias(None), is_package=True)
        raise ModuleNotFoundError(f"{{fullname}} is plugin-only: not part of the patched SGLang", name=fullname)


sys.meta_path.insert(0, _PatchedSGLangFinder())
"""


def patched_env(tree: Path) -> dict[str, str]:
    """The environment of a Python that imports SGLang from ``tree`` (the series applied) and never the plugin.

    ``sglang_cp_shared_kv.srt.X`` names resolve to the patched SGLang modules the series put X in, so the
    project's tests run unchanged against the patched tree; the plugin's entry point, hook registration and
    argparse hook are not importable. The demo and the test oracles (``demo/``, ``reference/``, top-level
    packages of the checkout, outside the package) import from the repository root as usual. Subprocesses
    inherit it.
    """
    modules = shipped_modules()
    homes = {m: (home(m), p.name == "__init__.py") for m, p in modules.items()}
    site = tree / "_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(homes=homes))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=f"{site}{os.pathsep}{tree / 'python'}",
        PYTHONDONTWRITEBYTECODE="1",
        SGLANG_PLUGINS="none",  # no entry point is loaded: the flag comes from the patched SGLang
    )
    return env


# ---------------------------------------------------------------------------------------------------
# The docs: the PR text's generated parts (docs/upstream.md) and the generator's page (upstream_generator.md)

DOC = ROOT / "docs" / "upstream.md"
GENERATOR_DOC = ROOT / "docs" / "upstream_generator.md"
BENCH = ROOT / "docs" / "benchmarks"

_GENERATOR_HEAD = (
    """\
# The upstream series: how it is generated from the plugin

<!-- Generated by `python scripts/make_upstream_patch.py --docs`; edit the script, not this file. -->

The PR text is [`upstream.md`](upstream.md). `python scripts/make_upstream_patch.py` writes the series
to `dist/upstream/` (`git format-patch` files, `stat.txt`); `--apply-to DIR` also applies it to a copy of
the installed SGLang and prints the environment that runs that copy without the plugin. The series is
generated from the plugin's modules at the time it runs: there is one source.

"""
    + """## Keeping the series current

The generator reads the plugin's modules and hook tables when it runs. A new module needs a home
(`HOMES` in `scripts/make_upstream_patch.py`), a new hook a site (`SITES`: the SGLang file, the
exact text there, the direct call that replaces it); a site whose text SGLang no longer has, a
hook without a site or a site for a hook that is gone each stop it with one line, and so does
`test/scripts/test_upstream_patch.py`. So does a shipped module whose prose speaks of the plugin's
hook machinery (`PLUGIN_PROSE`): its docstrings say what each function does at its SGLang call
site, which holds in both forms. So does a commit that imports a module a later commit adds (the
series must import at every prefix; CI also applies each prefix and runs its commits' tests),
and so does an added line longer than SGLang's 88 columns: each module is laid out by
`scripts/sglang_layout.py` (`ruff format` at 88, prose and long literals refilled, the syntax tree
checked unchanged), while the call sites and the carried tests (`test/upstream/`, formatted at 88 by
their own `ruff.toml`) are written to fit. Our environment variables (`srt/environ.py`) become
fields of SGLang's `Envs`.
`python scripts/make_upstream_patch.py --docs` regenerates this page and the generated parts of
`upstream.md` (its measurement table, the commit list and the diff stat).

## Where each plugin hook went

The plugin installs its wiring through SGLang's `HookRegistry` and resolution hooks, all in one
plugin-only module (`srt/sglang_wiring/hooks.py`) whose adapters call plain functions of the shipped
modules. In the series each hook is a direct, flag-guarded edit at its place in SGLang's source that
calls those same functions before, after or instead of SGLang's step, with explicit arguments (no
monkeypatching, no closure walking, no `sys.excepthook` swap). The generator refuses a call site that
hands a function one of SGLang's steps (`check_plain_calls`).
"""
)

_DOC_EXTENSION_POINTS = """\
## Public extension points that would let the plugin drop its private hooks

1. A pool-class selection hook on `KVCacheConfigurator` (the plugin wraps `_build_dsa_kv_pool`,
   `_build_mla_kv_pool`, `_build_token_to_kv_pool_allocator` and `_init_pools`): a registry of
   `(predicate, pool class, allocator factory)` consulted where the pools are built.
2. A fixed-overhead hook in `pool_configurator` (the plugin wraps `compute_page_shard_scratch_bytes`):
   a pool class declares the scratch bytes it needs, charged before token sizing.
3. The batch's scheduler context on `ForwardBatch` (the plugin wraps `ForwardBatch.init_new` and
   `prepare_kv_shard_forward` to carry request ids and the radix-path shared-prefix hint to the pool):
   a field for pool-specific per-batch metadata, filled from the `ScheduleBatch`.
4. A deferral callback in `PrefillAdder` (`_kv_shard_reserve_scratch`) so a pool can say why a
   request waits.
5. Status-message extensions in `CommonKVManager` / `CommonKVSender` / `CommonKVReceiver` (the plugin
   wraps `_prepare_send_indices`, `_encode_kv_status_message`, `parse_kv_status_message`,
   `send_metadata` and both `clear`s): an optional per-request payload on Success and a decode-side
   validator that can hold or fail a request.
6. Plugin fields on `ServerArgs` (the plugin wraps `add_cli_args` / `from_cli_args`, so
   `Engine(enable_cp_shared_kv=True)` and `sglang serve --help` do not see the flag): an API that adds a
   typed field to an argument group.
7. A way to know a registered hook was installed (the plugin walks the wrapper's closure cells, since
   `HookRegistry.apply_hooks` logs a failed target and goes on): `apply_hooks` returning, or raising on,
   the targets it could not patch.
8. Metrics a pool class can register with the scheduler's (the plugin's `metrics` wraps `_init_pools`,
   `prepare_kv_shard_forward` and `_kv_shard_reserve_scratch` to observe sizes, bytes and deferrals).
9. Two fixes rather than extension points, which the series carries as its first two patches (after
   which the plugin's `connector_sockets` and the wrappers in `connector_bounds` go):
   `CommonKVManager._connect` makes sockets that never reconnect (a socket made during a partition
   delivers nothing, ever), and `CommonKVManager.update_status` lets destinations that arrive after a
   room was cleared open it again, with nothing left to clear it.

One more, for host time rather than for a hook: the DSA backend builds the table it hands
`translate_loc_to_scratch` from `req_to_token`, `req_pool_indices` and the lengths it has just passed to
`begin_shard_extend`. Today the pool defers the batch's plan to that call and runs the translation in the
plan's graph (`docs/design.md`, host cost), which needs the translation to be the batch's first device
call. If the backend asked the pool for that table translated (or handed it the table with the lengths),
`begin_shard_extend` could launch the plan and the translation itself, with no call order to rely on:
today the pool cannot tell, without reading it on the device, that a tensor it is handed is that table.
"""


def _site_rows(hooks: dict[tuple[str, str], object], modules: dict[str, Path]) -> list[str]:
    rows = ["| plugin hook | hook function (plugin module) | edit in the series |", "|---|---|---|"]
    for (target, name), fn in sorted(hooks.items(), key=lambda kv: kv[0]):
        mod = our_module_of(fn)
        if (target, name) in FLAG_SITES_COVER:
            where = "a field of `arg_groups/fields/parallel.py` (the parallel group), its help the plugin's"
        elif (target, name) in UNWIRED_HOOKS:
            where = "not in the series yet: the decode CP server (its pool sharded by page ownership) is the plugin's"
        else:
            sites = [s for s in SITES if (target, name) in s.covers]
            paths = ", ".join(f"`{s.path}`" + (f" ({s.count} call sites)" if s.count > 1 else "") for s in sites)
            called = sorted({n for s in sites for n in re.findall(r"\{import:(\w+)\}", s.new)})
            calls = [f"`sglang.{home(_module_of_name(n, modules))}.{n}`" for n in called]
            where = f"{paths}, calling {', '.join(calls)}" if calls else f"{paths}, an edit of SGLang's own code"
        shown = target.replace("resolution:", "resolution step ").replace("sglang.srt.", "")
        rows.append(f"| `{shown}` | `{name}` (`{mod}`) | {where} |")
    return rows


def _home_rows(modules: dict[str, Path]) -> list[str]:
    rows = ["| plugin module | in SGLang |", "|---|---|"]
    for mod, path in sorted(modules.items()):
        rows.append(f"| `{PKG}.{mod}` | `{home_file(home(mod), path.name == '__init__.py')}` |")
    return rows


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


# (summary key, column title); a run without the key gets the reason its kind gives, as a footnote.
_PR_COLUMNS = [
    ("ours_vs_stock_layer_time", "layer time, stock / ours"),
    ("ours_vs_upstream_layer_time", "layer time, `--enable-kv-cache-sharding` / ours"),
    ("ours_vs_layersplit_layer_time", "layer time, layer split / ours"),
    ("bytes_ratio", "bytes moved, ours / `--enable-kv-cache-sharding`"),
    ("peak_scratch_ratio_equal_admission", "scratch, ours / SGLang's at equal admission"),
    ("host_syncs_ours_per_forward", "host syncs per forward, ours"),
    ("host_syncs_upstream_per_forward", "host syncs per forward, `--enable-kv-cache-sharding`"),
    ("correct_all", "bit-exact"),
]
_WHY_ABSENT = {
    "backend": (
        "not in this run: two ranks share one GPU, and SGLang's page-interleave pool needs a GPU per rank for "
        "its NCCL communicator; the layer split over gloo would broadcast through host memory"
    ),
    "pools": (
        "not shown: this earlier harness form drove the pools without the DSA backend and decoded each whole "
        "buffer before FlashMLA, which SGLang never does: its times do not stand (its bytes, scratch and syncs do)"
    ),
}
_HIDDEN = {"pools": {"ours_vs_upstream_layer_time"}}  # present in the JSON, not a figure that stands
# A figure a run kind has in place of a column's: (kind, column key) -> (its key, what it is).
_INSTEAD = {
    ("pools", "peak_scratch_ratio_equal_admission"): (
        "peak_scratch_ratio",
        "ours at its default size (2 contexts), not at equal admission",
    )
}


def _pr_measurements() -> list[str]:
    """The side-by-side runs as one table: every cell a figure from its JSON or a numbered reason."""
    runs = []
    for path in sorted(BENCH.glob("vs_upstream*.json")):
        d = json.loads(path.read_text())
        kind = "backend" if "ours_vs_stock_layer_time" in d.get("summary", {}) else "pools"
        runs.append((path.name, d, kind))
    notes: list[str] = []
    rows = [
        "| run | GPUs | " + " | ".join(title for _, title in _PR_COLUMNS) + " |",
        "|---|---|" + "---|" * len(_PR_COLUMNS),
    ]
    for name, d, kind in runs:
        summary, env = d["summary"], d.get("environment", {})
        cells = []
        for key, _ in _PR_COLUMNS:
            if summary.get(key) is not None and key not in _HIDDEN.get(kind, ()):
                cells.append(_fmt(summary[key]))
                continue
            other, what = _INSTEAD.get((kind, key), (None, None))
            if other is not None and summary.get(other) is not None:
                if what not in notes:
                    notes.append(what)
                cells.append(f"{_fmt(summary[other])} ({notes.index(what) + 1})")
                continue
            why = _WHY_ABSENT[kind]
            if why not in notes:
                notes.append(why)
            cells.append(f"n/a ({notes.index(why) + 1})")
        gpus = f"{env.get('gpu_count', '?')} x {env.get('gpu', '?')}"
        rows.append(f"| [`{name}`](benchmarks/{name}) | {gpus} | " + " | ".join(cells) + " |")
    out = ["Side by side in one run each (`benchmark/cp_shared_kv/bench_vs_upstream.py`; a time ratio above 1", ""]
    out[0] += " means ours is faster):"
    out += rows + [""] + [f"({i}) {why}." for i, why in enumerate(notes, 1)]
    out += ["", "Commands (each JSON holds its command, machine and versions):", ""]
    out += [f"- `{name}`: `{d.get('command', '?')}`" for name, d, _ in runs]
    return out


def _replace_generated(text: str, name: str, body: list[str]) -> str:
    begin = f"<!-- generated: {name} (python scripts/make_upstream_patch.py --docs) -->"
    end = "<!-- end generated -->"
    i = text.index(begin) + len(begin)
    j = text.index(end, i)
    return text[:i] + "\n" + "\n".join(body) + "\n" + text[j:]


def _pr_driver() -> list[str]:
    """The in-node transport, its driver calls and the figures of ``rank_model.json``."""
    data = json.loads((BENCH / "rank_model.json").read_text())
    summary, check = data["summary"], data["pacing_check"]
    rows = ["| prefix | view bytes per rank | copy engines, 2 x H200 (us) | NCCL all-gather, 2 x H200 (us) |"]
    rows.append("|---|---|---|---|")
    for e in check["entries"]:
        rows.append(
            f"| {e['prefix'] // 1024}K | {e['bytes_2h200']} | {e['copy_engine_2h200_us']:.0f} "
            f"| {e['nccl_2h200_us']:.0f} |"
        )
    return [
        "The view transport inside a node is CUDA IPC and `cuMemcpyDtoDAsync` on the copy engines, ordered",
        "by 64-bit counters that each stream waits on (`cuStreamWaitValue64`), called through cuda-python's",
        "driver bindings (`cuda.bindings.driver`), the SGLang dependency its own stream waits use.",
        "`cuda_wrapper.py`'s runtime library has the IPC handles but no copy queued on a stream and no",
        "stream wait on a memory value, and PyNccl's all-gather runs on SMs. Each batch's fence across the",
        "ranks is one captured graph: queued call by call, a rank whose peer was killed never logged its",
        "peer-lost line ([`fence_graph_bisect.txt`](benchmarks/fence_graph_bisect.txt)). The copy engines are what make the",
        "layer-ahead prefetch possible (NCCL's kernels would wait for the SMs the layer holds). In the",
        "rank model",
        f"([`rank_model.json`](benchmarks/rank_model.json), commit `{data['git_commit'][:7]}`: one rank of a",
        f"CP-N node on one H200, the pull paced to {summary['link_gbps']:.0f} GB/s), CP 8 at a 128K prefix",
        f"and 1K new tokens per rank costs {summary['overhead_cp8_128k_1k_inline']}% of the layer with the",
        f"view built in line and {summary['overhead_cp8_128k_1k_prefetch']}% prefetched. On two H200s the",
        f"copy engines moved a layer's view faster than NCCL's all-gather ({check['source']}):",
        "",
        *rows,
        "",
        "With `SGLANG_CP_SHARED_KV_TRANSPORT=nccl`, or across nodes, the views go through the CP group's",
        "`torch.distributed` collectives and the driver is not loaded.",
    ]


def series_size(patches: list[Path]) -> dict[str, int]:
    """Lines the series adds: under ``python/`` and ``test/``, and for its new modules how many are code,
    docstrings, comments and blank."""
    added: dict[str, list[str]] = {}
    for patch in patches:
        path = None
        for line in patch.read_text().splitlines():
            if line.startswith("+++ b/"):
                path = line[6:]
            elif line.startswith("+") and not line.startswith("+++") and path:
                added.setdefault(path, []).append(line[1:])
    size = dict.fromkeys(("python", "test", "new", "docstrings", "comments", "blank"), 0)
    for path, lines in added.items():
        size["test" if path.startswith("test/") else "python"] += len(lines)
        if path.startswith("test/") or not path.endswith(".py"):
            continue
        try:
            tree = ast.parse("\n".join(lines))
        except SyntaxError:  # lines added inside one of SGLang's files
            continue
        docs: set[int] = set()
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
                first = body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                    if isinstance(first.value.value, str):
                        docs.update(range(first.lineno, first.end_lineno + 1))
        size["new"] += len(lines)
        size["docstrings"] += len(docs)
        size["comments"] += sum(1 for i, x in enumerate(lines, 1) if x.strip().startswith("#") and i not in docs)
        size["blank"] += sum(1 for x in lines if not x.strip())
    size["code"] = size["new"] - size["docstrings"] - size["comments"] - size["blank"]
    return size


def _pr_size(size: dict[str, int], fixes: dict[str, int]) -> list[str]:
    return [
        f"The two connector fixes add {fixes['python'] + fixes['test']:,} lines at 88 columns ({fixes['test']:,} of "
        "tests). The CP-shared KV commits",
        f"add {size['python'] + size['test']:,}: {size['python']:,} under `python/`",
        f"and {size['test']:,} of tests. Of the {size['new']:,} lines of its new modules, {size['code']:,} are code,",
        f"{size['docstrings']:,} docstrings, {size['comments']:,} comments and {size['blank']:,} blank; the rest of",
        "`python/` is the call sites in SGLang's files, the flag's field and the environment variables.",
    ]


def render_docs(stat: str, size: dict[str, int], fixes: dict[str, int]) -> tuple[str, str]:
    """``(docs/upstream.md, docs/upstream_generator.md)``: the PR text with its generated parts filled, and
    the generator's page."""
    modules = shipped_modules()
    hooks = plugin_hooks()
    check_coverage(hooks)
    series = ["\n".join(f"{i}. {c.subject}" for i, c in enumerate(COMMITS, 1))]
    pr = _replace_generated(DOC.read_text(), "measurements", _pr_measurements())
    pr = _replace_generated(pr, "series", series + ["", "```", stat.rstrip(), "```"])
    pr = _replace_generated(pr, "driver", _pr_driver())
    pr = _replace_generated(pr, "size", _pr_size(size, fixes))
    generator = [
        _GENERATOR_HEAD,
        *_site_rows(hooks, modules),
        "",
        "Where each module of the plugin sits in SGLang (`HOMES`; imports rewritten to match):",
        "",
        *_home_rows(modules),
        "",
        "Plugin-only, not in the series: the entry point (`srt/plugin.py`), the hooks and their adapters,",
        "the argparse action, the SGLang-version and installed-hook checks and the command-line excepthook",
        "(`srt/sglang_wiring/hooks.py`), and the status-socket wrapper",
        "(`srt/sglang_wiring/connector_sockets.py`: the series fixes `_connect` itself).",
        "",
        _DOC_EXTENSION_POINTS,
    ]
    return pr, "\n".join(generator)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the series (emptied first)")
    parser.add_argument("--stat", action="store_true", help="print the series' diff stat")
    parser.add_argument(
        "--apply-to",
        type=Path,
        metavar="DIR",
        help="also apply the series to a copy of the installed SGLang in DIR (new) and print the environment "
        "that runs it without the plugin",
    )
    parser.add_argument(
        "--docs",
        action="store_true",
        help="also fill docs/upstream.md's generated parts and write upstream_generator.md",
    )
    args = parser.parse_args(argv)
    try:
        patches = build_series(args.out)
        if args.docs:
            pr, generator = render_docs(
                (args.out / "stat.txt").read_text(), series_size(patches[FIXES:]), series_size(patches[:FIXES])
            )
            DOC.write_text(pr)
            GENERATOR_DOC.write_text(generator)
        if args.apply_to:
            apply_series(patches, args.apply_to)
            env = patched_env(args.apply_to)
    except GenerationError as e:
        print(f"make_upstream_patch: {e}", file=sys.stderr)
        return 1
    for p in patches:
        print(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
    if args.stat:
        print((args.out / "stat.txt").read_text(), end="")
    if args.apply_to:
        keys = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "SGLANG_PLUGINS")
        print(" ".join(f"{k}={env[k]}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
