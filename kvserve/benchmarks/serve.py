"""`kvserve bench serve`: online serving benchmark against a running OpenAI-compatible server.

Drives any server that speaks `/v1/completions` with streaming (kvserve, vLLM, ...) the way
`vllm bench serve` does, with the same flags and result keys, so users' scripts read ours:

- Requests come from `kvserve.benchmarks.datasets` as token-id prompts (the same tokens every
  backend sees); each is one streamed `POST /v1/completions` (`stream: true`,
  `stream_options.include_usage`, `max_tokens` = the request's output length, greedy unless
  `--temperature`; `ignore_eos: true` with `--ignore-eos`).
- Arrivals: all at once with `--request-rate inf`, else a gamma process whose mean rate is
  `--request-rate` and whose shape is `--burstiness` (1 = Poisson; < 1 burstier, > 1 more
  regular). `--max-concurrency` caps the requests in flight (a client-side semaphore; time spent
  waiting for it is not counted in the request's latency, as in vLLM).
- Per request: TTFT (first streamed chunk with choices), ITL (gaps between chunks), E2E latency
  (up to the last chunk with choices), TPOT = (E2E - TTFT) / (output tokens - 1); output tokens
  from the server's usage, or by tokenizing the streamed text when the server sends none.
- Reported: `completed`, `failed`, `duration`, token totals, `request_throughput`,
  `output_throughput`, `total_token_throughput`, `request_goodput` (with `--goodput`), and
  `mean_ / median_ / std_ / p{P}_` x `ttft_ms / tpot_ms / itl_ms / e2el_ms` for the metrics in
  `--percentile-metrics` and the percentiles in `--metric-percentiles`.

Unlike vLLM, the `--num-warmups` requests use a prompt of their own (the first prompt reversed),
so warm-up cannot put the benchmark's first prompt in the server's prefix cache.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import logging
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, AsyncIterator, Optional, Sequence

import numpy as np

from kvserve.benchmarks.datasets import SampleRequest, add_dataset_args, get_samples
from kvserve.benchmarks.weights import served_weights_label

logger = logging.getLogger(__name__)

MS_PER_S = 1000.0
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
# Per-request lists that only go into the saved JSON with --save-detailed (as in vLLM).
DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")
# The whole benchmark may stream for hours: no per-request read timeout (vLLM uses 6 h).
HTTP_TIMEOUT_S = 6 * 60 * 60


# ---------------------------------------------------------------------------------------------
# One request

@dataclass
class RequestFuncInput:
    """What one streamed completion call sends."""
    prompt: list[int]
    prompt_len: int
    output_len: int
    model: str
    api_url: str
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestFuncOutput:
    """What one streamed completion call measured (times in seconds)."""
    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: Optional[int] = None    # from the server's usage, when it sent one
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0               # perf_counter() when the request was sent
    error: str = ""


def _headers() -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    api_key = os.environ.get("OPENAI_API_KEY")
    if api_key:   # vLLM's bench serve reads the same variable
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def async_request_openai_completions(client: Any, inp: RequestFuncInput,
                                          pbar: Optional[Any] = None) -> RequestFuncOutput:
    """One streamed `/v1/completions` call; never raises (failures land in `.error`)."""
    payload: dict[str, Any] = {
        "model": inp.model,
        "prompt": inp.prompt,
        "max_tokens": inp.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if inp.ignore_eos:   # a vLLM extension; only sent when asked, for strict servers' sake
        payload["ignore_eos"] = True
    payload.update(inp.extra_body)
    out = RequestFuncOutput(prompt_len=inp.prompt_len)
    text_parts: list[str] = []
    got_chunk = False
    start = most_recent = time.perf_counter()
    out.start_time = start
    try:
        async with client.stream("POST", inp.api_url, json=payload, headers=_headers()) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {body[:1000]}"
                return out
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue   # blank separators, SSE comments (": ping"), event names
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:   # an error after the stream started
                    err = chunk["error"]
                    out.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                    return out
                if chunk.get("choices"):
                    if not got_chunk:
                        got_chunk = True
                        out.ttft = now - start
                    else:
                        out.itl.append(now - most_recent)
                    most_recent = now
                    text_parts.append(chunk["choices"][0].get("text") or "")
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"].get("completion_tokens")
        if got_chunk:
            out.success = True
            out.latency = most_recent - start
        else:
            out.error = "The stream ended without a chunk that has choices."
    except Exception as e:   # connection reset, bad JSON, ...: a failed request, not a crash
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.generated_text = "".join(text_parts)
        if pbar is not None:
            pbar.update(1)
    return out


# ---------------------------------------------------------------------------------------------
# Arrivals

def arrival_intervals(num_requests: int, request_rate: float, burstiness: float = 1.0,
                      seed: int = 0) -> np.ndarray:
    """Seconds to wait before each request: zeros at rate inf, else gamma(shape=burstiness,
    scale=1 / (rate * burstiness)) draws, whose mean is 1 / rate whatever the burstiness
    (burstiness 1 is exponential: a Poisson process)."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}.")
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}.")
    if request_rate == float("inf"):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)


async def get_request(requests: Sequence[SampleRequest], intervals: np.ndarray
                      ) -> AsyncIterator[SampleRequest]:
    """Yield each request at its arrival time. Waits are kept against the schedule's absolute
    times, so event-loop delays do not accumulate into a lower rate."""
    t0 = time.perf_counter()
    # The first request goes at once; request i waits for the gaps before it.
    due = np.concatenate([[0.0], np.cumsum(intervals[:-1])]) if len(intervals) else intervals
    for req, at in zip(requests, due):
        delay = t0 + float(at) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield req


# ---------------------------------------------------------------------------------------------
# Metrics

def parse_goodput(items: Optional[Sequence[str]]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"Bad --goodput item {item!r}: use KEY:MS with KEY one of "
                             f"{', '.join(GOODPUT_METRICS)} (e.g. ttft:500 tpot:50).")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"Bad --goodput value in {item!r}: not a number of ms.") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {name} must be >= 0 ms, got {value}.")
    return slos


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if float(p).is_integer() else str(p)


def _stats(values: Sequence[float], name: str, percentiles: Sequence[float]) -> dict[str, float]:
    """mean / median / std / p{P} of `values` (seconds) in ms; zeros when there are none."""
    arr = np.asarray(values, dtype=np.float64) * MS_PER_S
    if arr.size == 0:
        arr = np.zeros(1)
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def _peak_rates(outputs: Sequence[RequestFuncOutput]) -> tuple[float, int]:
    """(most output chunks in any whole second of the run, most requests in flight at once):
    vLLM's `max_output_tokens_per_s` / `max_concurrent_requests`. Chunks stand in for tokens
    (servers stream one token per chunk unless they merge several). Unlike vLLM, which counts
    every request active at some point of a one-second bucket (and can report more than
    --max-concurrency), the concurrency is the exact maximum overlap of [send, last chunk]."""
    done = [o for o in outputs if o.success]
    if not done:
        return 0.0, 0
    t0 = min(o.start_time for o in done)
    chunk_times = np.concatenate([o.start_time - t0 + o.ttft + np.cumsum([0.0, *o.itl])
                                  for o in done])
    peak_tokens = float(np.bincount(chunk_times.astype(np.int64)).max())
    starts = np.array([o.start_time for o in done])
    ends = starts + np.array([o.latency for o in done])
    times = np.concatenate([starts, ends])
    deltas = np.concatenate([np.ones(len(done), np.int64), -np.ones(len(done), np.int64)])
    order = np.lexsort((deltas, times))   # by time; at a tie, an end before a start
    return peak_tokens, int(np.cumsum(deltas[order]).max())


def calculate_metrics(input_requests: Sequence[SampleRequest],
                      outputs: Sequence[RequestFuncOutput], duration: float, tokenizer: Any,
                      selected_percentile_metrics: Sequence[str],
                      selected_percentiles: Sequence[float],
                      goodput_config: Optional[dict[str, float]] = None
                      ) -> tuple[dict[str, Any], list[int]]:
    """vLLM's serving metrics from the measured requests: (metrics, output tokens per request,
    0 for failed ones). TPOT is only defined for requests with more than one output token."""
    output_lens: list[int] = []
    ttfts, e2els, itls, tpots, all_tpots = [], [], [], [], []
    completed = total_input = 0
    for req, out in zip(input_requests, outputs):
        if not out.success:
            output_lens.append(0)
            continue
        n_out = out.output_tokens
        if n_out is None:   # no usage from the server: count the streamed text's tokens
            n_out = len(tokenizer.encode(out.generated_text, add_special_tokens=False))
        output_lens.append(n_out)
        total_input += req.prompt_len
        tpot = (out.latency - out.ttft) / (n_out - 1) if n_out > 1 else 0.0
        if n_out > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls.extend(out.itl)
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        completed += 1
    if completed == 0:
        logger.warning("All requests failed: is the server up and the model name right? "
                       "First error: %s", outputs[0].error if outputs else "none")
    good = None
    if goodput_config:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        slo_s = [(per_metric[k], v / MS_PER_S) for k, v in goodput_config.items()]
        good = sum(all(values[i] <= slo for values, slo in slo_s) for i in range(completed))
    total_output = int(sum(output_lens))
    peak_tokens, peak_concurrency = _peak_rates(outputs)
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "request_goodput": good / duration if good is not None else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_concurrency,
    }
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in selected_percentile_metrics:
        metrics.update(_stats(series[name], name, selected_percentiles))
    return metrics, output_lens


# ---------------------------------------------------------------------------------------------
# The benchmark

async def benchmark(client: Any, api_url: str, model_id: str,
                    input_requests: Sequence[SampleRequest], tokenizer: Any,
                    request_rate: float = float("inf"), burstiness: float = 1.0,
                    max_concurrency: Optional[int] = None, num_warmups: int = 0,
                    ignore_eos: bool = False, extra_body: Optional[dict[str, Any]] = None,
                    selected_percentile_metrics: Sequence[str] = PERCENTILE_METRICS,
                    selected_percentiles: Sequence[float] = (99,),
                    goodput_config: Optional[dict[str, float]] = None, seed: int = 0,
                    disable_tqdm: bool = False) -> dict[str, Any]:
    """Send `input_requests` to `api_url` on the arrival schedule; the metrics plus the
    per-request lists (`input_lens`, `output_lens`, `ttfts`, `itls`, `generated_texts`, `errors`)."""
    from tqdm.asyncio import tqdm

    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}.")
    intervals = arrival_intervals(len(input_requests), request_rate, burstiness, seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    def make_input(req: SampleRequest) -> RequestFuncInput:
        return RequestFuncInput(prompt=req.prompt_token_ids, prompt_len=req.prompt_len,
                                output_len=req.expected_output_len, model=model_id,
                                api_url=api_url, ignore_eos=ignore_eos,
                                extra_body=dict(extra_body or {}))

    async def limited(inp: RequestFuncInput, pbar: Optional[Any]) -> RequestFuncOutput:
        if semaphore is None:
            return await async_request_openai_completions(client, inp, pbar)
        async with semaphore:
            return await async_request_openai_completions(client, inp, pbar)

    if num_warmups > 0:
        first = input_requests[0]
        warm = make_input(SampleRequest(first.prompt_token_ids[::-1], first.expected_output_len))
        print(f"Warming up with {num_warmups} requests...")
        warm_out = await asyncio.gather(*(limited(warm, None) for _ in range(num_warmups)))
        if not all(o.success for o in warm_out):
            bad = next(o for o in warm_out if not o.success)
            raise RuntimeError(f"A warm-up request failed: {bad.error}")

    rate_text = "inf" if request_rate == float("inf") else f"{request_rate:g}"
    print(f"Traffic request rate: {rate_text} req/s, burstiness {burstiness:g}, "
          f"max concurrency {max_concurrency or 'unlimited'}")
    pbar = None if disable_tqdm else tqdm(total=len(input_requests))
    start = time.perf_counter()
    tasks = []
    async for req in get_request(input_requests, intervals):
        tasks.append(asyncio.create_task(limited(make_input(req), pbar)))
    outputs: list[RequestFuncOutput] = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()

    metrics, output_lens = calculate_metrics(input_requests, outputs, duration, tokenizer,
                                             selected_percentile_metrics, selected_percentiles,
                                             goodput_config)
    return {
        **metrics,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }


METRIC_HEADERS = {"ttft": ("Time to First Token", "TTFT"),
                   "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
                   "itl": ("Inter-token Latency", "ITL"),
                   "e2el": ("End-to-end Latency", "E2EL")}


def format_summary(result: dict[str, Any], selected_percentile_metrics: Sequence[str],
                   selected_percentiles: Sequence[float]) -> str:
    """vLLM's "Serving Benchmark Result" table."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        fmt = "{:<40} {:<10.2f}" if isinstance(value, float) else "{:<40} {:<10}"
        lines.append(fmt.format(label, value))

    if result.get("weights"):
        lines.append(f"Weights: {result['weights']}")
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency"):
        row("Maximum request concurrency:", result["max_concurrency"])
    if result.get("request_rate") not in (None, "inf"):
        row("Request rate configured (RPS):", float(result["request_rate"]))
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    for name in selected_percentile_metrics:
        header, short = METRIC_HEADERS[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", result[f"median_{name}_ms"])
        for p in selected_percentiles:
            row(f"P{percentile_key(p)} {short} (ms):", result[f"p{percentile_key(p)}_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Server discovery

def base_url_of(args: argparse.Namespace) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    return f"http://{args.host}:{args.port}"


async def fetch_models(client: Any, base_url: str, timeout_s: float) -> list[dict[str, Any]]:
    """`GET /v1/models`, retried until the server answers or `timeout_s` passes (it may still
    be starting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            resp = await client.get(base_url + "/v1/models", headers=_headers())
            resp.raise_for_status()
            return list(resp.json().get("data") or [])
        except Exception as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"The server at {base_url} did not answer GET /v1/models "
                                   f"within {timeout_s:g} s: {type(e).__name__}: {e}") from None
            await asyncio.sleep(1.0)


def resolve_tokenizer_path(args: argparse.Namespace, card: Optional[dict[str, Any]]) -> str:
    """The local checkpoint directory whose tokenizer (and config.json) the prompts are built
    with: --tokenizer, else --model or the server's model `root`, where it is a directory."""
    from kvserve.model.demo import resolve_model_path

    candidates = [args.tokenizer] if args.tokenizer else [args.model, (card or {}).get("root")]
    for cand in candidates:
        if not cand:
            continue
        try:
            path = resolve_model_path(cand)
        except ValueError:
            if args.tokenizer:
                raise
            continue
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{path} has no config.json (needed for the model's vocabulary "
                             "size): pass --tokenizer CHECKPOINT_DIR.")
        return path
    raise ValueError("Cannot find the model's tokenizer: pass --tokenizer with the local "
                     "checkpoint directory the server runs (prompts are built as token ids).")


class BenchSession:
    """What every run against one server shares: the HTTP client, the model and tokenizer.
    The sweep makes one and runs the benchmark at several rates through it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base_url = base_url_of(args)
        self.api_url = self.base_url + "/" + args.endpoint.lstrip("/")
        if args.endpoint.rstrip("/").endswith("chat/completions"):
            raise ValueError("bench serve drives /v1/completions (token-id prompts); "
                             "chat completions are not supported.")
        self.selected_percentile_metrics = parse_percentile_metrics(args.percentile_metrics)
        self.selected_percentiles = parse_percentiles(args.metric_percentiles)
        self.goodput_config = parse_goodput(args.goodput)
        self.extra_body = self._extra_body(args)
        self.client: Any = None
        self.model_id = ""
        self.weights: Optional[str] = None     # a local GGUF file's quantization (weights.py)
        self.tokenizer_path = ""
        self.tokenizer: Any = None
        self.max_model_len: Optional[int] = None

    @staticmethod
    def _extra_body(args: argparse.Namespace) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(args.extra_body) if args.extra_body else {}
        if not isinstance(body, dict):
            raise ValueError("--extra-body must be a JSON object.")
        body.setdefault("temperature", args.temperature)   # greedy by default, as vLLM
        for name in ("top_p", "top_k", "min_p"):
            if getattr(args, name) is not None:
                body[name] = getattr(args, name)
        return body

    async def __aenter__(self) -> "BenchSession":
        try:
            import httpx
        except ImportError:
            raise RuntimeError("bench serve needs httpx: `pip install httpx`.") from None
        from kvserve.tokenizer import Tokenizer

        # httpx logs every request at INFO: thousands of lines that bury the progress bar.
        logging.getLogger("httpx").setLevel(logging.WARNING)

        limits = httpx.Limits(max_connections=self.args.max_concurrency,
                              max_keepalive_connections=self.args.max_concurrency)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(HTTP_TIMEOUT_S, connect=60.0),
                                        limits=limits)
        try:
            models = await fetch_models(self.client, self.base_url,
                                        self.args.ready_check_timeout_sec)
            card = next((m for m in models if m.get("id") == self.args.model),
                        models[0] if models else None)
            self.model_id = self.args.model or (card or {}).get("id") or ""
            if not self.model_id:
                raise ValueError(f"{self.base_url}/v1/models lists no model: pass --model.")
            self.max_model_len = (card or {}).get("max_model_len")
            self.weights = served_weights_label((card or {}).get("root") or self.model_id)
            self.tokenizer_path = resolve_tokenizer_path(self.args, card)
            self.tokenizer = Tokenizer.from_pretrained(self.tokenizer_path)
        except BaseException:
            await self.client.aclose()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.client.aclose()

    def samples(self, seed: int) -> list[SampleRequest]:
        ns = argparse.Namespace(**{**vars(self.args), "seed": seed})
        return get_samples(ns, self.tokenizer_path, self.tokenizer, self.max_model_len)

    async def run(self, request_rate: float, seed: int) -> dict[str, Any]:
        """One benchmark at `request_rate` on the dataset drawn with `seed`; vLLM's result
        dict (metadata, metrics and per-request lists)."""
        args = self.args
        requests = self.samples(seed)
        result = await benchmark(
            self.client, self.api_url, self.model_id, requests, self.tokenizer, request_rate,
            args.burstiness, args.max_concurrency, args.num_warmups, args.ignore_eos,
            self.extra_body, self.selected_percentile_metrics, self.selected_percentiles,
            self.goodput_config, seed, args.disable_tqdm)
        meta = {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "endpoint_type": "openai",
            "label": args.label,
            "base_url": self.base_url,
            "endpoint": args.endpoint,
            "model_id": self.model_id,
            "weights": self.weights,
            "tokenizer_id": self.tokenizer_path,
            "dataset_name": args.dataset_name,
            "num_prompts": len(requests),
            # JSON has no infinity: vLLM writes the string "inf".
            "request_rate": request_rate if request_rate < float("inf") else "inf",
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "ignore_eos": args.ignore_eos,
            "seed": seed,
            "goodput": self.goodput_config or None,
        }
        return {**meta, **result}


# ---------------------------------------------------------------------------------------------
# CLI

def parse_percentile_metrics(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics {text!r}: choose from "
                         f"{','.join(PERCENTILE_METRICS)}.")
    return names


def parse_percentiles(text: str) -> list[float]:
    try:
        ps = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles {text!r}: comma-separated numbers.") from None
    if not ps or any(not 0 < p < 100 for p in ps):
        raise ValueError(f"--metric-percentiles {text!r}: each must be in (0, 100).")
    return ps


def add_cli_args(parser: argparse.ArgumentParser, sweep: bool = False) -> argparse.ArgumentParser:
    """`bench serve`'s flags (vLLM's names); `sweep=True` leaves out `--request-rate` and the
    result-file flags, which the sweep replaces with its own."""
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", type=str, default=None,
                   help="Server URL, e.g. http://127.0.0.1:8000 (overrides --host/--port).")
    g.add_argument("--host", type=str, default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", type=str, default="/v1/completions",
                   help="Completions API path on the server.")
    g.add_argument("--model", type=str, default=None,
                   help="Served model name (default: the first of GET /v1/models).")
    g.add_argument("--tokenizer", type=str, default=None,
                   help="Local checkpoint directory for the tokenizer (default: --model, or "
                        "the server's model root, where it is a directory).")
    g.add_argument("--ready-check-timeout-sec", type=float, default=600.0,
                   help="How long to wait for the server to answer GET /v1/models.")
    add_dataset_args(parser)
    t = parser.add_argument_group("traffic")
    if not sweep:
        t.add_argument("--request-rate", type=float, default=float("inf"),
                       help="Mean requests per second; inf sends every request at once.")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier.")
    t.add_argument("--max-concurrency", type=int, default=None,
                   help="At most this many requests in flight (default: no limit).")
    t.add_argument("--num-warmups", type=int, default=0,
                   help="Untimed warm-up requests before the benchmark.")
    t.add_argument("--seed", type=int, default=0,
                   help="Seeds the prompts and the arrival times.")
    t.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    s = parser.add_argument_group("sampling")
    s.add_argument("--ignore-eos", action="store_true",
                   help="Send ignore_eos so every request generates exactly its output length.")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default).")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--min-p", type=float, default=None)
    s.add_argument("--extra-body", type=str, default=None,
                   help="JSON object merged into every request body.")
    m = parser.add_argument_group("metrics")
    m.add_argument("--percentile-metrics", type=str, default=",".join(PERCENTILE_METRICS),
                   help="Comma-separated metrics to report percentiles for "
                        f"({','.join(PERCENTILE_METRICS)}).")
    m.add_argument("--metric-percentiles", type=str, default="99",
                   help="Comma-separated percentiles to report, e.g. 50,90,99.")
    m.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="Service level objectives for goodput, e.g. ttft:500 tpot:50 e2el:2000 "
                        "(a request is good when it meets all of them).")
    m.add_argument("--label", type=str, default="kvserve-bench",
                   help="A name for this run, saved in the result.")
    if not sweep:
        r = parser.add_argument_group("results")
        r.add_argument("--save-result", action="store_true", help="Write the result as JSON.")
        r.add_argument("--save-detailed", action="store_true",
                       help="Also save per-request lists (lengths, TTFTs, ITLs, texts, errors).")
        r.add_argument("--result-dir", type=str, default=None,
                       help="Directory for the result file (default: the current one).")
        r.add_argument("--result-filename", type=str, default=None,
                       help="Result file name (default: "
                            "openai-{rate}qps[-concurrency{N}]-{model}-{date}.json).")
    return parser


def default_result_filename(result: dict[str, Any]) -> str:
    """vLLM's pattern: {backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json."""
    rate = result["request_rate"]
    conc = f"-concurrency{result['max_concurrency']}" if result.get("max_concurrency") else ""
    model = os.path.basename(str(result["model_id"]).rstrip("/")) or "model"
    return f"openai-{rate}qps{conc}-{model}-{result['date']}.json"


def strip_detailed(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in DETAILED_FIELDS}


def write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def main(args: argparse.Namespace) -> int:
    async def run() -> dict[str, Any]:
        async with BenchSession(args) as session:
            return await session.run(args.request_rate, args.seed)

    try:
        result = asyncio.run(run())
    except RuntimeError as e:   # server unreachable, warm-up failed: a message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_summary(result, parse_percentile_metrics(args.percentile_metrics),
                         parse_percentiles(args.metric_percentiles)))
    if args.save_result:
        saved = result if args.save_detailed else strip_detailed(result)
        name = args.result_filename or default_result_filename(result)
        path = os.path.join(args.result_dir, name) if args.result_dir else name
        write_json(path, saved)
        print(f"Saved the result to {path}")
    return 0 if result["completed"] > 0 else 1


if __name__ == "__main__":
    from kvserve.benchmarks.cli import main as _bench_main
    sys.exit(_bench_main(["serve", *sys.argv[1:]]))
