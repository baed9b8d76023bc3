"""A real `kvserve serve` subprocess on a loopback port, shared by the tests of a module
(RemoteServer is in tests/utils.py; the `client` fixture on it in tests/conftest.py)."""
from __future__ import annotations

from typing import Iterator

import pytest

# Re-exported: the tests of this folder and others import them from here.
from tests.utils import MAX_MODEL_LEN, SERVER_ENGINE_ARGS, RemoteServer, _free_port  # noqa: F401


@pytest.fixture(scope="module")
def server(tiny_llama: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llama, [*SERVER_ENGINE_ARGS, "--uvicorn-log-level", "warning"])
    try:
        yield srv
    finally:
        srv.close()
