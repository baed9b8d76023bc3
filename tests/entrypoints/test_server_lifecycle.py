"""What the server promises about itself: its OpenAPI document says what it really answers,
and when the engine core dies open streams end with an error event and the server exits
(status 1) so that an orchestrator restarts it — vLLM's default."""
from __future__ import annotations

import argparse
import json
import time

import httpx
import psutil
import pytest

from kvserve.entrypoints.openai.api_server import build_app
from tests.entrypoints.conftest import SERVER_ENGINE_ARGS, RemoteServer

pytestmark = pytest.mark.timeout(180)

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def _openapi() -> dict:
    return build_app(argparse.Namespace()).openapi()


def test_openapi_lists_the_responses_the_server_sends() -> None:
    doc = _openapi()
    paths = doc["paths"]
    op_ids = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(op_ids) == len(set(op_ids)), "duplicate operationId"
    for path, ops in paths.items():
        for method, op in ops.items():
            assert "422" not in op["responses"], f"{method} {path} still lists 422"
            if "requestBody" in op:
                assert op["responses"]["400"]["content"]["application/json"]["schema"] == ERROR_REF
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[path]["post"]["responses"]
        assert {"200", "400", "401", "404", "503"} <= set(responses)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(paths["/v1/models"]["get"]["responses"]) == {"200", "401"}
    for method in ("get", "post"):
        health = paths["/ping"][method]["responses"]
        assert set(health["200"]["content"]) == {"text/plain"} and "503" in health
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    # Non-empty prompts and messages are constraints in the schema, not only in the code.
    schemas = doc["components"]["schemas"]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    for alt in prompt:
        assert alt.get("minItems", alt.get("minLength")) == 1, alt
    messages = schemas["ChatCompletionRequest"]["properties"]["messages"]
    assert messages["minItems"] == 1 and messages["items"]["required"] == ["role"]
    assert "HTTPValidationError" not in schemas


def _engine_core_processes(srv: RemoteServer) -> list[psutil.Process]:
    return [p for p in psutil.Process(srv.proc.pid).children(recursive=True)
            if "spawn_main" in " ".join(p.cmdline())]


def test_engine_death_ends_streams_with_an_error_and_exits(tiny_llama: str) -> None:
    srv = RemoteServer(tiny_llama, [*SERVER_ENGINE_ARGS, "--uvicorn-log-level", "warning"])
    try:
        model = httpx.get(srv.url_for("/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Long", "max_tokens": 200, "temperature": 0,
                "stream": True, "ignore_eos": True}
        events: list[str] = []
        with httpx.stream("POST", srv.url_for("/v1/completions"), json=body,
                          timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:                       # the first token: it is running
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            core = _engine_core_processes(srv)
            assert core, "no engine core process found"
            for p in core:
                p.kill()
            t0 = time.monotonic()
            events += [line[6:] for line in lines if line.startswith("data: ")]
        assert time.monotonic() - t0 < 15
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "engine is dead" in error["message"].lower(), error
        # Then the server exits by itself with status 1, and nothing of it is left.
        assert srv.proc.wait(30) == 1, srv.log_text()[-3000:]
        deadline = time.monotonic() + 10
        while srv.session_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not srv.session_alive()
        assert "shutting the server down" in srv.log_text()
    finally:
        srv.close()
