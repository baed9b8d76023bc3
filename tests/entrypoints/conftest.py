"""A real `kvserve serve` subprocess on a loopback port, shared by the tests of a module."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator, Optional

import httpx
import openai
import pytest

# The engine flags every test server uses: small, float32, deterministic.
SERVER_ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "256",
                      "--kv-cache-memory", "16777216"]
MAX_MODEL_LEN = 256
STARTUP_TIMEOUT_S = 300.0   # a loaded shared machine builds or loads the C++ kernels slowly


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m kvserve.entrypoints.cli serve MODEL --host 127.0.0.1 --port P ...`, started
    in its own session (so teardown can reach the engine core process it spawns)."""

    def __init__(self, model: str, args: list[str], startup_timeout: float = STARTUP_TIMEOUT_S) -> None:
        self.model = model
        self.args = args
        self._log = tempfile.NamedTemporaryFile(prefix="kvserve-server-", suffix=".log", delete=False)
        self.proc: Optional[subprocess.Popen] = None
        for _ in range(3):   # another process may grab the free port first: try another
            self.port = _free_port()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", model,
                 "--host", "127.0.0.1", "--port", str(self.port), *args],
                stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
            if self._wait_healthy(startup_timeout):
                return
            if "Cannot listen on" not in self.log_text():
                break
        log = self.log_text()
        self.kill()
        raise RuntimeError(f"kvserve serve did not become healthy:\n{log[-4000:]}")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url_v1(self) -> str:
        return self.base_url + "/v1"

    def url_for(self, path: str) -> str:
        return self.base_url + "/" + path.lstrip("/")

    def log_text(self) -> str:
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def _wait_healthy(self, timeout: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url_for("/health"), timeout=2.0).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return False

    def terminate(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM and wait; returns the exit code (None if it had to be killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is None:
            return
        try:   # the whole session: the server and the engine core process it started
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)

    def session_alive(self) -> bool:
        """Whether any process of the server's session (engine core included) is left."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def close(self) -> None:
        self.terminate()
        self.kill()
        os.unlink(self._log.name)


@pytest.fixture(scope="module")
def server(tiny_llama: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llama, [*SERVER_ENGINE_ARGS, "--uvicorn-log-level", "warning"])
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    """The official client on the module's `server`. No retries: a 503 must reach the test,
    not be retried away."""
    return openai.OpenAI(base_url=server.url_v1, api_key="EMPTY", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
