"""``--enable-cp-shared-kv`` through SGLang 0.5.23's real launcher, parser, YAML config and process spawn.

Everything that imports sglang runs in subprocesses: the plugin's hooks
cannot be undone in-process, and pytest's own process must stay stock.
(``python -m sglang.launch_server --help`` listing the flag is checked from an installed wheel:
``test/scripts/test_wheel.py``.)
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys

import pytest
from plugin_models import run_worker, write_model_dirs

pytestmark = pytest.mark.sglang

_ENV = {**os.environ, "SGLANG_PLUGINS": "cp_shared_kv", "PYTHONWARNINGS": "ignore"}


def _child_reads_flag(server_args, queue) -> None:
    """Runs in a spawned child: the record arrives pickled, as SGLang sends it to schedulers."""
    queue.put((type(server_args).__name__, getattr(server_args, "enable_cp_shared_kv", "missing")))


def _worker(model_dir: str, yaml_dir: str) -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    base = ["--model-path", model_dir, "--device", "cpu", "--skip-tokenizer-init"]
    out = {}
    out["parsed_on"] = getattr(prepare_server_args(base + ["--enable-cp-shared-kv"]), "enable_cp_shared_kv", "missing")
    out["parsed_off"] = getattr(prepare_server_args(base), "enable_cp_shared_kv", "missing")
    for name in ("on", "off"):
        out[f"yaml_{name}"] = getattr(
            prepare_server_args(["--config", os.path.join(yaml_dir, f"{name}.yaml")]), "enable_cp_shared_kv", "missing"
        )

    # Pickled into a spawned process, the way SGLang hands server args to its schedulers.
    server_args = prepare_server_args(base + ["--enable-cp-shared-kv"])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_reads_flag, args=(server_args, queue))
    child.start()
    out["spawned_child"] = list(queue.get(timeout=120))
    child.join(timeout=60)
    out["child_exit"] = child.exitcode

    # ServerArgs' own __reduce__ keeps it on a round trip, unresolved and resolved.
    import pickle

    out["pickle_roundtrip"] = pickle.loads(pickle.dumps(server_args)).enable_cp_shared_kv
    out["is_server_args"] = isinstance(server_args, ServerArgs)
    out.update(_resolved_flag_off(model_dir))
    print("RESULT:" + json.dumps(out))


def _resolved_flag_off(model_dir: str) -> dict:
    """A flag-off configuration's resolved values and the hooked targets of this process (plugins loaded)."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import prepare_server_args

    argv = [
        "--model-path",
        model_dir,
        "--device",
        "cpu",
        "--skip-tokenizer-init",
        "--enable-prefill-cp",
        "--cp-strategy",
        "interleave",
        "--attn-cp-size",
        "2",
        "--tp-size",
        "2",
        "--random-seed",
        "0",
    ]
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    resolved = {k: repr(v) for k, v in server_args.resolved_dict().items()}
    return {"resolved": resolved, "hooked_targets": sorted(HookRegistry._patched)}


def _resolved_dict_worker(model_dir: str) -> None:
    """``_resolved_flag_off`` in a process that loads plugins as SGLang does (run without ours: stock)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    print("RESULT:" + json.dumps(_resolved_flag_off(model_dir)))


def _run(*args: str, env: dict | None = None) -> dict:
    return run_worker([__file__, *args], env or _ENV, 240)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_model_dirs(tmp_path_factory.mktemp("models"), ["gqa"])["gqa"])


@pytest.fixture(scope="module")
def worker_results(model_dir, tmp_path_factory) -> dict:
    yaml_dir = tmp_path_factory.mktemp("yaml")
    for name, value in (("on", "true"), ("off", "false")):
        (yaml_dir / f"{name}.yaml").write_text(
            f"model-path: {model_dir}\ndevice: cpu\nskip-tokenizer-init: true\nenable-cp-shared-kv: {value}\n"
        )
    return _run("worker", model_dir, str(yaml_dir))


def _sglang_cli() -> str:
    return os.path.join(os.path.dirname(sys.executable), "sglang")


def test_sglang_serve_takes_the_flag(model_dir):
    """``sglang serve`` loads plugins before parsing (its ``--help`` prints before they load, so it does not
    list the flag: pinned 0.5.23 behaviour, documented), so the flag is accepted and the startup checks run
    (here they reject)."""
    argv = [_sglang_cli(), "serve", "--model-path", model_dir, "--device", "cpu", "--skip-tokenizer-init"]
    serve = subprocess.run(argv + ["--enable-cp-shared-kv"], capture_output=True, text=True, timeout=240, env=_ENV)
    assert serve.returncode != 0
    assert (
        "--enable-cp-shared-kv: prefill CP is off, and the KV is sharded over its ranks; add --enable-prefill-cp"
        in serve.stderr
    )


def test_parse_with_and_without_flag(worker_results):
    assert worker_results["parsed_on"] is True
    assert worker_results["parsed_off"] is False
    assert worker_results["is_server_args"] is True


def test_yaml_config(worker_results):
    assert worker_results["yaml_on"] is True
    assert worker_results["yaml_off"] is False


def test_survives_pickling_into_spawned_child(worker_results):
    assert worker_results["spawned_child"] == ["ServerArgs", True]
    assert worker_results["child_exit"] == 0
    assert worker_results["pickle_roundtrip"] is True


def test_flag_off_resolves_exactly_as_stock(model_dir, worker_results):
    """The same flag-off configuration resolves to the same values with the plugin loaded and without it."""
    with_plugin = worker_results
    stock = _run("resolved", model_dir, env={**_ENV, "SGLANG_PLUGINS": "no-such-plugin"})
    assert stock["hooked_targets"] == []
    assert "sglang.srt.server_args.ServerArgs.add_cli_args" in with_plugin["hooked_targets"]
    assert with_plugin["resolved"] == stock["resolved"]


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        _worker(sys.argv[2], sys.argv[3])
    else:
        _resolved_dict_worker(sys.argv[2])
