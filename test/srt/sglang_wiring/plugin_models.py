"""Tiny models and SGLang's pool builders for the plugin tests (from the package's demo harness), and the
worker runner the tests share."""

from __future__ import annotations

import json
import subprocess
import sys

from demo.sglang_parts import (  # noqa: F401 - re-exported to the tests
    LLAMA,
    MODELS,
    build_pool_and_allocator,
    configurator,
    new_request_locs,
    prefill_cp_argv,
    radix_cache,
    stock_dsa_pools,
    write_model_dirs,
)


def run_worker(argv: list[str], env: dict, timeout: float) -> dict:
    """Run ``python <argv>`` (a test file's worker) and return the JSON it printed after ``RESULT:``; a worker
    that fails or prints none fails the test with its output's tail."""
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT:")]
    assert proc.returncode == 0 and line, (
        f"worker failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(line[-1][len("RESULT:") :])
