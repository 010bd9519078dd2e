"""How the plugin installs itself in SGLang 0.5.23: every hook, and the checks that they are installed.

Each hook adapts one SGLang target to a plain function of the other wiring modules through SGLang's
``HookRegistry`` or a resolution hook, and passes through unless ``--enable-cp-shared-kv`` is on. With the
flag on, the SGLang version and the installed hooks are checked first: SGLang's registry logs a target it
cannot wrap and goes on, which would leave the KV replicated.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import pkgutil
import sys
from typing import Any

from sglang_cp_shared_kv.srt.sglang_wiring import (
    connector_bounds,
    connector_sockets,
    decode_manifest,
    decode_routes,
    decode_server,
    metrics,
    pool_hooks,
    startup_checks,
    transfer,
    view_arena,
)
from sglang_cp_shared_kv.srt.sglang_wiring.flag import ATTR, FLAG, enabled, manager_enabled, runtime_enabled
from sglang_cp_shared_kv.srt.sglang_wiring.startup_checks import CPSharedKVStartupError

logger = logging.getLogger(__name__)

# The SGLang releases whose private functions the hooks were written and tested against.
SGLANG_VERSIONS = ("0.5.23",)
ANY_SGLANG_ENV = "SGLANG_CP_SHARED_KV_ANY_SGLANG"

_CFG = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_COMMON = "sglang.srt.disaggregation.common.conn"
_MOONCAKE = "sglang.srt.disaggregation.mooncake.conn"
_DSA = "sglang.srt.layers.attention.dsa"
_DSA_BACKEND = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"


# -- the flag on SGLang's server args --

_HELP = (
    "Shard the MLA latent + DSA indexer KV cache across the prefill context-parallel ranks: "
    "each logical page is stored once, on rank (page %% attn-cp-size), instead of on every CP rank. "
    "On a prefill server: needs --enable-prefill-cp --cp-strategy interleave over N > 1 attention CP ranks and "
    "--disaggregation-mode prefill --disaggregation-transfer-backend mooncake. On a decode server "
    "with --disaggregation-mode decode: expect and check the prefill ranks' page manifests; with --dcp-size N > 1 "
    "(a DSA model, FlashMLA decode) also shard its KV the same way over its N DCP ranks (sglang-cp-shared-kv plugin)."
)


class _FlagAction(argparse._StoreTrueAction):
    """``store_true`` that, when the flag is given, checks that every hook is installed."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        install_clean_exit()
        lines = hook_rejections()
        if lines:
            raise CPSharedKVStartupError("\n".join(lines))


def add_flag(_result: None, parser: argparse.ArgumentParser) -> None:
    if FLAG in parser._option_string_actions:  # the same parser passed twice
        return
    parser.add_argument(FLAG, dest=ATTR, action=_FlagAction, default=False, help=_HELP)


def copy_flag(server_args: Any, _cls: type, args: argparse.Namespace) -> None:
    """After ``ServerArgs.from_cli_args(cls, args)``: put the parsed value on the record."""
    setattr(server_args, ATTR, bool(getattr(args, ATTR, False)))


def install_clean_exit() -> None:
    """Print an uncaught ``CPSharedKVStartupError`` as its lines alone (no traceback); others as before."""
    previous = sys.excepthook
    if getattr(previous, "_cp_shared_kv", False):
        return

    def excepthook(exc_type, exc, tb):
        if issubclass(exc_type, CPSharedKVStartupError):
            print(str(exc), file=sys.stderr)
            return
        previous(exc_type, exc, tb)

    excepthook._cp_shared_kv = True
    sys.excepthook = excepthook


# -- adapters: SGLang's targets to the plain functions --


def startup_early(server_args: Any, previous) -> None:
    previous(server_args)
    if enabled(server_args):
        startup_checks._raise(hook_rejections())
        startup_checks.early_check(server_args, decode_cp=True)


def startup_resolved(server_args: Any, previous) -> None:
    previous(server_args)
    if enabled(server_args):
        startup_checks.resolved_check(server_args, decode_server.decode_cp_rejections)


def _builds_pool(configurator) -> bool:
    return view_arena.builds_cp_shared_pool(configurator) or decode_server.builds_pool(configurator)


def _pool_builder(kind: str):
    def build(original, configurator, **kwargs):
        if _builds_pool(configurator):
            kwargs[f"{kind}_pool_class"] = pool_hooks.cp_shared_pool_class(kind)
        return original(configurator, **kwargs)

    build.__name__ = build.__qualname__ = f"build_{kind}_kv_pool"
    return build


build_dsa_kv_pool = _pool_builder("dsa")
build_mla_kv_pool = _pool_builder("mla")


def build_allocator(original, configurator, **kwargs):
    pool = kwargs.get("token_to_kv_pool")
    if not view_arena.builds_cp_shared_pool(configurator) or kwargs.get("token_to_kv_pool_allocator") is not None:
        return original(configurator, **kwargs)  # a decode CP pool keeps SGLang's DCP allocator
    return pool_hooks.build_allocator(configurator, pool, kwargs["sizes"].max_total_num_tokens)


def built_pools(result, configurator, **_kwargs):
    if _builds_pool(configurator):
        startup_checks._raise(hook_rejections())
        pool, allocator = result.token_to_kv_pool, result.token_to_kv_pool_allocator
        if decode_server.builds_pool(configurator):
            logger.info(decode_server.check_built_pools(pool, allocator))
            return result
        pool_hooks.check_built_pools(pool, allocator)
        metrics.report_pools(pool, allocator)
    return result


def charge_arena(original, kvc, **kwargs):
    return view_arena.charge_arena(kvc) if view_arena.builds_cp_shared_pool(kvc) else original(kvc, **kwargs)


def deferred(reserved: bool, adder, prefix_len: int, extend_len: int) -> bool:
    if not reserved:
        view_arena.log_deferred(adder, prefix_len, extend_len)
        metrics.count_deferral(adder)
    return reserved


def hint_shared_prefix(result, _cls, batch, model_runner, *_args, **_kwargs):
    pool = getattr(model_runner, "token_to_kv_pool", None)
    if view_arena.is_cp_shared_pool(pool) and runtime_enabled():
        pool_hooks.hint_shared_prefix(result, batch, pool)
    return result


def prepare_forward(original, pool, req_to_token, forward_batch):
    if view_arena.is_cp_shared_pool(pool):
        return pool_hooks.prepare_forward(pool, req_to_token, forward_batch)
    return original(pool, req_to_token, forward_batch)


def sent_share(result, sender, kv_indices, state_indices=None):
    if runtime_enabled():
        local, positions, _is_last, _skip = result
        transfer.check_send_indices(sender, kv_indices, local, positions)
        dcp_size = decode_routes.routed_dcp_size(sender.kv_mgr, sender.bootstrap_room)
        transfer.record_sent_share(sender, kv_indices, positions, dcp_size)
    return result


def keep_pages_whole(original, mgr, dst_dcp_size: int, dst_dcp_rank: int) -> bool:
    if dst_dcp_size > 1 and transfer.sharded_prefill(mgr):
        return False  # a page-sharded decode takes whole pages (send_to_owner), not SGLang's token relayout
    return original(mgr, dst_dcp_size, dst_dcp_rank)


def send_to_owner(original, mgr, session_id, src, dst_ptrs, dst, *args, **kwargs):
    owner = decode_routes.decode_owner(mgr, session_id)
    if owner is not None:
        src, dst = decode_routes.route_to_owner(src, dst, owner)
        if len(src) == 0:
            return 0
    return original(mgr, session_id, src, dst_ptrs, dst, *args, **kwargs)


def send_state_to_owner(original, mgr, req, state_indices, *args, **kwargs):
    owner = decode_routes.decode_owner(mgr, req.mooncake_session_id)
    if owner is not None:
        req, state_indices = decode_routes.route_state_to_owner(mgr, req, state_indices, owner)
    return original(mgr, req, state_indices, *args, **kwargs)


def attach_manifest(parts, mgr, *, bootstrap_room, status, failure_reason=None):
    frames = transfer.manifest_frames(mgr, bootstrap_room, status)
    return [*parts, *frames] if frames else parts


def drop_unsent_share(_result, sender) -> None:
    transfer.drop_unsent_share(sender)


def arm_manifest_check(original, receiver, kv_indices, *args, **kwargs):
    decode_manifest.arm_manifest_check(receiver, len(kv_indices))
    return original(receiver, kv_indices, *args, **kwargs)


def check_status_message(original, mgr, msg):
    parsed = original(mgr, msg)
    return decode_manifest.check_status_message(mgr, msg, parsed)


def forget_room(_result, receiver) -> None:
    decode_manifest.forget_room(receiver)


def bounds_of(mgr: Any) -> connector_bounds.RoomBounds:
    """The manager's ``RoomBounds`` (made on first use)."""
    from sglang_cp_shared_kv.srt.sglang_wiring.plugin_state import state_of

    state = state_of(mgr)
    if state.bounds is None:
        state.bounds = connector_bounds.RoomBounds(connector_bounds.window_s())
    return state.bounds


def guard_update_status(original, mgr, bootstrap_room, status):
    if manager_enabled(mgr, "prefill") and not connector_bounds.admit_status(
        bounds_of(mgr), mgr, bootstrap_room, status
    ):
        return None
    return original(mgr, bootstrap_room, status)


def close_room(original, sender):
    """Wraps ``CommonKVSender.clear``: only the room's owner closes it (a duplicate sender under a deferred
    bootstrap clears nothing)."""
    mgr = sender.kv_mgr
    if not manager_enabled(mgr, "prefill"):
        return original(sender)
    owner = mgr.deferred_bootstrap is None or sender._owns_bootstrap_room
    result = original(sender)
    if owner:
        connector_bounds.room_cleared(bounds_of(mgr), mgr, sender.bootstrap_room)
    return result


def transfer_pages(original, queue, decode_req, kv_indices, page_size):
    page_size = decode_server.transfer_page_size(queue.token_to_kv_pool, page_size)
    return original(queue, decode_req, kv_indices, page_size)


def prefill_info(original, mgr, bootstrap_addr):
    """``CommonKVManager.try_ensure_parallel_info`` on a decode CP server with the flag: SGLang's DCP block
    there refuses a CP prefill (SGLang's DCP relayouts tokens from one prefill rank); a decode CP pool takes
    whole pages from every CP rank, each routed to its owner by the prefill (``decode_routes``). The block
    is its only reader of ``dcp_size``, read as 1 for the call (the scheduler thread, the attribute's only
    reader on a decode)."""
    if not (manager_enabled(mgr, "decode") and mgr.dcp_size > 1):
        return original(mgr, bootstrap_addr)
    dcp_size, mgr.dcp_size = mgr.dcp_size, 1
    try:
        return original(mgr, bootstrap_addr)
    finally:
        mgr.dcp_size = dcp_size


def _forward_pool():
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

    return get_token_to_kv_pool()


def indexer_page_table(original, metadata):
    pages, pool = original(metadata), _forward_pool()
    return decode_server.indexer_page_table(pool, pages) if decode_server.is_decode_pool(pool) else pages


def indexer_topk(original, metadata, logits, topk, *args, **kwargs):
    pool = _forward_pool()
    if not decode_server.is_decode_pool(pool):
        return original(metadata, logits, topk, *args, **kwargs)
    if args or any(v is not None for v in kwargs.values()):
        raise NotImplementedError(f"{FLAG}: a decode CP pool's top-k of a batch other than a decode")
    seqlens, pages = metadata.get_seqlens_int32(), metadata.attn_metadata.real_page_table
    return decode_server.indexer_topk(pool, logits, seqlens, pages, topk)


def decode_heads(_result, backend, *_args, **_kwargs) -> None:
    if decode_server.is_decode_pool(backend.token_to_kv_pool) and backend.dcp_size > 1:
        backend.flashmla_kv_num_q_heads = decode_server.flashmla_kv_heads(backend.num_dcp_q_heads)


def decode_attention(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    if not (decode_server.is_decode_pool(backend.token_to_kv_pool) and backend.dcp_size > 1):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    rope, k_rope, topk = (kwargs.pop(n, None) for n in ("q_rope", "k_rope", "topk_indices"))
    if any(v is not None for v in kwargs.values()):
        raise NotImplementedError(f"{FLAG}: decode CP with {sorted(n for n, v in kwargs.items() if v is not None)}")
    return decode_server.forward_decode(backend, q, k, layer, forward_batch, save_kv_cache, rope, k_rope, topk)


def dsa_dcp_overrides(original, cfg):
    if not (enabled(cfg) and cfg.disaggregation_mode == "decode" and (cfg.dcp_size or 1) > 1):
        return original(cfg)
    return decode_server.decode_cp_overrides(cfg, original)


HOOKS = [
    ("sglang.srt.server_args.ServerArgs.add_cli_args", add_flag, "after"),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", copy_flag, "after"),
    (f"{_CFG}._build_dsa_kv_pool", build_dsa_kv_pool, "around"),
    (f"{_CFG}._build_mla_kv_pool", build_mla_kv_pool, "around"),
    (f"{_CFG}._build_token_to_kv_pool_allocator", build_allocator, "around"),
    (f"{_CFG}._init_pools", built_pools, "after"),
    ("sglang.srt.model_executor.pool_configurator.compute_page_shard_scratch_bytes", charge_arena, "around"),
    ("sglang.srt.managers.schedule_policy.PrefillAdder._kv_shard_reserve_scratch", deferred, "after"),
    ("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", hint_shared_prefix, "after"),
    ("sglang.srt.layers.attention.kv_shard_hooks.prepare_kv_shard_forward", prepare_forward, "around"),
    (f"{_COMMON}.CommonKVSender._prepare_send_indices", sent_share, "after"),
    (f"{_COMMON}.CommonKVManager._encode_kv_status_message", attach_manifest, "after"),
    (f"{_COMMON}.CommonKVSender.clear", drop_unsent_share, "after"),
    (f"{_COMMON}.CommonKVReceiver.send_metadata", arm_manifest_check, "around"),
    (f"{_COMMON}.CommonKVManager.parse_kv_status_message", check_status_message, "around"),
    (f"{_COMMON}.CommonKVReceiver.clear", forget_room, "after"),
    (f"{_COMMON}.CommonKVManager.update_status", guard_update_status, "around"),
    (f"{_COMMON}.CommonKVSender.clear", close_room, "around"),
    (f"{_COMMON}.CommonKVManager._connect", connector_sockets.reconnect_new_sockets, "around"),
    (f"{_COMMON}.CommonKVManager.requires_dcp_relayout", keep_pages_whole, "around"),
    (f"{_MOONCAKE}.MooncakeKVManager.send_kvcache", send_to_owner, "around"),
    (f"{_MOONCAKE}.MooncakeKVManager.maybe_send_extra", send_state_to_owner, "around"),
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue._transfer_page_indices", transfer_pages, "around"),
    (f"{_COMMON}.CommonKVManager.try_ensure_parallel_info", prefill_info, "around"),
    (f"{_DSA}.dsa_indexer_metadata.DSAIndexerMetadata.get_page_table_64", indexer_page_table, "around"),
    (f"{_DSA}.dsa_indexer_metadata.DSAIndexerMetadata.topk_transform", indexer_topk, "around"),
    (f"{_DSA_BACKEND}.__init__", decode_heads, "after"),
    (f"{_DSA_BACKEND}.forward_decode", decode_attention, "around"),
    ("sglang.srt.arg_groups.model_overrides.deepseek_v2._dsa_dcp_overrides", dsa_dcp_overrides, "around"),
]
RESOLUTION_HOOKS = [
    ("validate_prefill_cp_platform", startup_early),
    ("handle_kv_cache_sharding", startup_resolved),
]


# -- installed here? --


def sglang_version_rejections() -> list[str]:
    """One line unless SGLang is a version the hooks (on private functions) were checked against;
    ``$SGLANG_CP_SHARED_KV_ANY_SGLANG=1`` lets it start, with a WARNING."""
    from sglang.version import __version__ as version

    checked = " or ".join(SGLANG_VERSIONS)
    if version in SGLANG_VERSIONS:
        return []
    if os.environ.get(ANY_SGLANG_ENV) == "1":
        _warn_once(f"{FLAG}: SGLang {version} is installed, the plugin's hooks were checked against SGLang {checked} "
                   f"only; starting anyway because {ANY_SGLANG_ENV}=1")  # fmt: skip
        return []
    return startup_checks._lines(
        f"SGLang {version} is installed, and the plugin's hooks wrap private functions of SGLang {checked} only; "
        f"install sglang=={SGLANG_VERSIONS[-1]}, or set {ANY_SGLANG_ENV}=1 to start at your own risk"
    )


@functools.cache
def _warn_once(line: str) -> None:
    logger.warning(line)


def _wraps(target: str, hook: object) -> bool:
    """Whether the callable now at ``target`` is a HookRegistry wrapper chain that calls ``hook``."""
    obj_path, attr = target.rsplit(".", 1)
    try:
        obj = pkgutil.resolve_name(obj_path)
    except Exception:  # the module or class is gone: nothing was installed
        return False
    fn = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr, None)
    fn = getattr(fn, "__func__", fn)  # a classmethod / staticmethod wrapper
    for _ in range(64):  # the chain of wrappers, innermost last
        if fn is None:
            return False
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # an empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return False


def missing_hooks() -> list[str]:
    """The targets (and resolution steps) of ``register`` not installed here."""
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS
    from sglang.srt.plugins.hook_registry import HookRegistry

    missing = [t for t, hook, _ in HOOKS if t not in HookRegistry._patched or not _wraps(t, hook)]
    missing += [f"resolution step {step}" for step, check in RESOLUTION_HOOKS if check not in _HOOKS.get(step, [])]
    return list(dict.fromkeys(missing))


def hook_rejections() -> list[str]:
    """The SGLang version line, else one line naming the hooks SGLang did not install here (or none)."""
    version = sglang_version_rejections()
    if version:
        return version  # another version's missing hooks follow from it
    missing = missing_hooks()
    if not missing:
        return []
    return startup_checks._lines(
        f"SGLang did not install the plugin's hook(s) on {', '.join(missing)} (its HookRegistry logs such a "
        "failure and goes on, which would leave the KV replicated); "
        f"run sglang=={SGLANG_VERSIONS[-1]}, whose functions these hooks wrap, or drop the flag"
    )


def register() -> None:
    """Install every hook: the flag, the startup checks, the pools and allocator, the transfer and decode checks."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    kinds = {"before": HookType.BEFORE, "after": HookType.AFTER, "around": HookType.AROUND}
    for target, hook, kind in HOOKS:
        HookRegistry.register(target, hook, kinds[kind])
    for step, check in RESOLUTION_HOOKS:
        register_resolution_hook(step)(check)
