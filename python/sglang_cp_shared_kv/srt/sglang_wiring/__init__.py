"""Wiring of the CP-shared KV cache into SGLang 0.5.23: everything ``plugin.load`` installs.

- ``server_args_hook``: the ``--enable-cp-shared-kv`` flag on SGLang's server args.
- ``startup_checks``: the flag's rules, run where SGLang resolves its arguments.
- ``pool_hooks``: SGLang's MLA/DSA pools replaced by ``sharded_kv_pool``'s subclasses and its allocator
  widened by N (SGLang's owner-rotating allocator); each extend batch's request ids and shared-prefix hint
  (from the scheduler's radix tree) handed to the pool's read state.
- ``view_arena``: the read buffer's size, charged to the KV budget, and SGLang's batch admission held to it.
- ``sharded_kv_pool`` (with ``layers.attention.nsa.read_state``): the masked write path and the kv-shard
  read contract (current-reuse / materialized view) that SGLang's DSA backend, indexer and FA3 call.
- ``transfer``: SGLang's Mooncake sender in sharded mode (owned pages at their positions), and each
  prefill rank's manifest on its Success status.
- ``decode_manifest``: on a decode server, the manifests checked before a request is ready.
- ``metrics``: each prefill CP rank's startup line, and the plugin's series in SGLang's ``/metrics``.
- ``connector_bounds``: on a prefill server, the connector's per-room tables bounded (rooms that SGLang
  0.5.23 would keep after their request ended are dropped).
- ``connector_sockets``: the connector's status sockets reconnect after a connect made while the peer
  was unreachable.

Each module lists its hooks in a table (``HOOKS``: target, hook, ``"before"``, ``"after"`` or
``"around"``; ``startup_checks.RESOLUTION_HOOKS``: resolution step, check); ``register`` installs them
all. Every hook passes through unless ``--enable-cp-shared-kv`` is on.
"""

from __future__ import annotations


def hook_tables() -> list[tuple[str, object, str]]:
    """Every (target, hook, kind) the plugin registers with SGLang's ``HookRegistry``, in order."""
    from sglang_cp_shared_kv.srt.sglang_wiring import (
        connector_bounds,
        connector_sockets,
        decode_manifest,
        metrics,
        pool_hooks,
        server_args_hook,
        transfer,
        view_arena,
    )

    return [
        *server_args_hook.HOOKS,
        *pool_hooks.HOOKS,
        *view_arena.HOOKS,
        *transfer.HOOKS,
        *decode_manifest.HOOKS,
        *metrics.HOOKS,
        *connector_bounds.HOOKS,
        *connector_sockets.HOOKS,
    ]


def _wraps(target: str, hook: object) -> bool:
    """Whether the callable now at ``target`` is a HookRegistry wrapper chain that calls ``hook``."""
    import pkgutil

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
    """The targets (and resolution steps) of ``register`` not installed here (SGLang's registry logs a target it
    cannot wrap and goes on): installed means marked patched, and the callable there wraps this plugin's hook."""
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_cp_shared_kv.srt.sglang_wiring import startup_checks

    missing = [t for t, hook, _ in hook_tables() if t not in HookRegistry._patched or not _wraps(t, hook)]
    missing += [
        f"resolution step {step}"
        for step, check in startup_checks.RESOLUTION_HOOKS
        if check not in _HOOKS.get(step, [])
    ]
    return list(dict.fromkeys(missing))


def register() -> None:
    """Install every hook: the flag, the startup checks, the pools and allocator, the transfer and decode checks."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_cp_shared_kv.srt.sglang_wiring import startup_checks

    kinds = {"before": HookType.BEFORE, "after": HookType.AFTER, "around": HookType.AROUND}
    for target, hook, kind in hook_tables():
        HookRegistry.register(target, hook, kinds[kind])
    for step, check in startup_checks.RESOLUTION_HOOKS:
        register_resolution_hook(step)(check)
