"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM, served by uvicorn.

    kvserve serve /path/to/model --port 8000 [--api-key KEY] [engine flags...]

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/responses,
GET /v1/responses/{id}, POST /tokenize,
POST /detokenize, GET /health (503 once the engine is dead), GET|POST /ping, GET /version,
GET /load, GET /metrics (Prometheus).

Errors are OpenAI-shaped JSON (`{"error": {"message", "type", "param", "code"}}`): 400 for
invalid parameters, malformed JSON and prompts over the context length; 401 on /v1/* without
the right `--api-key`; 404 for an unknown model; 503 when the engine is dead or the waiting
queue is full (`--max-num-queued-requests`).

A client that goes away aborts its requests in the engine (their KV blocks are freed at
once): a non-streaming handler runs as a task that a disconnect cancels, and a stream's
generator is cancelled by Starlette when the connection drops.

SIGINT / SIGTERM: uvicorn stops accepting, the lifespan exit shuts the engine down (the
engine core process with it), and the process exits.

The engine core (with data parallelism: any of the engines) dies: open streams end with an
error event (then `[DONE]`), and the server exits with status 1 so that an orchestrator
restarts it (vLLM's default); `--keep-alive-on-engine-death` keeps it up answering 503
instead (with data parallelism the other engines keep serving, /health answers 503). The OpenAPI document
(openapi.py) lists the statuses and media types the routes really send.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import secrets
import socket
import threading
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import kvserve
from kvserve import envs
from kvserve.entrypoints.openai.openapi import install_openapi
from kvserve.entrypoints.openai.protocol import (DEFAULT_SAMPLING_KEYS, ChatCompletionRequest,
                                                 CompletionRequest, DetokenizeRequest,
                                                 EmbeddingRequest, LoadLoRAAdapterRequest,
                                                 RerankRequest, ResponsesRequest, ScoreRequest,
                                                 TokenizeRequest, UnloadLoRAAdapterRequest)
from kvserve.entrypoints.openai.serving_chat import OpenAIServingChat, load_chat_template
from kvserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvserve.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from kvserve.entrypoints.openai.serving_engine import (LoadTracker, RequestLimits, ServingError,
                                                       StreamingResult, create_error_response,
                                                       is_engine_dead_error)
from kvserve.entrypoints.openai.serving_models import OpenAIServingModels
from kvserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from kvserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from kvserve.metrics.loggers import LoggingStatLogger
from kvserve.metrics.prometheus import PrometheusStatLogger

logger = logging.getLogger("kvserve.entrypoints.openai.api_server")

TIMEOUT_KEEP_ALIVE = 5  # seconds
# On SIGTERM, open streams get this long to finish before they are cancelled (and aborted);
# without a bound one long stream would hold the shutdown forever.
TIMEOUT_GRACEFUL_SHUTDOWN = 10  # seconds
# 499: nginx's "client closed request"; nobody reads it, but logs show what happened.
STATUS_CLIENT_CLOSED = 499
ENGINE_DEATH_POLL_S = 0.5
# --max-request-body-bytes: a prompt of 128k token ids is under 1 MiB of JSON; the limit keeps
# one request from parsing gigabytes into Python objects on the event loop.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20
# --limit-concurrency (uvicorn's): off by default, because uvicorn counts idle connections too
# and answers everyone 503 (/health included) past the limit; idle connections are closed by
# _IdleTimeoutH11Protocol instead, and --max-num-queued-requests bounds the work.
DEFAULT_LIMIT_CONCURRENCY = 0
ENGINE_DEATH_GRACE_S = 1.0

router = APIRouter()


# ---------------------------------------------------------------------- responses
def error_json(message: str, status_code: int, param: Optional[str] = None,
               err_type: Optional[str] = None) -> JSONResponse:
    body = create_error_response(message, status_code, err_type, param)
    return JSONResponse(body.model_dump(), status_code=int(status_code))


def _serving_error_json(e: ServingError) -> JSONResponse:
    return JSONResponse(e.to_response().model_dump(), status_code=e.status_code)


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that closes its request tracker however it ends: done,
    client gone (Starlette cancels the body), or never started at all."""

    def __init__(self, result: StreamingResult) -> None:
        super().__init__(result.body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._result = result

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._result.tracker.close()
            try:
                await self._result.body.aclose()
            except (RuntimeError, asyncio.CancelledError):
                pass


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def _run_cancellable(raw_request: Request, handler: Awaitable[Any]) -> Any:
    """Run a handler until it returns or the client disconnects, whichever comes first; a
    disconnect cancels the handler (which aborts its engine requests). Returns None then.

    Safe only after the body was read (FastAPI has parsed it by now): from then on the only
    message left to receive is the disconnect."""
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:   # the server is shutting down
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def _handle(raw_request: Request, call: Callable[[], Awaitable[Any]]) -> Response:
    """Run a generation handler and turn what it returns or raises into a response."""
    try:
        result = await _run_cancellable(raw_request, call())
    except ServingError as e:
        return _serving_error_json(e)
    except Exception as e:
        if is_engine_dead_error(e):
            return error_json(f"The engine is dead: {e}", HTTPStatus.SERVICE_UNAVAILABLE)
        logger.exception("Error while handling %s", raw_request.url.path)
        return error_json(f"{type(e).__name__}: {e}", HTTPStatus.INTERNAL_SERVER_ERROR)
    if result is None:
        return Response(status_code=STATUS_CLIENT_CLOSED)
    if isinstance(result, StreamingResult):
        return SSEResponse(result)
    # pydantic-core writes the JSON itself (faster than model_dump + json.dumps).
    return Response(content=result.model_dump_json(), media_type="application/json")


# ---------------------------------------------------------------------- routes
def _state(raw_request: Request) -> Any:
    return raw_request.app.state


async def _fresh_stats(state: Any) -> Optional[dict[int, dict]]:
    """Every live engine's current scheduler numbers (one utility call each), pushed into the
    metrics so that /metrics, /load and the queue-full check never use a stale snapshot."""
    try:
        per_engine = await asyncio.wait_for(state.engine_client.get_stats_per_engine(),
                                            timeout=5.0)
    except Exception as e:   # dead or busy engine: keep the last numbers
        logger.debug("get_stats failed: %s", e)
        return None
    state.load.update_all(per_engine)
    for index, stats in per_engine.items():
        state.prometheus_per_engine[index].update_scheduler_stats(stats)
        state.log_stat_loggers[index].update_scheduler_stats(stats)
    return per_engine


@router.get("/health")
async def health(raw_request: Request) -> Response:
    try:
        await _state(raw_request).engine_client.check_health()
    except Exception as e:
        return error_json(f"The engine is dead: {e}", HTTPStatus.SERVICE_UNAVAILABLE)
    return Response(status_code=200, media_type="text/plain")


@router.get("/ping")
async def ping(raw_request: Request) -> Response:
    return await health(raw_request)


@router.post("/ping")
async def ping_post(raw_request: Request) -> Response:   # SageMaker's health check is a POST
    return await health(raw_request)


@router.get("/version")
async def show_version() -> JSONResponse:
    return JSONResponse({"version": kvserve.__version__})


@router.get("/load")
async def show_load(raw_request: Request) -> JSONResponse:
    state = _state(raw_request)
    await _fresh_stats(state)
    load = state.load
    return JSONResponse({"server_load": load.num_requests,
                         "num_requests_running": load.engine_running,
                         "num_requests_waiting": load.engine_waiting})


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    state = _state(raw_request)
    await _fresh_stats(state)
    body, content_type = state.prometheus.render()
    return Response(content=body, media_type=content_type)


@router.get("/v1/models")
async def show_available_models(raw_request: Request) -> JSONResponse:
    return JSONResponse(content=_state(raw_request).serving_models.show_available_models().model_dump())


def _runtime_lora_off() -> JSONResponse:
    return error_json("Runtime LoRA updating is off (set KVSERVE_ALLOW_RUNTIME_LORA_UPDATING=1).",
                      HTTPStatus.NOT_FOUND, err_type="NotFoundError")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    """Register (checked) and load an adapter on the engines; vLLM's plain-text answer."""
    state = _state(raw_request)
    if not envs.get("KVSERVE_ALLOW_RUNTIME_LORA_UPDATING"):
        return _runtime_lora_off()
    try:
        lora = state.serving_models.add_lora(request.lora_name, request.lora_path)
    except ValueError as e:
        return error_json(str(e), HTTPStatus.BAD_REQUEST, param="lora_path")
    try:
        await state.engine_client.engine_core.call_utility_all_async("add_lora", lora)
    except Exception as e:   # the engine could not load it after all: forget it again
        state.serving_models.remove_lora(lora.lora_name)
        return error_json(f"Loading LoRA adapter {lora.lora_name!r} failed: {e}",
                          HTTPStatus.BAD_REQUEST, param="lora_path")
    return Response(content=f"Success: LoRA adapter '{lora.lora_name}' added successfully.",
                    media_type="text/plain")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    state = _state(raw_request)
    if not envs.get("KVSERVE_ALLOW_RUNTIME_LORA_UPDATING"):
        return _runtime_lora_off()
    try:
        lora = state.serving_models.remove_lora(request.lora_name)
    except KeyError:
        return error_json(f"The LoRA adapter '{request.lora_name}' cannot be found.",
                          HTTPStatus.NOT_FOUND, param="lora_name", err_type="NotFoundError")
    await state.engine_client.engine_core.call_utility_all_async("remove_lora", lora.lora_int_id)
    return Response(content=f"Success: LoRA adapter '{lora.lora_name}' removed successfully.",
                    media_type="text/plain")


def _handler_route(request_type: type, attr: str, method: str, warn: bool) -> Callable:
    """An endpoint that parses a `request_type` body and hands it to `state.<attr>.<method>`."""
    async def endpoint(request: Any, raw_request: Request) -> Response:
        handler = getattr(_state(raw_request), attr)
        if warn:
            _warn_ignored(request)
        return await _handle(raw_request, lambda: getattr(handler, method)(request, raw_request))
    endpoint.__name__ = method
    endpoint.__annotations__ = {"request": request_type, "raw_request": Request,
                                "return": Response}
    return endpoint


# (paths, body type, handler attribute on the app state, its method, warn on ignored fields)
_HANDLER_ROUTES = (
    (("/v1/completions",), CompletionRequest, "serving_completion", "create_completion", True),
    (("/v1/chat/completions",), ChatCompletionRequest, "serving_chat", "create_chat_completion",
     True),
    (("/v1/responses",), ResponsesRequest, "serving_responses", "create_response", True),
    (("/v1/embeddings",), EmbeddingRequest, "serving_embedding", "create_embedding", True),
    (("/v1/score", "/score"), ScoreRequest, "serving_embedding", "create_score", False),
    (("/v1/rerank", "/rerank", "/v2/rerank"), RerankRequest, "serving_embedding",
     "create_rerank", False),
    (("/tokenize",), TokenizeRequest, "serving_tokenization", "create_tokenize", False),
    (("/detokenize",), DetokenizeRequest, "serving_tokenization", "create_detokenize", False),
)
for _paths, _type, _attr, _method, _warn in _HANDLER_ROUTES:
    _endpoint = _handler_route(_type, _attr, _method, _warn)
    for _path in _paths:
        router.post(_path)(_endpoint)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, raw_request: Request) -> Response:
    handler: OpenAIServingResponses = _state(raw_request).serving_responses

    async def get() -> Any:
        return handler.retrieve_json(response_id)
    return await _handle(raw_request, get)


def _warn_ignored(request: Any) -> None:
    if request.ignored_fields:
        logger.warning("The following fields were present in the request but ignored: %s",
                       request.ignored_fields)


# ---------------------------------------------------------------------- errors
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """Pydantic / JSON errors are 400s (FastAPI's default is 422), in OpenAI's shape."""
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return error_json(f"Malformed JSON in the request body: {detail}".rstrip(": "),
                              HTTPStatus.BAD_REQUEST)
    parts, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # Union members repeat the field path with the type tried; keep the field names.
        loc = [x for x in loc if not x.startswith(("list[", "str", "int", "function-"))]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        field = ".".join(loc)
        param = param or field or None
        parts.append(f"{field}: {msg}" if field else msg)
    message = "; ".join(dict.fromkeys(parts)) or "Invalid request."
    return error_json(message, HTTPStatus.BAD_REQUEST, param=param)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_json(str(exc.detail), exc.status_code)


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                         f"The request body is larger than {limit} bytes "
                         f"(--max-request-body-bytes).")


class BodySizeLimitMiddleware:
    """Request bodies over `limit` bytes are refused with 413 without being read into memory:
    at once when Content-Length says so, else (chunked bodies) as soon as the bytes received
    pass the limit. Pure ASGI, so streamed responses pass through untouched."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            if not length.isdigit():
                response = error_json(f"Invalid Content-Length {length[:32]!r}.",
                                      HTTPStatus.BAD_REQUEST)
            else:
                response = error_json(_BodyTooLarge(self.limit).detail,
                                      HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            # Connection: close, so that the server does not read the body it refused.
            response.headers["Connection"] = "close"
            return await response(scope, receive, send)
        received = 0

        async def counting_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # FastAPI re-raises HTTPExceptions from reading the body: a 413 response.
                    raise _BodyTooLarge(self.limit)
            return message

        await self.app(scope, counting_receive, send)


def _idle_timeout_protocol() -> type:
    """uvicorn's h11 protocol, plus: a connection that has not sent a complete request head
    within `timeout_keep_alive` seconds of connecting (or of its last response) is closed.
    uvicorn closes idle keep-alive connections only after a first request, so thousands of
    connections that never send one (or send their head a byte at a time) would otherwise
    hold a socket each forever."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class IdleTimeoutH11Protocol(H11Protocol):
        _head_deadline: Optional[float] = None

        def connection_made(self, transport: Any) -> None:   # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timeout()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                return
            if self.conn.their_state is h11.IDLE and self.timeout_keep_alive_task is None:
                self._arm_head_timeout()         # a partial head: the same deadline holds
            elif self.conn.their_state is not h11.IDLE:
                self._head_deadline = None       # a request is in: the next one gets a new one

        def _arm_head_timeout(self) -> None:
            now = self.loop.time()
            if self._head_deadline is None:
                self._head_deadline = now + self.timeout_keep_alive
            self.timeout_keep_alive_task = self.loop.call_later(
                max(0.0, self._head_deadline - now), self.timeout_keep_alive_handler)

    return IdleTimeoutH11Protocol


class AuthenticationMiddleware:
    """`--api-key`: /v1/* needs `Authorization: Bearer <key>` (pure ASGI, so streaming and
    disconnects pass through untouched). The other routes (/health, /metrics, ...) are open,
    as in vLLM."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self._tokens = [f"Bearer {k}".encode() for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path.startswith("/v1"):
            given = Headers(scope=scope).get("Authorization", "").encode()
            # compare_digest on every key: no timing hint about which prefix matched.
            if not any([secrets.compare_digest(given, t) for t in self._tokens]):
                response = error_json("Unauthorized: a valid API key is required "
                                      "(Authorization: Bearer <key>).", HTTPStatus.UNAUTHORIZED)
                response.headers["WWW-Authenticate"] = "Bearer"
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------- app
@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state = app.state
    log_task = None
    interval = getattr(state, "log_interval", 0.0)
    if interval and not getattr(state, "disable_log_stats", True):
        log_task = asyncio.create_task(_log_stats_periodically(state, interval))
    death_task = asyncio.create_task(_watch_engine_death(state))
    try:
        yield
    finally:
        death_task.cancel()
        if log_task is not None:
            log_task.cancel()
        shutdown_engine(state)


async def _watch_engine_death(state: Any) -> None:
    """vLLM's default: once the engine core is dead the server exits (status 1), so that an
    orchestrator restarts it instead of it answering 503 forever. Open streams first get
    their error event (the output handler has already failed them). The engine client's
    monitor thread notices a dead core within a second; polling its flag costs nothing."""
    engine = getattr(state, "engine_client", None)
    if engine is None:
        return
    # errored is also true after our own shutdown(); that is not a death.
    while not (engine.errored and not getattr(state, "engine_shut_down", False)):
        await asyncio.sleep(ENGINE_DEATH_POLL_S)
    state.engine_died = True
    if getattr(state, "keep_alive_on_engine_death", False):
        logger.error("The engine core is dead; staying up (--keep-alive-on-engine-death): "
                     "every request gets 503 until the server is restarted.")
        return
    logger.error("The engine core is dead: shutting the server down (exit status 1). Pass "
                 "--keep-alive-on-engine-death to keep answering 503 instead.")
    await asyncio.sleep(ENGINE_DEATH_GRACE_S)    # let open streams write their error event
    server = getattr(state, "server", None)
    if server is not None:
        server.should_exit = True


async def _log_stats_periodically(state: Any, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        await _fresh_stats(state)
        for log_logger in state.log_stat_loggers:     # one line per engine, as vLLM
            log_logger.log()


def shutdown_engine(state: Any) -> None:
    """Idempotent: called from the lifespan exit and from run_server's `finally`."""
    engine = getattr(state, "engine_client", None)
    if engine is not None and not getattr(state, "engine_shut_down", False):
        state.engine_shut_down = True
        logger.info("Shutting down the engine.")
        try:
            engine.shutdown()
        except Exception:
            logger.exception("Error while shutting the engine down")


def build_app(args: argparse.Namespace) -> FastAPI:
    app = FastAPI(title="kvserve OpenAI-compatible API", version=kvserve.__version__,
                  lifespan=_lifespan, root_path=getattr(args, "root_path", None) or "")
    app.include_router(router)
    install_openapi(app)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    # `kvserve serve` defaults --api-key to KVSERVE_API_KEY; args made elsewhere may lack it.
    api_key = getattr(args, "api_key", None) or envs.get("KVSERVE_API_KEY")
    if api_key:
        app.add_middleware(AuthenticationMiddleware, api_keys=[api_key])
    # Added last, so it runs first: an oversized body is refused before anything reads it.
    body_limit = getattr(args, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES)
    if body_limit:
        app.add_middleware(BodySizeLimitMiddleware, limit=body_limit)
    return app


def init_app_state(engine_client: Any, state: Any, args: argparse.Namespace) -> None:
    """Wire the handlers and the stat loggers to one engine."""
    model_config = engine_client.model_config
    config = engine_client.config
    from kvserve.lora.request import parse_lora_modules
    lora_modules = parse_lora_modules(getattr(args, "lora_modules", None))
    if lora_modules and config.lora_config is None:
        raise ValueError("--lora-modules needs --enable-lora.")
    models = OpenAIServingModels(
        model_config.served_model_names, model_config.model, model_config.max_model_len,
        lora_modules=lora_modules,
        lora_checker=(engine_client.input_processor.lora_checker
                      if config.lora_config is not None else None))
    sched = config.scheduler_config
    num_engines = config.parallel_config.data_parallel_size
    load = LoadTracker(sched.max_num_seqs * num_engines, sched.max_num_queued_requests)
    chat_template = load_chat_template(getattr(args, "chat_template", None))

    gen_cfg = model_config.generation_config or {}
    default_sampling = {k: gen_cfg[k] for k in DEFAULT_SAMPLING_KEYS if gen_cfg.get(k) is not None}
    if default_sampling:
        logger.info("Default sampling parameters from the model's generation_config.json: %s "
                    "(a request's own values win).", default_sampling)

    # One Prometheus logger (the `engine` label) and one log line per engine; data-parallel
    # engines share engine 0's registry.
    prometheus: dict[int, PrometheusStatLogger] = {}
    log_loggers = [LoggingStatLogger(i, log_interval=getattr(args, "log_stats_interval", 5.0))
                   for i in range(num_engines)]
    for index in range(num_engines):
        prometheus[index] = PrometheusStatLogger(
            models.model_name, index, registry=prometheus[0].registry if index else None,
            max_model_len=model_config.max_model_len,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            # Several API servers see the same engine totals: one of them counts them.
            count_engine_totals=getattr(engine_client, "client_index", 0) == 0)
        loggers = [prometheus[index], log_loggers[index], load.recorder(index)]
        if index == 0:
            engine_client.stat_loggers.extend(loggers)
        else:
            engine_client.stat_loggers_per_engine[index] = loggers

    state.engine_client = engine_client
    state.serving_models = models
    state.load = load
    state.prometheus = prometheus[0]
    state.prometheus_per_engine = prometheus
    state.log_stat_loggers = log_loggers
    state.log_interval = getattr(args, "log_stats_interval", 5.0)
    state.disable_log_stats = config.disable_log_stats
    state.serving_completion = OpenAIServingCompletion(engine_client, models, load, default_sampling)
    state.serving_chat = OpenAIServingChat(engine_client, models, load, default_sampling,
                                           chat_template=chat_template,
                                           response_role=getattr(args, "response_role", "assistant"),
                                           enable_auto_tools=getattr(args, "enable_auto_tool_choice", False),
                                           tool_parser=getattr(args, "tool_call_parser", None),
                                           reasoning_parser=getattr(args, "reasoning_parser", None))
    state.serving_responses = OpenAIServingResponses(state.serving_chat)
    state.serving_tokenization = OpenAIServingTokenization(engine_client, models, load,
                                                           chat_template=chat_template)
    state.serving_embedding = OpenAIServingEmbedding(engine_client, models, load)
    # xgrammar takes seconds to import; the first structured request would import it on the
    # event loop (the frontend parses constraints), so it is imported now, beside the loop.
    threading.Thread(target=_import_quietly, args=("xgrammar",), daemon=True).start()
    limits = RequestLimits(
        max_n_sequences=getattr(args, "max_n_sequences", RequestLimits.max_n_sequences),
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False))
    for handler in (state.serving_completion, state.serving_chat, state.serving_tokenization):
        handler.limits = limits


def _import_quietly(module: str) -> None:
    try:
        importlib.import_module(module)
    except Exception:      # not installed: structured requests get the install hint later
        pass


def _bind_socket(host: Optional[str], port: int, reuse_port: bool = False) -> socket.socket:
    """Bind before the (slow) model load: a port in use fails at once, and nobody can take
    the port while the engine starts. `reuse_port`: one of several API servers' sockets on
    the same port (the kernel spreads the connections over them)."""
    host = host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"Cannot listen on {host}:{port}: {e.strerror or e}.") from e
    sock.set_inheritable(True)
    return sock


async def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM (returns 0) or the engine core's death (returns 1)."""
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.engine.async_llm import AsyncLLM

    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes).")
    if args.chat_template is not None:
        load_chat_template(args.chat_template)   # a bad path fails before the model loads
    engine_args = EngineArgs.from_cli_args(args)
    if getattr(args, "reasoning_parser", None):
        _check_reasoning_parser(args.reasoning_parser, engine_args)
    sock = _bind_socket(args.host, args.port)
    return await serve_http(args, sock, lambda: AsyncLLM.from_engine_args(engine_args))


def _check_reasoning_parser(name: str, engine_args: Any) -> None:
    """A reasoning parser the tokenizer has no tokens for fails before the model loads."""
    from kvserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser
    from kvserve.tokenizer import Tokenizer

    tokenizer_path = engine_args.create_engine_config().model_config.tokenizer
    get_reasoning_parser(name)(Tokenizer.from_pretrained(tokenizer_path))


async def serve_http(args: argparse.Namespace, sock: socket.socket,
                     make_engine: Callable[[], Any], log_config: Optional[dict] = None) -> int:
    """Build the app around the engine client `make_engine()` returns and serve on `sock`
    until SIGINT/SIGTERM (returns 0) or the engine core's death (returns 1)."""
    import uvicorn

    app = build_app(args)
    try:
        engine = make_engine()
        app.state.engine_client = engine
        init_app_state(engine, app.state, args)
        extra = {"log_config": log_config} if log_config is not None else {}
        config = uvicorn.Config(app, log_level=args.uvicorn_log_level,
                                access_log=not args.disable_uvicorn_access_log,
                                timeout_keep_alive=getattr(args, "timeout_keep_alive",
                                                           TIMEOUT_KEEP_ALIVE),
                                limit_concurrency=getattr(args, "limit_concurrency",
                                                          DEFAULT_LIMIT_CONCURRENCY) or None,
                                timeout_graceful_shutdown=TIMEOUT_GRACEFUL_SHUTDOWN,
                                http=_idle_timeout_protocol(), **extra)
        server = uvicorn.Server(config)
        app.state.server = server
        app.state.keep_alive_on_engine_death = getattr(args, "keep_alive_on_engine_death", False)
        if app.state.keep_alive_on_engine_death:
            # Data parallelism: when one engine dies the others serve on (vLLM's default, and
            # ours otherwise: one engine's death is the whole server's).
            keep_serving = getattr(getattr(engine, "engine_core", None),
                                   "keep_serving_on_engine_death", None)
            if keep_serving is not None:
                keep_serving()
        host, port = sock.getsockname()[:2]
        logger.info("Starting kvserve API server (model %r) on http://%s:%d",
                    engine.model_config.model, host, port)
        await server.serve(sockets=[sock])
    finally:
        shutdown_engine(app.state)
        sock.close()
    return 1 if getattr(app.state, "engine_died", False) else 0
