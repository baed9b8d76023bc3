"""Prometheus metrics with vLLM's names under the `kvserve:` prefix.

Every metric carries the labels `model_name` and `engine`. Counters are exported with the
`_total` suffix (`kvserve:prompt_tokens_total`). The scheduler reports cumulative totals, so
counters are advanced by the difference to the largest total seen: any number of reports, in
any order (per batch, or a fresh one taken when /metrics is scraped), count each event once.

Each logger owns a CollectorRegistry (unless given one): two servers, or two tests, in one
process never register the same metric twice.

Several API server processes (`--api-server-count N`) use prometheus_client's multiprocess
mode (PROMETHEUS_MULTIPROC_DIR, set by the launcher before they start): each process writes
its values to files there, and /metrics on any of them merges all: counters and histograms
are summed (each server counts only its own requests), gauges take the most recent value.
The engine-side totals (prefix cache, preemptions, ...) reach every server, so only one of
them (`count_engine_totals`) turns them into counters.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Optional

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest, multiprocess)

from kvserve.metrics.loggers import StatLoggerBase

PREFIX = "kvserve:"

# vLLM's bucket boundaries, so dashboards built for vLLM read the same.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

# The engine's cumulative totals (scheduler stats key, metric name, doc) -> counters.
_ENGINE_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "prefix_cache_hits",
     "Prefix cache hits, in terms of number of cached tokens."),
    ("num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
    # KV connector (disaggregated prefill/decode, shared storage); 0 without one.
    ("external_prefix_cache_queries", "external_prefix_cache_queries",
     "External prefix cache queries from KV connector, in terms of queried tokens."),
    ("external_prefix_cache_hits", "external_prefix_cache_hits",
     "External prefix cache hits from KV connector, in terms of loadable tokens."),
    ("kv_local_fallbacks", "kv_transfer_local_fallbacks",
     "Requests computed locally because loading their KV failed or timed out."),
    ("kv_transfers", "kv_transfers", "Completed KV loads (one per request)."),
    ("kv_transfers_started", "kv_transfers_started",
     "KV loads posted (completed, failed or in flight)."),
    ("kv_transfer_bytes", "kv_transfer_bytes", "Bytes of KV loaded."),
    ("kv_transfer_time_s", "kv_transfer_time_seconds", "Seconds spent in completed KV loads."),
)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """[1, 2, 5, 10, 20, 50, ...] up to max_value (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class PrometheusStatLogger(StatLoggerBase):
    def __init__(self, model_name: str, engine_index: int = 0, *, max_model_len: int = 2048,
                 max_num_batched_tokens: Optional[int] = None,
                 registry: Optional[CollectorRegistry] = None,
                 count_engine_totals: bool = True) -> None:
        self.count_engine_totals = count_engine_totals
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.engine_index = engine_index
        self._label_values = (model_name, str(engine_index))
        self._lock = threading.Lock()
        self._last_totals: dict[str, int] = {}
        self._init_engine_metrics()
        self._init_request_metrics(max_model_len)
        self._init_spec_and_step_metrics(max_num_batched_tokens)

    def _shared(self, cls: Any, name: str, doc: str, *extra_labels: str, **kw: Any) -> Any:
        # One collector per metric in a registry; each engine (data parallelism) logs
        # through its own `engine` label of it.
        existing = getattr(self.registry, "_names_to_collectors", {}).get(PREFIX + name)
        return existing if existing is not None else cls(
            PREFIX + name, doc, ["model_name", "engine", *extra_labels], registry=self.registry,
            **kw)

    def _gauge(self, name: str, doc: str) -> Any:
        return self._shared(Gauge, name, doc,
                            multiprocess_mode="mostrecent").labels(*self._label_values)

    def _counter(self, name: str, doc: str) -> Any:
        return self._shared(Counter, name, doc).labels(*self._label_values)

    def _histogram(self, name: str, doc: str, buckets: list) -> Any:
        return self._shared(Histogram, name, doc, buckets=buckets).labels(*self._label_values)

    def _init_engine_metrics(self) -> None:
        """Scheduler state (gauges) and the engine's cumulative totals (counters)."""
        (self.gauge_running, self.gauge_waiting, self.gauge_kv_cache_usage,
         self.gauge_kv_transfers_in_flight) = (self._gauge(name, doc) for name, doc in (
            ("num_requests_running", "Number of requests in model execution batches."),
            ("num_requests_waiting", "Number of requests waiting to be processed."),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            ("kv_transfers_in_flight", "KV loads posted and not yet done or failed.")))
        self.counters = {key: self._counter(name, doc) for key, name, doc in _ENGINE_COUNTERS}

    def _init_request_metrics(self, max_model_len: int) -> None:
        """Tokens, finished requests, latencies, a request's phases and sizes."""
        self.counter_prompt_tokens = self._counter("prompt_tokens",
                                                   "Number of prefill tokens processed.")
        self.counter_generation_tokens = self._counter("generation_tokens",
                                                       "Number of generation tokens processed.")
        self._request_success = self._shared(Counter, "request_success",
                                             "Count of successfully processed requests.",
                                             "finished_reason")
        for reason in ("stop", "length", "abort"):   # present (at 0) before the first request
            self._request_success.labels(*self._label_values, reason)
        self.hist_ttft, self.hist_itl, self.hist_tpot, self.hist_e2e = (
            self._histogram(name, f"Histogram of {what}.", buckets) for name, what, buckets in (
                ("time_to_first_token_seconds", "time to first token in seconds", TTFT_BUCKETS),
                ("inter_token_latency_seconds", "inter-token latency in seconds", ITL_BUCKETS),
                ("request_time_per_output_token_seconds",
                 "time_per_output_token_seconds per request", ITL_BUCKETS),
                ("e2e_request_latency_seconds", "e2e request latency in seconds",
                 REQUEST_LATENCY_BUCKETS)))
        # A request's phases (FinishedRequestStats.<phase>_time, from the engine's events).
        self.hist_phases = {
            phase: self._histogram(f"request_{name}_time_seconds",
                                   f"Histogram of time spent in {label} phase for request.",
                                   REQUEST_LATENCY_BUCKETS)
            for phase, name, label in (("queued", "queue", "WAITING"),
                                       ("prefill", "prefill", "PREFILL"),
                                       ("decode", "decode", "DECODE"),
                                       ("inference", "inference", "RUNNING"))}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.hist_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.hist_generation_tokens = self._histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets)

    def _init_spec_and_step_metrics(self, max_num_batched_tokens: Optional[int]) -> None:
        self._spec_counters = {
            key: self._counter(f"spec_decode_{key}", doc) for key, doc in (
                ("num_drafts", "Number of spec decoding drafts."),
                ("num_draft_tokens", "Number of draft tokens."),
                ("num_accepted_tokens", "Number of accepted tokens."))}
        self._spec_per_pos = self._shared(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.", "position")
        iteration_buckets = [b for b in ITERATION_TOKEN_BUCKETS
                             if max_num_batched_tokens is None or b <= max_num_batched_tokens]
        self.hist_iteration_tokens = self._histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            iteration_buckets)

    # ------------------------------------------------------------------ recording
    def record(self, scheduler_stats: Optional[dict], iteration_stats: Any) -> None:
        if scheduler_stats:
            self.update_scheduler_stats(scheduler_stats)
        if iteration_stats is not None:
            self._record_iteration(iteration_stats)

    def update_scheduler_stats(self, stats: dict) -> None:
        self.gauge_running.set(stats.get("num_running_reqs", 0))
        self.gauge_waiting.set(stats.get("num_waiting_reqs", 0))
        self.gauge_kv_cache_usage.set(stats.get("kv_cache_usage", 0.0))
        self.gauge_kv_transfers_in_flight.set(stats.get("num_kv_transfers_in_flight", 0))
        if not self.count_engine_totals:
            return
        with self._lock:
            for key, counter in self.counters.items():
                if key in stats:   # int counts; kv_transfer_time_s is float seconds
                    self._advance(key, stats[key], counter)
            if stats.get("spec_decoding"):
                self._update_spec_decoding(stats["spec_decoding"])

    def _update_spec_decoding(self, spec: dict) -> None:
        """Cumulative speculative decoding totals -> counters (caller holds the lock)."""
        for key, counter in self._spec_counters.items():
            self._advance("spec_" + key, int(spec[key]), counter)
        for i, total in enumerate(spec["num_accepted_tokens_per_pos"]):
            # Every position is exported, at 0 until one is accepted.
            self._advance(f"spec_pos{i}", int(total),
                          self._spec_per_pos.labels(*self._label_values, str(i)))

    def _advance(self, key: str, total: float, counter: Any) -> None:
        """Advance `counter` by what cumulative `total` adds (caller holds the lock). A smaller
        total is an older report arriving late (a /metrics refresh can overtake a batch's
        report): it has nothing new."""
        last = self._last_totals.get(key, 0)
        if total > last:
            self._last_totals[key] = total
            counter.inc(total - last)

    def _record_iteration(self, it: Any) -> None:
        if it.num_prompt_tokens:
            self.counter_prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.counter_generation_tokens.inc(it.num_generation_tokens)
        num_tokens = it.num_prompt_tokens + it.num_generation_tokens
        if num_tokens:
            self.hist_iteration_tokens.observe(num_tokens)
        for t in it.time_to_first_tokens_iter:
            self.hist_ttft.observe(t)
        for t in it.inter_token_latencies_iter:
            self.hist_itl.observe(t)
        for req in it.finished_requests:
            self._request_success.labels(*self._label_values, str(req.finish_reason)).inc()
            self.hist_e2e.observe(req.e2e_latency)
            self.hist_prompt_tokens.observe(req.num_prompt_tokens)
            self.hist_generation_tokens.observe(req.num_generation_tokens)
            if req.num_generation_tokens > 1:
                self.hist_tpot.observe((req.e2e_latency - req.first_token_latency)
                                       / (req.num_generation_tokens - 1))
            for phase, hist in self.hist_phases.items():
                value = getattr(req, f"{phase}_time")
                if value is not None:
                    hist.observe(value)

    # ------------------------------------------------------------------ exposition
    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type (for GET /metrics)."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):     # every API server's values
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
