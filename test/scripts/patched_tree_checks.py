"""Checks run inside the patched SGLang tree (``test_upstream_patch.py`` runs them there, never directly).

They hold only where ``make_upstream_patch.patched_env`` set up the interpreter: SGLang imported from
the patched copy, the plugin not importable, the flag from SGLang's own argument group.
"""

from __future__ import annotations

import argparse
import os
import sys

import pytest

TREE = os.environ["CP_SHARED_KV_PATCHED_TREE"]


def test_every_module_of_the_prefix_imports():
    """The modules the series has added or edited so far (``CP_SHARED_KV_PREFIX_MODULES``) import."""
    import importlib

    mods = [m for m in os.environ.get("CP_SHARED_KV_PREFIX_MODULES", "").split(",") if m]
    assert mods, "CP_SHARED_KV_PREFIX_MODULES is empty"
    for mod in mods:
        importlib.import_module(mod)


def test_sglang_is_the_patched_copy_and_the_plugin_is_not_importable():
    import sglang

    assert os.path.dirname(sglang.__file__) == os.path.join(TREE, "python", "sglang")
    with pytest.raises(ModuleNotFoundError, match="plugin-only"):
        import sglang_cp_shared_kv.srt.plugin  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match="plugin-only"):
        import sglang_cp_shared_kv.srt.sglang_wiring.hooks  # noqa: F401
    assert not [p for p in sys.path if os.path.isdir(os.path.join(p or ".", "sglang_cp_shared_kv"))]


def test_the_flag_is_a_server_args_field():
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert "--enable-cp-shared-kv" in parser._option_string_actions
    help_text = "".join(parser.format_help().split())  # argparse wraps lines, also at hyphens
    assert "storedonce,onrank(page%attn-cp-size)" in help_text  # the plugin's help, %-formatted by argparse
    on = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m", "--enable-cp-shared-kv"]))
    off = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m"]))
    assert on.enable_cp_shared_kv is True and off.enable_cp_shared_kv is False
    assert not HookRegistry._patched  # nothing was hooked: the wiring is in SGLang's source


def test_the_sites_call_the_patched_modules():
    """Each edited SGLang module imports, and the modules the series added are the ones our names resolve to."""
    import importlib

    for mod in (
        "sglang.srt.mem_cache.kv_cache_configurator",
        "sglang.srt.model_executor.pool_configurator",
        "sglang.srt.model_executor.forward_batch_info",
        "sglang.srt.managers.schedule_policy",
        "sglang.srt.layers.attention.kv_shard_hooks",
        "sglang.srt.arg_groups.pipeline",
        "sglang.srt.disaggregation.mooncake.conn",
    ):
        importlib.import_module(mod)
    from sglang.srt.layers.attention import kv_shard_hooks

    from sglang_cp_shared_kv.srt.sglang_wiring import sharded_kv_pool

    assert sharded_kv_pool.__name__ == "sglang.srt.mem_cache.cp_shared_kv.sharded_kv_pool"
    assert "prepare_forward" in kv_shard_hooks.prepare_kv_shard_forward.__code__.co_names


def test_with_the_flag_off_sglang_builds_its_own_pool_and_allocator(tmp_path):
    """SGLang's pool dispatch and allocator builder, the series' edits in them, build SGLang's own DSA pool
    and paged allocator for a prefill CP server without the flag, and leave the sharded sender off."""
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import prepare_server_args

    from demo.sglang_parts import build_pool_and_allocator, prefill_cp_argv, write_model_dirs

    dirs = write_model_dirs(tmp_path, ["mla", "dsa"])
    server_args = prepare_server_args(prefill_cp_argv(str(tmp_path), 64))
    server_args.resolve_once()
    assert server_args.enable_cp_shared_kv is False
    publish(server_args, role="scheduler")
    config = model_config_of(prepare_server_args(["--model-path", str(dirs["dsa"])]))
    pool, allocator = build_pool_and_allocator(config, 8 * 64, 4, 64, cp=(1, 2))
    assert type(pool) is DSATokenToKVPool
    assert type(allocator) is PagedTokenToKVPoolAllocator
    assert not get_parallel().enable_kv_cache_sharding
