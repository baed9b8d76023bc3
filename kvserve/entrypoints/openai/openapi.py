"""The server's OpenAPI document, made to say what the server really answers.

FastAPI's generated document lists a 422 for every route with a body (we answer 400 in
OpenAI's error shape instead), no 401 / 404 / 503, and `application/json` for responses that
are server-sent events, Prometheus text or an empty body. Clients generated from the document
and schema-driven fuzzers (schemathesis) read it literally, so it is corrected here once.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvserve.entrypoints.openai.protocol import ErrorResponse

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}

_ERROR_TEXT = {
    "400": "Invalid request: a bad parameter, malformed JSON, or a prompt over the context "
           "length.",
    "401": "A valid API key is required (only when the server runs with --api-key).",
    "404": "The model named in the request is not served here.",
    "413": "The request body is larger than --max-request-body-bytes.",
    "503": "The engine is dead, or the waiting queue is full (--max-num-queued-requests).",
}

# Which error statuses each route can send, beyond 400 for a request body that fails
# validation (added wherever there is a body).
_ROUTE_ERRORS: dict[str, tuple[str, ...]] = {
    "/v1/completions": ("401", "404", "503"),
    "/v1/chat/completions": ("401", "404", "503"),
    "/v1/responses": ("401", "404", "503"),
    "/v1/responses/{response_id}": ("401", "404"),
    "/v1/models": ("401",),
    "/tokenize": ("404",),
    "/detokenize": ("404",),
}

# Responses whose media type is not JSON.
_STREAMING = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
_PLAIN_TEXT = ("/metrics",)
_EMPTY_OK = ("/health", "/ping")


def install_openapi(app: FastAPI) -> None:
    """Replace `app.openapi` with the corrected document (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            fix_openapi(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def fix_openapi(schema: dict[str, Any]) -> None:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(error_schema.pop("$defs", {}))
    components["ErrorResponse"] = error_schema
    for name in ("HTTPValidationError", "ValidationError"):   # only the dropped 422 used them
        components.pop(name, None)
    for path, operations in schema.get("paths", {}).items():
        for op in operations.values():
            _fix_operation(path, op)


def _fix_operation(path: str, op: dict[str, Any]) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    codes = list(_ROUTE_ERRORS.get(path, ()))
    if "requestBody" in op:
        codes[:0] = ["400", "413"]
    for code in codes:
        responses[code] = {"description": _ERROR_TEXT[code],
                           "content": {"application/json": {"schema": _ERROR_REF}}}
    ok = responses.setdefault("200", {"description": "Successful Response"})
    if path in _STREAMING:
        ok.setdefault("content", {})["text/event-stream"] = {
            "schema": {"type": "string", "description": "Server-sent events (stream=true): "
                       "`data: {chunk}` lines, then `data: [DONE]`."}}
    elif path in _PLAIN_TEXT:
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    elif path in _EMPTY_OK:
        ok["content"] = {"text/plain": {"schema": {"type": "string", "maxLength": 0}}}
        responses["503"] = {"description": "The engine is dead.",
                            "content": {"application/json": {"schema": _ERROR_REF}}}
