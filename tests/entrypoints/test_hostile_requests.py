"""Requests built to hurt, against a real `kvserve serve` with its default limits (loopback,
bounded): each is answered 4xx (OpenAI-shaped error), and afterwards /health answers 200 and
a normal request still completes.

Cases: bodies over --max-request-body-bytes (413, with Content-Length and chunked, without the
server reading them: its memory stays flat), n and n x prompts over --max-n-sequences,
logprobs / top_logprobs / prompt_logprobs over max_logprobs, max_tokens over the context
(also past 64 bits), prompts over max_model_len (text and ids), stop / bad_words lists and
strings over their limits, seeds and priorities past 64 bits, NaN / Infinity, lone
surrogates (prompt, chat content, stop) and invalid UTF-8, JSON nested 100,000 deep, a
request chat_template (untrusted by default) and one whose Jinja loop is too long, JSON
schemas nested too deep or too large, an oversized regex; a thousand idle connections and
slow-header connections (closed by the server after 5 s, /health answered meanwhile); a
client that never reads its stream (the engine finishes; nothing is lost once it reads).
"""
from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.entrypoints.conftest import MAX_MODEL_LEN, RemoteServer

pytestmark = pytest.mark.timeout(600)

BODY_LIMIT = 16 << 20        # the default --max-request-body-bytes
MAX_N_SEQUENCES = 1024       # the default --max-n-sequences


def _healthy(server: RemoteServer, client: openai.OpenAI, model: str) -> None:
    assert httpx.get(server.url_for("/health"), timeout=10).status_code == 200
    out = client.completions.create(model=model, prompt="hello", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


def _raw(server: RemoteServer, path: str, body: bytes) -> httpx.Response:
    return httpx.post(server.url_for(path), content=body, timeout=60,
                      headers={"Content-Type": "application/json"})


def _assert_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["code"] == status
    for w in words:
        assert w.lower() in error["message"].lower(), (w, error["message"])


# ---------------------------------------------------------------------- bodies
def _send_raw(server: RemoteServer, head: bytes, chunks: Any, timeout: float = 20) -> str:
    """Send a request head and then body chunks on a raw socket until the server answers or
    stops reading; returns the status line of its answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(head)
        try:
            for chunk in chunks:
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            pass           # the server refused the body and closed: what we want
        data = b""
        try:
            while b"\r\n" not in data:
                more = s.recv(65536)
                if not more:
                    break
                data += more
        except (ConnectionResetError, socket.timeout):
            pass
        return data.split(b"\r\n", 1)[0].decode(errors="replace")


def test_body_over_the_limit_is_413_without_being_read(server: RemoteServer,
                                                       client: openai.OpenAI,
                                                       model_name: str) -> None:
    api = psutil.Process(server.proc.pid)
    rss0 = api.memory_info().rss
    size = 64 << 20
    t0 = time.monotonic()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    mib = b'{"prompt": "' + b"a" * ((1 << 20) - 12)
    status = _send_raw(server, head, (mib for _ in range(64)))
    assert status.startswith("HTTP/1.1 413"), status
    # Chunked: no Content-Length, the server counts what arrives.
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"100000\r\n" + b"a" * 0x100000 + b"\r\n"
    status = _send_raw(server, head, (chunk for _ in range(BODY_LIMIT // 0x100000 + 8)))
    assert status.startswith("HTTP/1.1 413"), status
    assert time.monotonic() - t0 < 30
    # The refused bodies were not kept: the API server grew far less than one of them.
    assert api.memory_info().rss - rss0 < 48 << 20
    _healthy(server, client, model_name)
    # Just under the limit is still parsed (a 400 for the content, not a 413).
    r = _raw(server, "/v1/completions", b'{"prompt": "' + b"a" * (BODY_LIMIT - 64) + b'"}')
    assert r.status_code in (400, 404), r.text[:300]
    _healthy(server, client, model_name)


# ---------------------------------------------------------------------- parameters
def _cases(model: str) -> dict[str, tuple[str, Any, int, tuple[str, ...]]]:
    """name -> (path, body (dict, or bytes sent as they are), status, words in the message)."""
    chat = [{"role": "user", "content": "hi"}]
    c = {"model": model, "prompt": "hi", "max_tokens": 2}
    deep_schema = json.loads('{"type": "object", "properties": {"a": ' * 60
                             + '{"type": "string"}' + "}}" * 60)
    wide_schema = {"type": "object", "properties": {
        f"p{i}_{'x' * 64}": {"type": "string"} for i in range(4000)}}
    return {
        "n=100000": ("/v1/completions", {**c, "n": 100000, "temperature": 1}, 400,
                     ("n=100000", "--max-n-sequences")),
        "n=2 x 600 prompts": ("/v1/completions", {**c, "prompt": ["hi"] * 600, "n": 2,
                                                  "temperature": 1}, 400, ("600 prompts",)),
        "chat n=5000": ("/v1/chat/completions", {"model": model, "messages": chat, "n": 5000,
                                                 "temperature": 1}, 400, ("n=5000",)),
        "logprobs=21": ("/v1/completions", {**c, "logprobs": 21}, 400, ("max_logprobs=20",)),
        "top_logprobs=21": ("/v1/chat/completions", {"model": model, "messages": chat,
                                                     "logprobs": True, "top_logprobs": 21},
                            400, ("max_logprobs=20",)),
        "prompt_logprobs=10^6": ("/v1/completions", {**c, "prompt_logprobs": 10**6}, 400,
                                 ("max_logprobs",)),
        "max_tokens=10^9": ("/v1/completions", {**c, "max_tokens": 10**9}, 400,
                            ("maximum context length",)),
        "max_tokens=2^70": ("/v1/completions", {**c, "max_tokens": 2**70}, 400,
                            ("maximum context length",)),
        "prompt over max_model_len": ("/v1/completions", {**c, "prompt": "hello " * 3000}, 400,
                                      ("maximum context length",)),
        "token ids over max_model_len": ("/v1/completions", {**c, "prompt": [5] * 100000}, 400,
                                         ("maximum context length",)),
        "1000 stop strings": ("/v1/completions", {**c, "stop": [f"s{i}" for i in range(1000)]},
                              400, ("stop",)),
        "a 100k-char stop string": ("/v1/completions", {**c, "stop": ["x" * 100000]}, 400,
                                    ("stop",)),
        "1000 bad_words": ("/v1/completions", {**c, "bad_words": [f"w{i}" for i in range(1000)]},
                           400, ("bad_words",)),
        "seed=2^70": ("/v1/completions", {**c, "seed": 2**70}, 400, ("seed",)),
        "priority=-2^70": ("/v1/completions", {**c, "priority": -(2**70)}, 400, ("priority",)),
        "temperature NaN": ("/v1/completions",
                            f'{{"model": "{model}", "prompt": "hi", "temperature": NaN}}'.encode(),
                            400, ("temperature",)),
        "top_p Infinity": ("/v1/completions",
                           f'{{"model": "{model}", "prompt": "hi", "top_p": Infinity}}'.encode(),
                           400, ("top_p",)),
        "lone surrogate in a prompt": (
            "/v1/completions", ('{"model": "%s", "prompt": "a \\ud800 b"}' % model).encode(),
            400, ()),
        "lone surrogate in chat content": (
            "/v1/chat/completions", ('{"model": "%s", "messages": [{"role": "user", '
                                     '"content": "x \\udc00"}]}' % model).encode(),
            400, ("surrogate",)),
        "lone surrogate in a stop string": (
            "/v1/completions", ('{"model": "%s", "prompt": "hi", "stop": ["\\udfff"]}'
                                % model).encode(), 400, ()),
        "invalid UTF-8": ("/v1/completions",
                          b'{"model": "' + model.encode() + b'", "prompt": "\xff\xfe\xfd"}',
                          400, ()),
        "JSON nested 100000 deep": ("/v1/completions",
                                    b'{"prompt": "hi", "x": ' + b"[" * 100000 + b"]" * 100000
                                    + b"}", 400, ()),
        "a request chat_template": ("/v1/chat/completions",
                                    {"model": model, "messages": chat,
                                     "chat_template": "{{ messages[0]['content'] }}"},
                                    400, ("--trust-request-chat-template",)),
        "a schema nested 120 deep": ("/v1/chat/completions", {
            "model": model, "messages": chat, "max_tokens": 4, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": deep_schema}}},
            400, ("nested deeper",)),
        "a 300 KB schema": ("/v1/completions", {**c, "structured_outputs": {"json": wide_schema}},
                            400, ("characters long",)),
        "a 1 MB regex": ("/v1/completions", {**c, "structured_outputs": {"regex": "a" * 10**6}},
                         400, ("characters long",)),
        "an invalid grammar": ("/v1/completions", {**c, "structured_outputs": {
            "grammar": "root ::= (("}}, 400, ("grammar",)),
    }


def test_hostile_parameters_are_4xx_and_the_server_stays_healthy(
        server: RemoteServer, client: openai.OpenAI, model_name: str) -> None:
    results = {}
    for name, (path, body, status, words) in _cases(model_name).items():
        t0 = time.monotonic()
        r = (_raw(server, path, body) if isinstance(body, bytes)
             else httpx.post(server.url_for(path), json=body, timeout=60))
        results[name] = (r.status_code, round(time.monotonic() - t0, 2))
        _assert_error(r, status, *words)
        assert time.monotonic() - t0 < 10, (name, results[name])
        _healthy(server, client, model_name)
    print("hostile cases:", results)


def test_the_official_client_gets_the_400s(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError, match="--max-n-sequences"):
        client.completions.create(model=model_name, prompt="hi", n=MAX_N_SEQUENCES + 1,
                                  max_tokens=1, temperature=1)
    with pytest.raises(openai.BadRequestError, match="max_logprobs"):
        client.chat.completions.create(model=model_name, messages=[{"role": "user",
                                                                    "content": "hi"}],
                                       logprobs=True, top_logprobs=21, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model_name, prompt="hi", max_tokens=MAX_MODEL_LEN)
    # At the limit: accepted.
    out = client.completions.create(model=model_name, prompt="hi", n=4, max_tokens=1,
                                    temperature=1, stop=[f"s{i}" for i in range(256)])
    assert len(out.choices) == 4


# ---------------------------------------------------------------------- connections
def test_idle_and_slow_header_connections_are_closed(server: RemoteServer,
                                                     client: openai.OpenAI,
                                                     model_name: str) -> None:
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(1000)]
    slow = []
    try:
        for _ in range(50):      # a request head that never completes
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            slow.append(s)
        t0 = time.monotonic()
        _healthy(server, client, model_name)    # answered meanwhile
        assert time.monotonic() - t0 < 5
        for s in slow[:10]:      # a byte every second does not keep one open
            s.sendall(b"X")
        time.sleep(7.0)          # the server's 5 s head timeout, and slack
        still_open = [s for s in idle + slow if _is_open(s)]
        assert not still_open, f"{len(still_open)} of {len(idle) + len(slow)} still open"
        _healthy(server, client, model_name)
    finally:
        for s in idle + slow:
            s.close()


def _is_open(s: socket.socket) -> bool:
    """Whether the server has kept the connection open (no EOF, no reset)."""
    s.settimeout(0.05)
    try:
        return s.recv(1 << 16) != b""
    except socket.timeout:
        return True
    except (ConnectionResetError, OSError):
        return False


def test_a_client_that_never_reads_its_stream(server: RemoteServer, client: openai.OpenAI,
                                              model_name: str) -> None:
    """The engine finishes the request although nobody reads; the API server holds the
    pending output (bounded by max_tokens) without growing past it; once the client reads,
    the whole stream arrives."""
    body = json.dumps({"model": model_name, "prompt": "hi", "max_tokens": 200, "n": 8,
                       "temperature": 1, "ignore_eos": True, "logprobs": 20,
                       "stream": True}).encode()
    api = psutil.Process(server.proc.pid)
    rss0 = api.memory_info().rss
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 120
        while True:      # the engine runs it to the end while the client reads nothing
            m = httpx.get(server.url_for("/metrics")).text
            running = [line for line in m.splitlines()
                       if line.startswith("kvserve:num_requests_running")]
            if running and all(float(line.split()[-1]) == 0 for line in running):
                break
            assert time.monotonic() < deadline, running
            time.sleep(0.5)
        _healthy(server, client, model_name)
        assert api.memory_info().rss - rss0 < 64 << 20
        s.settimeout(30)
        data = b""
        while not data.endswith(b"data: [DONE]\n\n") and not data.endswith(b"0\r\n\r\n"):
            more = s.recv(1 << 20)
            assert more, "the stream ended early"
            data += more
        text = data.decode(errors="replace")
        assert "data: [DONE]" in text
        assert text.count('"finish_reason":"length"') == 8
    finally:
        s.close()
    _healthy(server, client, model_name)
