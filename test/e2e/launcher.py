"""Starting SGLang's real launcher (``python -m sglang.launch_server``) on the CPU for the end-to-end tests.

The test-only platform (``cpu_platform/``) is registered for the servers alone: a ``dist-info`` carrying its
two entry points is written into a temporary directory that goes on the servers' ``PYTHONPATH``; the
test process itself never sees it. Each server runs in its own session (process group), so a test can
kill one server with everything it spawned (scheduler processes, Mooncake threads) by that group's id.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLATFORM_DIR = HERE / "cpu_platform"
DIST = "cp_shared_kv_cpu_platform-0.0.dist-info"
ENTRY_POINTS = (
    "[sglang.srt.platforms]\n"
    "cp_shared_kv_cpu = cp_shared_kv_cpu_platform:activate\n\n"
    "[sglang.srt.plugins]\n"
    "cp_shared_kv_cpu_shims = cp_shared_kv_cpu_platform:load_shims\n"
)
# SGLang's HTTP server stack, which the project's requirements leave out (its tests drive SGLang's classes
# without a server): the modules ``sglang.srt.entrypoints.http_server`` needs on a CPU machine.
SERVER_STACK = ("fastapi", "uvicorn", "uvloop", "setproctitle", "multipart", "opentelemetry", "jsonschema", "xgrammar")
# Where the server stack may be installed apart from the virtualenv (``pip install --target DIR``).
SITE_ENV = "CP_SHARED_KV_E2E_SITE"
# SGLang's bootstrap host that makes a prefill server send to nobody (its warmup's fake transfer).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


def register_platform(root: Path) -> Path:
    """Writes the platform's ``dist-info`` under ``root``; returns the directory to put on ``PYTHONPATH``."""
    dist = Path(root) / DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: cp-shared-kv-cpu-platform\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    return Path(root)


def server_env(registry: Path, **extra: str) -> dict[str, str]:
    """The servers' environment: the platform registered, the server stack's site (if apart) importable."""
    env = dict(os.environ)
    paths = [str(registry), str(PLATFORM_DIR)]
    if env.get(SITE_ENV):
        paths.append(env[SITE_ENV])
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # Mooncake over TCP on 127.0.0.1 (no RDMA device); quiet.
    env.update(MC_FORCE_TCP="1", MOONCAKE_PROTOCOL="tcp", TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    env.setdefault("MC_LOG_LEVEL", "WARNING")
    env.update(extra)
    return env


def missing_server_stack() -> list[str]:
    """Modules of the server stack that the servers could not import (empty when SGLang's server can start)."""
    code = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"
    env = server_env(Path(os.devnull).parent)
    out = subprocess.run(
        [sys.executable, "-c", code, *SERVER_STACK], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout.split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``python -m sglang.launch_server`` in its own process group, its output in ``log``."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, port: int):
        self.argv, self.log, self.port = argv, Path(log), port
        self.url = f"http://127.0.0.1:{port}"
        self._out = open(self.log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", *argv, "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until the HTTP server answers ``/model_info``; raises with the log's tail if it dies or times out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was ready:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/model_info", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.tail()}")

    def get(self, path: str, timeout_s: float = 30) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            return r.read().decode()

    def post(self, path: str, body: dict, timeout_s: float) -> tuple[int | None, str]:
        """(HTTP status, body) of a JSON POST; status None with the error's text when the connection fails."""
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError) as e:
            return None, repr(e)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-n:])

    def stop(self) -> None:
        """Kills this server's process group (the launcher and everything it started) and waits for the launcher."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            try:  # the launcher may be gone while its schedulers linger
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        finally:
            self._out.close()
