"""``python -m sglang.launch_server ... --enable-cp-shared-kv`` refuses a bad start on a real command line.

Each case runs SGLang's real launcher in a subprocess (plugins loaded by SGLang itself) and reads
what a user sees: one line per problem, no traceback, no internal values (``None``, ``null``),
and the model-config check done before anything goes to the network (``HF_ENDPOINT`` points at a
closed local port: a download attempt would fail with a connection error instead of our line).
One case breaks a hook target the way an SGLang upgrade would (a method that no longer exists):
SGLang's hook registry logs it and goes on, and the flag refuses to start.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from plugin_models import write_model_dirs

pytestmark = pytest.mark.sglang

FLAG = "--enable-cp-shared-kv"
CP = [
    "--enable-prefill-cp",
    "--cp-strategy",
    "interleave",
    "--attn-cp-size",
    "2",
    "--tp-size",
    "2",
    "--disaggregation-mode",
    "prefill",
    "--disaggregation-transfer-backend",
    "mooncake",
]
# A launcher whose plugin registers one more hook, on a method SGLang does not have.
BROKEN = (
    "import runpy, sys\n"
    "from sglang_cp_shared_kv.srt.sglang_wiring import hooks\n"
    "hooks.HOOKS.append(('sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._gone_in_this_version',"
    " hooks.build_allocator, 'around'))\n"
    "sys.argv = ['launch_server', *sys.argv[1:]]\n"
    "runpy.run_module('sglang.launch_server', run_name='__main__')\n"
)


# A launcher on an SGLang that reports another version (the version module is what SGLang itself reads).
OTHER_VERSION = (
    "import runpy, sys\n"
    "import sglang.version\n"
    "sglang.version.__version__ = '0.5.24'\n"
    "sys.argv = ['launch_server', *sys.argv[1:]]\n"
    "runpy.run_module('sglang.launch_server', run_name='__main__')\n"
)


def _launch(argv: list[str], broken: bool = False, script: str | None = None, env: dict | None = None, logs=False):
    """(exit code, stderr lines other than SGLang's log lines (``logs``: with them), seconds) of one launcher run."""
    env = {
        **os.environ,
        "SGLANG_PLUGINS": "cp_shared_kv",
        "HF_ENDPOINT": "http://127.0.0.1:9",  # a closed port: any download attempt fails loudly
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "PYTHONWARNINGS": "ignore",
        **(env or {}),
    }
    script = BROKEN if broken else script
    head = [sys.executable, "-c", script] if script else [sys.executable, "-m", "sglang.launch_server"]
    start = time.monotonic()
    proc = subprocess.run(head + argv, capture_output=True, text=True, timeout=240, env=env)
    # SGLang's own log lines ("[2026-01-01 00:00:00] ...") are not ours to judge.
    lines = [x for x in proc.stderr.splitlines() if x.strip() and (logs or not re.match(r"\[\d{4}-\d\d-\d\d ", x))]
    return proc.returncode, lines, time.monotonic() - start


def _assert_clean(rc: int, lines: list[str]) -> None:
    assert rc != 0
    assert lines and not any("Traceback" in x for x in lines), lines
    assert all(x.startswith(f"{FLAG}: ") and x.endswith(".") for x in lines), lines
    assert not any(" None" in x or " null" in x for x in lines), lines


def test_bare_flag_lists_every_problem_cleanly():
    rc, lines, _ = _launch(["--model-path", "x", FLAG])
    _assert_clean(rc, lines)
    fixes = ["huggingface-cli download x", "add --enable-prefill-cp"]
    fixes += ["use --cp-strategy interleave", "use --disaggregation-mode prefill"]
    assert len(lines) == len(fixes), lines
    for fix, line in zip(fixes, lines):
        assert fix in line, (fix, line)
    assert "--cp-strategy is not set" in lines[2] and "--disaggregation-mode is not set" in lines[3], lines


def test_model_config_is_checked_before_the_network():
    """Also: an expert override of the SGLang version check warns once, naming both versions, and
    every other check still runs (this launcher reports SGLang 0.5.24)."""
    env = {"SGLANG_CP_SHARED_KV_ANY_SGLANG": "1"}
    rc, lines, seconds = _launch(["--model-path", "x", FLAG, *CP], script=OTHER_VERSION, env=env, logs=True)
    warnings = [x for x in lines if "SGLang 0.5.24 is installed" in x]
    assert len(warnings) == 1, lines  # logged at WARNING (SGLang's log format shows no level)
    assert "checked against SGLang 0.5.23 only; starting anyway" in warnings[0], lines
    lines = [x for x in lines if not re.match(r"\[\d{4}-\d\d-\d\d ", x)]
    _assert_clean(rc, lines)
    assert len(lines) == 1 and "neither a local directory nor a model in the Hugging Face cache" in lines[0], lines
    assert seconds < 120, seconds


def test_a_real_model_passes_the_model_check(tmp_path):
    write_model_dirs(tmp_path, ["mla"])  # a DSA config resolves only with CUDA
    rc, lines, _ = _launch(["--model-path", str(tmp_path / "mla"), FLAG, *CP, "--device", "cpu"])
    _assert_clean(rc, lines)  # refused for other reasons on this CPU machine, never for the model path
    assert not any("--model-path" in x for x in lines), lines
    assert any("--device cpu" in x for x in lines), lines


def test_a_hook_sglang_could_not_install_refuses_the_start():
    rc, lines, _ = _launch(["--model-path", "x", FLAG, *CP], broken=True)
    # SGLang's registry logs the failure with its traceback and goes on; then the flag refuses.
    ours = [i for i, x in enumerate(lines) if x.startswith(f"{FLAG}: ")]
    assert ours, lines
    assert any("AttributeError" in x and "_gone_in_this_version" in x for x in lines[: ours[0]]), lines
    lines = lines[ours[0] :]
    _assert_clean(rc, lines)
    assert len(lines) == 1, lines
    assert "SGLang did not install the plugin's hook(s) on " in lines[0], lines
    assert "KVCacheConfigurator._gone_in_this_version" in lines[0] and "_build_mla_kv_pool" not in lines[0], lines


def test_a_broken_hook_is_harmless_without_the_flag():
    rc, lines, _ = _launch(["--model-path", "dummy", "--help"], broken=True)
    assert rc == 0, lines
