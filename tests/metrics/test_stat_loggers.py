"""Stat loggers on their own: Prometheus counters from cumulative totals, histograms from
IterationStats, per-logger registries, and the periodic log line."""
from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.output_processor import FinishedRequestStats, IterationStats
from kvserve.metrics.loggers import LoggingStatLogger
from kvserve.metrics.prometheus import PrometheusStatLogger
from kvserve.metrics.prometheus import build_1_2_5_buckets


def samples(logger: PrometheusStatLogger) -> dict[tuple, float]:
    body, content_type = logger.render()
    assert content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def value(logger: PrometheusStatLogger, name: str, **extra: str) -> float:
    labels = {"model_name": logger.model_name, "engine": str(logger.engine_index), **extra}
    return samples(logger)[(name, tuple(sorted(labels.items())))]


def sched(running: int, waiting: int, usage: float, queries: int, hits: int, preempt: int) -> dict:
    return dict(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=usage,
                num_free_blocks=0, num_total_blocks=0, prefix_cache_queries=queries,
                prefix_cache_hits=hits, num_preemptions=preempt)


def test_counters_advance_by_deltas_of_cumulative_totals() -> None:
    logger = PrometheusStatLogger("m", 0, max_model_len=256)
    logger(sched(3, 1, 0.25, 10, 4, 1), None)
    logger(sched(3, 1, 0.25, 10, 4, 1), None)        # the same report twice counts once
    logger.update_scheduler_stats(sched(0, 0, 0.0, 20, 4, 3))
    assert value(logger, "kvserve:prefix_cache_queries_total") == 20
    assert value(logger, "kvserve:prefix_cache_hits_total") == 4
    assert value(logger, "kvserve:num_preemptions_total") == 3
    assert value(logger, "kvserve:num_requests_running") == 0
    assert value(logger, "kvserve:kv_cache_usage_perc") == 0.0
    # An older report arriving late changes nothing; the next newer one counts its delta.
    logger(sched(0, 0, 0.0, 15, 4, 2), None)
    assert value(logger, "kvserve:prefix_cache_queries_total") == 20
    logger(sched(0, 0, 0.0, 23, 5, 3), None)
    assert value(logger, "kvserve:prefix_cache_queries_total") == 23
    assert value(logger, "kvserve:prefix_cache_hits_total") == 5


def test_iteration_stats_fill_counters_and_histograms() -> None:
    logger = PrometheusStatLogger("m", 1, max_model_len=256, max_num_batched_tokens=64)
    it = IterationStats(num_generation_tokens=5, num_prompt_tokens=12,
                        time_to_first_tokens_iter=[0.02, 0.3], inter_token_latencies_iter=[0.01] * 3,
                        finished_requests=[
                            FinishedRequestStats("stop", 1.0, 7, 5, 0.2, queued_time=0.1,
                                                 prefill_time=0.1, decode_time=0.8,
                                                 inference_time=0.9),
                            FinishedRequestStats("length", 2.0, 5, 1, 0.5)])
    logger(None, it)
    assert value(logger, "kvserve:prompt_tokens_total") == 12
    assert value(logger, "kvserve:generation_tokens_total") == 5
    assert value(logger, "kvserve:request_success_total", finished_reason="stop") == 1
    assert value(logger, "kvserve:request_success_total", finished_reason="length") == 1
    assert value(logger, "kvserve:request_success_total", finished_reason="abort") == 0
    assert value(logger, "kvserve:time_to_first_token_seconds_count") == 2
    assert value(logger, "kvserve:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert value(logger, "kvserve:inter_token_latency_seconds_count") == 3
    assert value(logger, "kvserve:e2e_request_latency_seconds_sum") == pytest.approx(3.0)
    assert value(logger, "kvserve:request_prompt_tokens_sum") == 12
    # Time per output token: (e2e - ttft) / (tokens - 1), for requests with 2+ tokens.
    assert value(logger, "kvserve:request_time_per_output_token_seconds_sum") == pytest.approx(0.2)
    assert value(logger, "kvserve:iteration_tokens_total_sum") == 17
    # Phase times only where the engine's events gave them.
    assert value(logger, "kvserve:request_queue_time_seconds_count") == 1
    assert value(logger, "kvserve:request_queue_time_seconds_sum") == pytest.approx(0.1)
    assert value(logger, "kvserve:request_decode_time_seconds_sum") == pytest.approx(0.8)
    assert value(logger, "kvserve:request_inference_time_seconds_count") == 1
    # Buckets stop at max_num_batched_tokens.
    assert ("kvserve:iteration_tokens_total_bucket",
            tuple(sorted({"model_name": "m", "engine": "1", "le": "128.0"}.items()))) not in samples(logger)


def test_each_logger_has_its_own_registry() -> None:
    a = PrometheusStatLogger("a", 0)
    b = PrometheusStatLogger("b", 0)   # same metric names: would raise on a shared registry
    a(None, IterationStats(num_prompt_tokens=3))
    assert value(a, "kvserve:prompt_tokens_total") == 3
    assert value(b, "kvserve:prompt_tokens_total") == 0


def test_build_1_2_5_buckets() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(256) == [1, 2, 5, 10, 20, 50, 100, 200]


def test_logging_stat_logger_line(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    logger = LoggingStatLogger(0, log_interval=5.0, clock=lambda: now[0])
    logger(sched(2, 1, 0.125, 100, 25, 0), IterationStats(num_prompt_tokens=400, num_generation_tokens=50))
    logger(None, IterationStats(num_generation_tokens=50))
    now[0] += 5.0
    with caplog.at_level(logging.DEBUG, logger="kvserve.metrics"):
        line = logger.log()
        assert line == ("Engine 000: Avg prompt throughput: 80.0 tokens/s, Avg generation "
                        "throughput: 20.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache "
                        "usage: 12.5%, Prefix cache hit rate: 25.0%")
        assert caplog.records[-1].levelno == logging.INFO
        # Hit rate over the window of recent intervals: 25 + 75 hits of 100 + 100 queries.
        logger.update_scheduler_stats(sched(0, 0, 0.0, 200, 100, 0))
        now[0] += 5.0
        assert "Prefix cache hit rate: 50.0%" in logger.log()
        assert "Avg prompt throughput: 0.0 tokens/s" in caplog.records[-1].getMessage()
        now[0] += 5.0
        logger.log()                       # idle twice in a row: DEBUG only
        assert caplog.records[-1].levelno == logging.DEBUG
