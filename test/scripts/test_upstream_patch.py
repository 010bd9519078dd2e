"""The upstream patch series, tested as applied: built from the plugin, applied to a copy of the installed
SGLang 0.5.23, and the project's SGLang-path tests run there with the plugin not importable.

CI applies every prefix of the series and runs there the import check and each commit's tests (the
generator's ``Commit.tests``); ``CP_SHARED_KV_UPSTREAM_FULL=1`` adds, on the whole series, the startup
checks through SGLang's real resolution pipeline, the pools' multi-rank read contract and the series'
own tests.
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
# CP_SHARED_KV_UPSTREAM_FULL=1 adds these at the whole series, and the copies its last commit carries.
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
    first = next(s for s in gen.SITES if s.covers)
    monkeypatch.setattr(gen, "SITES", [s for s in gen.SITES if s is not first])
    with pytest.raises(gen.GenerationError, match="plugin hooks without a site"):
        gen.build_series(tmp_path / "out")


def test_a_site_that_hands_over_an_sglang_step_stops_the_generator(gen):
    """Each call site is an ordinary call: a shipped function handed one of SGLang's steps (the hook shape)
    stops the generator, and so does one whose first parameter is such a step."""
    hooks, modules, sglang = gen.plugin_hooks(), gen.shipped_modules(), gen.installed_sglang()
    texts = [gen.site_text(s, hooks, modules) for s in gen.SITES]
    gen.check_plain_calls(modules, texts, sglang)
    i = next(k for k, t in enumerate(texts) if "charge_arena(kvc)" in t)
    for arg in ("compute_page_shard_scratch_bytes", "lambda kvc: 0", "type(self).__init__", "self.__init__"):
        bad = [*texts]
        bad[i] = texts[i].replace("charge_arena(kvc)", f"charge_arena({arg}, kvc)")
        with pytest.raises(gen.GenerationError, match="one of SGLang's steps"):
            gen.check_plain_calls(modules, bad, sglang)


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


def _run_in_tree(gen, tree, args: list[str], **env):
    env = {**gen.patched_env(tree), "CP_SHARED_KV_PATCHED_TREE": str(tree), **env}
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


def _node(gen, name: str) -> str:
    path, _, test = name.partition("::")
    return str(gen.find_test(path).relative_to(ROOT)) + (f"::{test}" if test else "")


@pytest.mark.parametrize("count", range(1, len(_generator().COMMITS) + 1))
def test_every_prefix_of_the_series_imports_and_passes_its_tests(gen, series, tmp_path, count):
    """Bisect: the series applied up to each commit, the plugin not importable. Every module added or edited
    so far imports, and the project's tests of the commits so far pass, unchanged, their
    ``sglang_cp_shared_kv.srt`` names resolving to the modules the series put in SGLang (``patched_env``)."""
    tree = tmp_path / "tree"
    gen.apply_series(series[:count], tree)
    tests = [_node(gen, "patched_tree_checks.py::test_every_module_of_the_prefix_imports")]
    tests += [_node(gen, t) for c in gen.COMMITS[:count] for t in c.tests]
    _run_in_tree(gen, tree, tests, CP_SHARED_KV_PREFIX_MODULES=",".join(gen.prefix_modules(count)))
    if count == len(series) and os.environ.get("CP_SHARED_KV_UPSTREAM_FULL") == "1":
        # The SGLang-version check belongs to the plugin's hooks: the patched SGLang has neither.
        _run_in_tree(gen, tree, [_node(gen, t) for t in FULL] + ["-k", "not sglang_version"])
        carried = [str(tree / theirs) for c in gen.COMMITS for _, theirs in c.carries]
        _run_in_tree(gen, tree, carried)  # the carried tests, in SGLang's layout
