"""Engine metrics: Prometheus exposition (`prometheus.py`) and the periodic log line
(`loggers.py`). Both are stat loggers: callables `(scheduler_stats, iteration_stats)` that
AsyncLLM calls once per batch of engine outputs."""
from kvserve.metrics.loggers import LoggingStatLogger, StatLoggerBase
from kvserve.metrics.prometheus import PrometheusStatLogger

__all__ = ["LoggingStatLogger", "PrometheusStatLogger", "StatLoggerBase"]
