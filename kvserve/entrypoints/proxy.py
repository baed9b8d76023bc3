"""`kvserve proxy`: one OpenAI-compatible front for disaggregated prefill/decode.

Each completion / chat request goes first to a prefill instance with max_tokens=1 and
`kv_transfer_params={"do_remote_decode": true}` (it computes the prompt and keeps its KV
blocks), then, with the kv_transfer_params that instance returns, to a decode instance (which
reads those blocks and generates). Clients see one server: streaming passes through as it is.

Several prefill and decode URLs may be given; each request goes to the instance with the
fewest requests in flight through this proxy (least_loaded, ties in turn) or strictly in turn
(round_robin). An instance that cannot be reached gives 503, never a hang; an instance's own
error (400, ...) is passed through. Requests P/D cannot split (n > 1, several prompts, or
kv_transfer_params set by the client) go straight to a decode instance.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

POLICIES = ("least_loaded", "round_robin")
_FORWARDED_HEADERS = ("authorization", "x-request-id")


class InstancePool:
    """The URLs of one kind (prefill or decode) and the requests in flight to each."""

    def __init__(self, urls: list[str], policy: str) -> None:
        if not urls:
            raise ValueError("at least one URL is needed")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}.")
        self.urls = [u.rstrip("/") for u in urls]
        self.policy = policy
        self.in_flight = {u: 0 for u in self.urls}
        self._turn = itertools.count()

    def pick(self) -> str:
        start = next(self._turn) % len(self.urls)
        order = self.urls[start:] + self.urls[:start]
        if self.policy == "round_robin":
            return order[0]
        return min(order, key=lambda u: self.in_flight[u])   # min keeps the first of ties

    @contextlib.contextmanager
    def acquire(self) -> Any:
        url = self.pick()
        self.in_flight[url] += 1
        try:
            yield url
        finally:
            self.in_flight[url] -= 1


def _error(status: int, message: str, err_type: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": None,
                                   "code": status}}, status_code=status)


def _unavailable(url: str, e: Exception) -> JSONResponse:
    logger.warning("Instance %s unavailable: %r", url, e)
    return _error(503, f"Instance {url} is unavailable: {type(e).__name__}: {e}",
                  "ServiceUnavailableError")


def _prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    pre = dict(body)
    for key in ("stream", "stream_options", "min_tokens"):
        pre.pop(key, None)
    pre["max_tokens"] = 1
    if chat:
        pre["max_completion_tokens"] = 1
    pre["kv_transfer_params"] = {"do_remote_decode": True}
    return pre


def _splittable(body: dict[str, Any], chat: bool) -> bool:
    if body.get("n", 1) not in (1, None) or body.get("kv_transfer_params") is not None:
        return False
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
    return chat or not (several and len(prompt) > 1)


class DisaggProxy:
    def __init__(self, prefill: InstancePool, decode: InstancePool, timeout_s: float) -> None:
        self.prefill = prefill
        self.decode = decode
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def handle(self, raw: Request, path: str, chat: bool) -> Response:
        try:
            body = await raw.json()
        except ValueError:
            return _error(400, "The request body is not valid JSON.", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "The request body must be a JSON object.", "BadRequestError")
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_HEADERS}
        if _splittable(body, chat):
            with self.prefill.acquire() as url:
                try:
                    resp = await self.client.post(url + path, json=_prefill_body(body, chat),
                                                  headers=headers)
                except httpx.HTTPError as e:
                    return _unavailable(url, e)
            if resp.status_code != 200:
                return Response(resp.content, status_code=resp.status_code,
                                media_type=resp.headers.get("content-type"))
            kv = resp.json().get("kv_transfer_params")
            body = dict(body)
            if kv:
                body["kv_transfer_params"] = kv
        return await self._decode(path, body, headers)

    async def _decode(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        stack = contextlib.ExitStack()
        url = stack.enter_context(self.decode.acquire())
        try:
            request = self.client.build_request("POST", url + path, json=body, headers=headers)
            resp = await self.client.send(request, stream=bool(body.get("stream")))
        except httpx.HTTPError as e:
            stack.close()
            return _unavailable(url, e)
        if not body.get("stream") or resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            stack.close()
            return Response(content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                # The instance died mid-stream: end the stream with an error event (as the
                # server does when its engine dies), not as if it had finished: a client
                # must not take a cut answer for a whole one. The blank line first ends an
                # event the last chunk may have cut.
                logger.warning("Stream from %s broke: %r", url, e)
                error = {"error": {"message": f"Instance {url} failed mid-stream: "
                                              f"{type(e).__name__}: {e}",
                                   "type": "ServiceUnavailableError", "param": None,
                                   "code": 503}}
                yield f"\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
            finally:
                await resp.aclose()
                stack.close()

        return StreamingResponse(relay(), media_type="text/event-stream")

    async def health(self) -> Response:
        bad = []
        for url in self.prefill.urls + self.decode.urls:
            try:
                ok = (await self.client.get(url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                bad.append(url)
        if bad:
            return _error(503, f"Unhealthy instance(s): {bad}", "ServiceUnavailableError")
        return Response(status_code=200)

    async def models(self, raw: Request) -> Response:
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_HEADERS}
        url = self.decode.pick()
        try:
            resp = await self.client.get(url + "/v1/models", headers=headers)
        except httpx.HTTPError as e:
            return _unavailable(url, e)
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"))


def build_app(prefill_urls: list[str], decode_urls: list[str], policy: str = "least_loaded",
              timeout_s: float = 600.0) -> FastAPI:
    proxy = DisaggProxy(InstancePool(prefill_urls, policy), InstancePool(decode_urls, policy),
                        timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.client.aclose()

    app = FastAPI(lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await proxy.handle(raw, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await proxy.handle(raw, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await proxy.models(raw)

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    return app


def add_proxy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", type=str, default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL",
                        help="Base URL(s) of prefill instances, e.g. http://127.0.0.1:8100.")
    parser.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL",
                        help="Base URL(s) of decode instances.")
    parser.add_argument("--policy", choices=POLICIES, default="least_loaded",
                        help="How an instance is picked among several (default: least_loaded).")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="Seconds a request to an instance may take (default: 600).")


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn
    for url in args.prefill + args.decode:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"instance URL {url!r} must start with http:// or https://")
    app = build_app(args.prefill, args.decode, args.policy, args.timeout)
    logger.info("kvserve proxy on %s:%d: prefill %s, decode %s (%s)", args.host, args.port,
                args.prefill, args.decode, args.policy)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
