"""The upstream patch series, tested as applied: built from the plugin, applied to a copy of the installed
SGLang 0.5.23, and the project's SGLang-path tests run there with the plugin not importable.

CI runs the flag and import checks and the sharded pools' equivalence, read state and view arena tests
(``FAST``); ``CP_SHARED_KV_UPSTREAM_FULL=1`` adds the startup checks through SGLang's real resolution
pipeline, the pools' multi-rank read contract and the series' own tests.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="SGLang's pool writers are Triton kernels: CPU needs TRITON_INTERPRET=1",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
# The project's tests run in the patched tree, by file name (wherever under test/ they now are).
FAST = [
    "patched_tree_checks.py",
    "test_plugin_sharded_pool.py::test_sglang_pools_store_exactly_the_owned_rows",
    "test_read_state.py",
    "test_view_arena.py",
]
FULL = [
    "test_plugin_sharded_pool.py",
    "test_plugin_startup_checks.py",
]


def _generator():
    spec = importlib.util.spec_from_file_location("make_upstream_patch", ROOT / "scripts" / "make_upstream_patch.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return _generator()


@pytest.fixture(scope="module")
def series(gen, tmp_path_factory):
    return gen.build_series(tmp_path_factory.mktemp("series"))


@pytest.fixture(scope="module")
def tree(gen, series, tmp_path_factory):
    root = tmp_path_factory.mktemp("patched")
    gen.apply_series(series, root)  # git apply --check, then git apply, patch by patch
    return root


def test_series_has_the_commits_and_edits_no_installed_file(gen, series, tree):
    assert [p.name[:4] for p in series] == [f"{i:04d}" for i in range(1, len(gen.COMMITS) + 1)]
    text = "".join(p.read_text() for p in series)
    for forbidden in ("HookRegistry", "sys.excepthook", "__closure__", "sglang_cp_shared_kv"):
        added = [line for line in text.splitlines() if line.startswith("+") and forbidden in line]
        assert not added, (forbidden, added[:3])
    # The edited SGLang files are copies; the rest still point at the installed tree.
    for rel in {r for p in series for r in gen.patch_paths(p)}:
        assert not (tree / rel).is_symlink(), rel
    assert (tree / "python/sglang/srt/server_args.py").is_symlink()


def test_a_site_that_no_longer_matches_stops_the_generator(gen, monkeypatch, tmp_path):
    site = gen.SITES[0]
    monkeypatch.setattr(site, "old", site.old + "# not in SGLang 0.5.23")
    with pytest.raises(gen.GenerationError, match="found 0 times, expected 1"):
        gen.build_series(tmp_path / "out")


def test_a_hook_without_a_site_stops_the_generator(gen, monkeypatch, tmp_path):
    monkeypatch.setattr(gen, "SITES", gen.SITES[1:])
    with pytest.raises(gen.GenerationError, match="plugin hooks without a site"):
        gen.build_series(tmp_path / "out")


def test_plugin_prose_in_a_shipped_module_stops_the_generator(gen, tmp_path):
    """A docstring that describes the plugin's hooks would be false in SGLang: the generator names its line."""
    mod = "srt.sglang_wiring.connector_sockets"
    source = (gen.SRC / "srt" / "sglang_wiring" / "connector_sockets.py").read_text()
    assert gen.module_text(mod, gen.SRC / "srt" / "sglang_wiring" / "connector_sockets.py", gen.shipped_modules())
    copy = tmp_path / "connector_sockets.py"
    copy.write_text(
        source.replace('"""Wraps ``CommonKVManager._connect``', '"""AROUND hook on ``CommonKVManager._connect``')
    )
    with pytest.raises(gen.GenerationError, match=r"connector_sockets:\d+: says 'AROUND'"):
        gen.module_text(mod, copy, gen.shipped_modules())


def test_docs_list_the_files_of_the_series(gen, series):
    """docs/upstream.md carries the series' diff stat; its file list must be the series' (regenerate with
    ``python scripts/make_upstream_patch.py --docs`` after a module moves)."""
    stat = (series[0].parent / "stat.txt").read_text()
    doc = gen.DOC.read_text()

    def files(text: str) -> set[str]:
        return {line.split("|")[0].strip() for line in text.splitlines() if line.startswith(" ") and "|" in line}

    assert files(stat) and files(stat) <= files(doc), sorted(files(stat) - files(doc))


def _run_in_tree(gen, tree, args: list[str]):
    env = {**gen.patched_env(tree), "CP_SHARED_KV_PATCHED_TREE": str(tree)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, proc.stdout[-2000:]


def test_project_tests_pass_on_the_patched_tree_without_the_plugin(gen, tree):
    """The project's own tests, unchanged, their ``sglang_cp_shared_kv.srt`` names resolving to the series'
    modules in the patched SGLang (``patched_env``)."""
    full = os.environ.get("CP_SHARED_KV_UPSTREAM_FULL") == "1"
    files = []
    for name in FAST + (FULL if full else []):
        path, _, test = name.partition("::")
        files.append(str(gen.find_test(path).relative_to(ROOT)) + (f"::{test}" if test else ""))
    _run_in_tree(gen, tree, files)
    if full:  # the copies the series' last commit adds, as SGLang would run them
        _run_in_tree(gen, tree, [str(tree / "test/srt/cp_shared_kv")])
