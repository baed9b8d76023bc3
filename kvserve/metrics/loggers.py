"""Stat loggers and the periodic throughput log line.

A stat logger is called once per batch of engine outputs with the scheduler's snapshot (a
dict of SchedulerStats; counters cumulative since the engine started) and the frontend's
IterationStats (tokens, latencies and finished requests of that batch); either may be None.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Optional

from kvserve.metrics.spec_decode import SpecDecodingLogging

logger = logging.getLogger("kvserve.metrics")


class StatLoggerBase:
    """`logger(scheduler_stats, iteration_stats)` records; `log()` reports (if it does)."""

    def __call__(self, scheduler_stats: Optional[dict], iteration_stats: Any) -> None:
        self.record(scheduler_stats, iteration_stats)

    def record(self, scheduler_stats: Optional[dict], iteration_stats: Any) -> None:
        raise NotImplementedError

    def log(self) -> Optional[str]:
        return None


class LoggingStatLogger(StatLoggerBase):
    """vLLM's log line, every `log_interval` seconds (the server calls `log()` on a timer):

    Engine 000: Avg prompt throughput: 120.3 tokens/s, Avg generation throughput: 45.1
    tokens/s, Running: 3 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit
    rate: 40.0%

    Throughputs are over the interval; the prefix cache hit rate is over the last
    `hit_rate_window` intervals with queries. An idle engine logs at DEBUG, so a quiet
    server does not fill its log.
    """

    def __init__(self, engine_index: int = 0, log_interval: float = 5.0,
                 hit_rate_window: int = 12, clock: Callable[[], float] = time.monotonic,
                 log: Optional[logging.Logger] = None) -> None:
        self.engine_index = engine_index
        self.log_interval = log_interval
        self._clock = clock
        self._logger = log or logger
        self._lock = threading.Lock()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_log_time = clock()
        self._last_throughputs = (0.0, 0.0)
        self._scheduler_stats: Optional[dict] = None
        self._last_queries = 0
        self._last_hits = 0
        self._hit_window: collections.deque[tuple[int, int]] = collections.deque(maxlen=hit_rate_window)
        self._spec_logging = SpecDecodingLogging()

    def record(self, scheduler_stats: Optional[dict], iteration_stats: Any) -> None:
        with self._lock:
            if scheduler_stats:
                self._scheduler_stats = scheduler_stats
            if iteration_stats is not None:
                self._num_prompt_tokens += iteration_stats.num_prompt_tokens
                self._num_generation_tokens += iteration_stats.num_generation_tokens

    def update_scheduler_stats(self, scheduler_stats: dict) -> None:
        """A fresher snapshot (e.g. just asked for) than the last batch's."""
        with self._lock:
            self._scheduler_stats = scheduler_stats

    def log(self) -> Optional[str]:
        with self._lock:
            now = self._clock()
            elapsed = max(now - self._last_log_time, 1e-9)
            prompt_tp = self._num_prompt_tokens / elapsed
            gen_tp = self._num_generation_tokens / elapsed
            self._num_prompt_tokens = self._num_generation_tokens = 0
            self._last_log_time = now
            stats = self._scheduler_stats or {}
            queries = int(stats.get("prefix_cache_queries", 0))
            hits = int(stats.get("prefix_cache_hits", 0))
            dq, dh = queries - self._last_queries, hits - self._last_hits
            if dq > 0 and dh >= 0:   # totals only grow; anything else is an older report
                self._last_queries, self._last_hits = queries, hits
                self._hit_window.append((dq, dh))
            window_q = sum(q for q, _ in self._hit_window)
            hit_rate = 100.0 * sum(h for _, h in self._hit_window) / window_q if window_q else 0.0
            idle = prompt_tp == 0 and gen_tp == 0 and self._last_throughputs == (0.0, 0.0)
            self._last_throughputs = (prompt_tp, gen_tp)
            spec_line = self._spec_logging.make_line(stats.get("spec_decoding"), elapsed)
        message = (
            f"Engine {self.engine_index:03d}: Avg prompt throughput: {prompt_tp:.1f} tokens/s, "
            f"Avg generation throughput: {gen_tp:.1f} tokens/s, "
            f"Running: {int(stats.get('num_running_reqs', 0))} reqs, "
            f"Waiting: {int(stats.get('num_waiting_reqs', 0))} reqs, "
            f"KV cache usage: {100.0 * float(stats.get('kv_cache_usage', 0.0)):.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%")
        self._logger.log(logging.DEBUG if idle else logging.INFO, message)
        if spec_line:
            self._logger.info(spec_line)
            message += "\n" + spec_line
        return message
